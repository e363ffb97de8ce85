"""Whether a tensor's values hold NaN or Inf.

One check serves every reader that asks: ``record_finite`` during capture, ``nonfinite_origin`` over saved
activations, parameters and gradients, and the viewer's non-finite marks.  Having one keeps their answers
the same for the same tensor: dtypes that cannot hold NaN (integers, bool) are finite, a meta tensor has
no values to examine, and a nested tensor is read through its components.
"""

from __future__ import annotations

import math

import torch

from ..tree import made_in_transform, without_values
from .layouts import dense_values

# Dtypes whose sum says in one pass that every value is finite (below).  torch's isfinite is several
# elementwise kernels and a temporary each; one reduction costs a fraction of that.
_SUMMED = frozenset([torch.float32, torch.float64, torch.float16, torch.bfloat16])
_FINITE = (False, False)


def nonfinite_flags(t: torch.Tensor, sync: bool = True):
    """``(has_nan, has_inf)`` for ``t``'s values, or None for a meta or fake tensor and for a torch.func transform's
    wrapper (inside ``vmap`` its values cannot decide a Python ``bool``): not examined.

    With ``sync=False`` the flags of a tensor on an accelerator come back as one 2-element bool tensor left
    on its device, so that checking every op of a forward queues work instead of waiting on each op;
    the caller reads them all at once after the forward."""
    if _finite_sum(t):
        return _FINITE
    if not (t.is_floating_point() or t.is_complex()):
        return (False, False)
    if without_values(t) or made_in_transform(t):
        return None
    with torch.no_grad():
        t = dense_values(t)
        if not sync and t.device.type != "cpu":
            return torch.stack((torch.isnan(t).any(), torch.isinf(t).any()))
        if bool(torch.isfinite(t).all()):  # one pass in the common, finite case
            return (False, False)
        return bool(torch.isnan(t).any()), bool(torch.isinf(t).any())


def _finite_sum(t) -> bool:
    """True when the sum of a dense CPU tensor of real floats is finite, which proves every value finite:
    a NaN makes the sum NaN, an Inf makes it Inf or NaN.  False says nothing (a sum may overflow, or the
    tensor is of another kind): the exact check decides then."""
    if type(t) is not torch.Tensor or t.dtype not in _SUMMED or t.layout is not torch.strided or t.is_nested \
            or not t.is_cpu or made_in_transform(t):
        return False
    if t.requires_grad:
        with torch.no_grad():
            return math.isfinite(t.sum().item())
    return math.isfinite(t.sum().item())


def drained_flags(flags: dict) -> dict:
    """Capture's finite flags (``CaptureState.finite_flags``) as ``{record: (has_nan, has_inf)}``: the flags an
    accelerator kept on the device, read with one copy per device."""
    flags = dict(flags)
    pending: dict = {}
    for i, v in flags.items():
        if isinstance(v, torch.Tensor):
            pending.setdefault(v.device, []).append(i)
    for indices in pending.values():
        values = torch.stack([flags[i] for i in indices]).tolist()
        for i, (nan, inf) in zip(indices, values):
            flags[i] = (bool(nan), bool(inf))
    return flags
