"""Streaming reads and writes of the safetensors file layout, for files too big to hold in memory.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw little-endian bytes.  Knowing that, a tensor can be written piece by
piece (extraction appends shard after shard into one file) and read back as a memory map, neither of
which the library's whole-file ``save_file`` / ``load_file`` do.  Files written here are ordinary
safetensors files that the library reads too.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch

from ..record.layouts import permuted_strides
from .format import TRACE_JSON, TraceFileError, checked_member, require_safetensors

_MAX_HEADER = 100 << 20
_BLOCK_BYTES = 8 << 20  # what a streamed write copies at once, at most (beyond one row)
_ALIGN = 8
# safetensors dtype name -> torch dtype
DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
    ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"), ("C64", "complex64"),
    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"))}
NAME_OF = {dtype: name for name, dtype in DTYPES.items()}
# numpy dtype strings for the names numpy can map (bfloat16 and float8 it cannot)
NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
         "U8": "u1", "BOOL": "?", "C64": "<c8", "U16": "<u2", "U32": "<u4", "U64": "<u8"}


def read_header(path: str) -> tuple:
    """``(header dict, offset of the data section)``, checked against the file's real size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise TraceFileError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER, size - 8):
            raise TraceFileError(f"{path}: header length {length} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TraceFileError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise TraceFileError(f"{path}: safetensors header is not a table")
    data_start = 8 + length
    for key, entry in header.items():
        if key != "__metadata__":
            check_entry(path, key, entry, size - data_start)
    return header, data_start


def check_entry(path: str, key: str, entry, data_size: int) -> tuple:
    """``(torch dtype, shape, start, end)`` of one tensor entry, refusing anything inconsistent."""
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        start, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise TraceFileError(f"{path}: tensor {key!r} has a malformed header entry") from None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if min(shape, default=0) < 0 or not 0 <= start <= end <= data_size or end - start != nbytes:
        raise TraceFileError(f"{path}: tensor {key!r} claims bytes [{start}, {end}) for shape {shape}, which "
                             f"do not fit the file")
    return dtype, shape, start, end


def header_bytes(tensors: dict, metadata: dict | None = None) -> bytes:
    """The length prefix and JSON header for ``{name: (torch dtype, shape)}``, laid out in order."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, (dtype, shape) in tensors.items():
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": NAME_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)  # keep the data section aligned for memory maps
    return struct.pack("<Q", len(text)) + text


def write_tensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """Write ``{name: tensor}`` as a safetensors file, each tensor a block of rows at a time (``row_blocks``):
    none is copied whole, so a save never holds a second copy of what it writes."""
    _write(path, {name: (t.dtype, list(t.shape)) for name, t in tensors.items()},
           {name: [t] for name, t in tensors.items()}, metadata)


def write_stacked(path: str, columns: dict) -> None:
    """Write ``{name: [tensor, ...]}`` as a safetensors file holding each list joined along dim 0, one part
    after another: the joined tensors are never made, so the parts are not held twice while being written."""
    _write(path, {name: (parts[0].dtype, [sum(p.shape[0] for p in parts), *parts[0].shape[1:]])
                  for name, parts in columns.items()}, columns)


def _write(path: str, layout: dict, columns: dict, metadata: dict | None = None) -> None:
    with open(path, "wb") as f:
        f.write(header_bytes(layout, metadata))
        for parts in columns.values():
            for part in parts:
                for block in row_blocks(part):
                    f.write(byte_view(block).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def row_blocks(t: torch.Tensor):
    """``t``'s values in row order, as CPU tensors of about ``_BLOCK_BYTES`` (at least one row of dim 0):
    views of ``t`` where it already lies so on the CPU, else copies of one block at a time (a view with
    another layout, a conjugate or negative view, a tensor on an accelerator)."""
    t = t.detach()
    if t.dim() == 0:
        yield cpu_values(t)
        return
    row_bytes = max(t[0].numel() * t.element_size(), 1) if t.shape[0] else 1
    step = max(_BLOCK_BYTES // row_bytes, 1)
    for start in range(0, t.shape[0], step):
        yield cpu_values(t[start:start + step])


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``, a contiguous CPU tensor, as a flat ``uint8`` tensor sharing its memory.  Read with
    unit stride: torch calls a tensor contiguous whatever the strides of its dims of size 1, so one element
    (``logits[:, 0]`` at batch size 1, shape (1,), stride (C,)) can keep a stride that ``reshape(-1)`` keeps
    too and ``view(torch.uint8)`` refuses."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def cpu_values(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a contiguous CPU tensor in row order: conjugate and negative views resolved, so that
    its bytes are its values (``t`` itself where it already is one)."""
    return t.to("cpu").resolve_conj().resolve_neg().contiguous()


def hash_values(digest, name: str, t: torch.Tensor) -> None:
    """Feed ``t``'s values to ``digest`` (a hashlib object) under ``name``: a dense tensor's in row order, not a view's
    bytes, hashed in place; a sparse, nested or quantized one's through the dense tensors that define it (no
    sparse tensor has bytes of its own, and its dense copy could be far larger than it)."""
    for part, values in _value_parts(t):
        values = cpu_values(values)
        digest.update(f"{name}{part}{tuple(values.shape)}{values.dtype}".encode())
        digest.update(byte_view(values).numpy() if values.numel() else b"")


def _value_parts(t: torch.Tensor) -> list:
    """``[(part name, dense tensor)]`` holding ``t``'s values: ``t`` itself (named "") when it is dense."""
    if t.is_quantized:
        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            return [(f".q{t.q_scale()!r},{t.q_zero_point()}", t.int_repr())]
        return [(f".q{t.q_per_channel_axis()}", t.int_repr()), (".scales", t.q_per_channel_scales()),
                (".zero_points", t.q_per_channel_zero_points())]
    if t.is_nested:
        return [(f".{k}", component) for k, component in enumerate(t.unbind())]
    if t.layout == torch.sparse_coo:
        t = t.coalesce()  # one layout per set of values: an uncoalesced copy lists the same entries otherwise
        return [(".indices", t.indices()), (".values", t.values())]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [(".crow", t.crow_indices()), (".col", t.col_indices()), (".values", t.values())]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [(".ccol", t.ccol_indices()), (".row", t.row_indices()), (".values", t.values())]
    return [("", t)]


def copy_range(src: str, start: int, end: int, out) -> None:
    """Append bytes ``[start, end)`` of file ``src`` to the open file ``out`` in bounded chunks."""
    with open(src, "rb") as f:
        f.seek(start)
        remaining = end - start
        while remaining:
            block = f.read(min(remaining, 8 << 20))
            if not block:
                raise TraceFileError(f"{src}: ended before byte {end}; the file is truncated")
            out.write(block)
            remaining -= len(block)


def mapped(path: str, key: str, as_torch: bool, expected_dtype: str | None = None):
    """Tensor ``key`` of a safetensors file as a read-only memory map (numpy) or a copy-on-write one (torch).
    ``expected_dtype``: the safetensors dtype name a manifest gives it; a file holding another is refused."""
    header, data_start = read_header(path)
    if key not in header:
        raise TraceFileError(f"{path}: holds no tensor {key!r}")
    dtype, shape, start, end = check_entry(path, key, header[key], os.path.getsize(path) - data_start)
    name = header[key]["dtype"]
    if expected_dtype is not None and name != expected_dtype:  # same size, so only a hash would see it otherwise
        raise TraceFileError(f"{path}: holds dtype {name}, the manifest says {expected_dtype}")
    if not as_torch and name not in NUMPY:
        raise TypeError(f"{path}: numpy has no {NAME_OF.get(dtype, name)} dtype ({dtype}); "
                        "load with as_torch=True")
    raw = _mapped_bytes(path, data_start + start, data_start + end)
    if as_torch:
        if (data_start + start) % dtype.itemsize:
            raw = raw.clone()  # a tensor not aligned to its element size (written by other software)
        return raw.view(dtype).view(shape)
    return _read_only_memmap(raw, NUMPY[name], shape, path, data_start + start)


def _mapped_bytes(path: str, start: int, end: int) -> torch.Tensor:
    """Bytes ``[start, end)`` of file ``path`` as a ``uint8`` tensor over a copy-on-write memory map (writes stay
    in private pages, never reach the file), on the CPU whatever ``with torch.device(...)`` block is open.
    torch closes the file once it is mapped; Python's ``mmap`` (and so ``np.memmap``) keeps a descriptor open
    per map, and an extraction of a few hundred layers then exceeds the open-file limit (256 on macOS)."""
    refuse_fake_mode(path)
    if end == start:
        return torch.empty(0, dtype=torch.uint8, device="cpu")
    if not _utf8(path):  # torch takes UTF-8 names only; Linux allows any bytes, which Python's mmap maps
        return _python_mapped_bytes(path, start, end)
    return torch.from_file(path, shared=False, size=end, dtype=torch.uint8, device="cpu")[start:end]


def read_tensor_file(folder: str, name: str) -> dict:
    """Every tensor of the safetensors file ``name`` in ``folder`` (a saved trace's), on the CPU."""
    path = checked_member(folder, name)
    st = require_safetensors()
    refuse_fake_mode(path)
    try:
        if _utf8(path):
            return st.load_file(path, device="cpu")
        with open(path, "rb") as f:  # the library opens UTF-8 names only; Linux allows any bytes
            return st.load(f.read())
    except Exception as exc:  # the library raises its own error types for malformed headers
        raise TraceFileError(f"{path}: not a readable safetensors file ({exc})") from None


def fake_mode_active() -> bool:
    """Whether a ``FakeTensorMode`` is active: every tensor made or computed now has a shape and no values."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # (imported by torch itself)
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(mode, FakeTensorMode) for mode in _get_current_dispatch_mode_stack())


def refuse_fake_mode(path: str) -> None:
    """Refuse to read ``path``'s tensors under ``FakeTensorMode``: it makes tensors without values, so reading
    them failed inside torch (``aten::from_file``... no fake impl), or was reported as a damaged file."""
    if fake_mode_active():
        raise RuntimeError(f"{path}: a saved file's tensors are read as values, and this read runs under "
                           "FakeTensorMode, which makes tensors without values; call tl.load or tl.load_extracted "
                           "outside the FakeTensorMode block")


def _utf8(path: str) -> bool:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:  # a name os.fsdecode gave surrogates for: its bytes are not UTF-8
        return False
    return True


def _python_mapped_bytes(path: str, start: int, end: int) -> torch.Tensor:
    """``_mapped_bytes`` through Python's ``mmap``, for a path torch cannot open: it keeps a descriptor open."""
    import mmap

    with open(path, "rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write, like torch's private map
    return torch.frombuffer(buffer, dtype=torch.uint8, count=end - start, offset=start)


def _read_only_memmap(raw: torch.Tensor, numpy_dtype: str, shape: list, path: str, offset: int):
    """The bytes ``raw`` as a read-only ``np.memmap`` of ``shape``, naming its file and offset as numpy's own do."""
    import numpy as np

    array = raw.numpy().view(numpy_dtype).reshape(shape).view(np.memmap)
    array.flags.writeable = False
    array._mmap, array.filename, array.offset, array.mode = raw, os.path.abspath(path), offset, "r"
    return array


def layouts_of(tensors: dict) -> dict:
    """``key -> strides`` of the tensors laid out other than row-major (channels_last, a transpose): a file
    holds values in row order, and ``laid_out`` lays each out again as the trace held it."""
    layouts = {key: permuted_strides(t) for key, t in tensors.items()}
    return {key: strides for key, strides in layouts.items() if strides is not None}


def laid_out(tensors: dict, layouts, where: str) -> dict:
    """``tensors`` read from a file, each laid out as ``layouts`` (what ``layouts_of`` wrote, at ``where`` in
    trace.json; None in files written before it) says; a layout that is not a gapless one of its tensor is
    refused, since it could reach memory the tensor does not own."""
    if layouts is None:
        return tensors
    if not isinstance(layouts, dict):
        raise TraceFileError(f"{TRACE_JSON}: {where} must map tensor names to strides")
    out = dict(tensors)
    for key, strides in layouts.items():
        t = tensors.get(key)
        if t is None or not isinstance(strides, list) or len(strides) != t.dim() or \
                not all(type(s) is int and s >= 0 for s in strides) or \
                permuted_strides(torch.empty_strided(t.shape, strides, device="meta")) != strides:
            raise TraceFileError(f"{TRACE_JSON}: {where}: {strides!r} for tensor {key!r} is not a gapless layout "
                                 "of a saved tensor")
        # On the tensor's device (the CPU), not the one a `with torch.device(...)` block around tl.load names.
        out[key] = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)
    return out

