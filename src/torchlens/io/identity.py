"""Which model an extraction was made with: a checksum cheap enough to take on every ``tl.extract`` call.

A resumed extraction must continue with the very model that wrote its committed rows; the class name
alone cannot tell two checkpoints of one architecture apart.  The checksum covers the class, every
parameter's and buffer's name, shape and dtype, and their values: every byte of small tensors, and a
fixed, evenly spread sample of elements of large ones (so a multi-gigabyte model costs a few
thousand element reads, not a pass over its weights).  Two different trained checkpoints differ in
practically every element, so a sample is enough to tell them apart.
"""

from __future__ import annotations

import hashlib
import sys

import torch

from ..errors import first_few
from ..record.layouts import wrapped_tensors
from ..tree import unmaterialized, without_values
from .encode import has_no_storage
from .tensorfile import byte_view

FULL_HASH_ELEMENTS = 1 << 16  # tensors up to this many elements are hashed in full
SAMPLES_PER_TENSOR = 1024


def model_checksum(model) -> str:
    """A sha256 over ``model``'s class, its tensors' names, shapes, dtypes and (sampled) values."""
    lazy = unmaterialized(model)
    if lazy:  # no weights yet: the first forward makes them
        raise ValueError(f"tl.extract checks the model's weights to tell that a resumed extraction runs the same "
                         f"model, and its lazy modules are not yet materialized ({first_few(lazy)}): run one "
                         "forward first (model(x)) so that they have weights, then extract")
    digest = hashlib.sha256(_class_name(model).encode())
    if isinstance(model, torch.nn.Module):
        for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, t in named:
                digest.update(f"|{kind}:{name}:{tuple(t.shape)}:{t.dtype}".encode())
                digest.update(_value_bytes(t))
    return digest.hexdigest()


def own_values(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's sharded parameters, tensor parallelism's) shard on this rank, read without any
    collective (reshaping the DTensor itself could gather it from the other ranks); ``t`` for any other."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        return t.to_local()
    return t


def _class_name(model) -> str:
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"


def _value_bytes(t: torch.Tensor) -> bytes:
    t = own_values(t)
    if without_values(t) or t.is_quantized or t.layout != torch.strided or t.numel() == 0:
        return b""  # no values to read (meta), or no plain byte view of them: shapes and dtypes still count
    if has_no_storage(t):  # a wrapper subclass (torchao's quantized weights, TwoTensor): the tensors it wraps
        return b"".join(_value_bytes(wrapped) for wrapped in wrapped_tensors(t))
    flat = t.detach().reshape(-1)
    if flat.numel() > FULL_HASH_ELEMENTS:
        steps = torch.arange(SAMPLES_PER_TENSOR, dtype=torch.int64, device=flat.device)
        index = steps * (flat.numel() - 1) // (SAMPLES_PER_TENSOR - 1)
        flat = flat[index]
    flat = flat.to("cpu").contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return byte_view(flat).numpy().tobytes()
