"""Writes that torch makes inside a kernel, predicted from the call: normalisation running statistics.

``F.batch_norm`` in training mode and ``F.instance_norm`` with input statistics update their running
mean and variance inside the kernel, without an in-place name that would announce it.  Buffers read
by such a call are saved by reference like any other activation, so copy-on-write must know of these
writes before the call runs, as it knows of ``add_``.  Any other write found only after a call (its
version counter moved) still drops what was saved of the written tensor, with the reason
(``CaptureState.note_writes``): nothing saved is ever silently changed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# func -> (flag name, flag position, ((name, position) of each running statistic)): the statistics
# are written when the flag is true.
_NORMS = {
    F.batch_norm: ("training", 5, (("running_mean", 1), ("running_var", 2))),
    F.instance_norm: ("use_input_stats", 5, (("running_mean", 1), ("running_var", 2))),
    torch.batch_norm: ("training", 5, (("running_mean", 3), ("running_var", 4))),
    torch.instance_norm: ("use_input_stats", 5, (("running_mean", 3), ("running_var", 4))),
}
WRITES_RUNNING_STATS = frozenset(_NORMS)
# func -> (flag name, flag position): the compiled hot path skips the check when the flag is off.
RUNNING_STATS_FLAGS = {func: (name, position) for func, (name, position, _) in _NORMS.items()}


def _argument(args, kwargs, name: str, position: int):
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else None


def running_stats_written(func, args, kwargs) -> list:
    """The running-statistic tensors the call is about to update in its kernel (none in eval mode)."""
    flag_name, flag_position, stats = _NORMS[func]
    if not _argument(args, kwargs, flag_name, flag_position):
        return []
    found = (_argument(args, kwargs, name, position) for name, position in stats)
    return [t for t in found if isinstance(t, torch.Tensor)]
