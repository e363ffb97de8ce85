"""``torch.distributed`` collectives as ops: which argument each one writes.

The collectives of ``torch.distributed`` (``all_reduce``, ``broadcast``, ``all_gather`` ...) dispatch
through ``__torch_function__`` when a mode is active, so capture sees them, but they return ``None`` (or
a ``Work`` handle) and write their result into an argument.  Recorded like ``x[i] = v`` is, as an op whose
output is the written tensor, later readers get the collective as their parent instead of the op that
produced the buffer before it was overwritten, and a saved activation of that buffer is copied before
the write (the collective counts as in-place).  Functional collectives (``torch.ops._c10d_functional``)
return tensors and need nothing here.

The table is empty where torch was built without distributed support.
"""

from __future__ import annotations

import functools
import sys

from ..record.columns import (CALL_ARGS, CALL_FIRST_RECORD, CALL_FUNC, CALL_KWARGS, CALL_NUM_OUTPUTS,
                              COLLECTIVE_WRITES)


def _written_arguments() -> dict:
    import torch

    if not torch.distributed.is_available():
        return {}
    import torch.distributed.distributed_c10d as c10d  # already imported by torch itself: no cost

    found = {}
    for name, where in COLLECTIVE_WRITES.items():
        func = getattr(c10d, name, None)
        if func is not None:
            found[func] = where
    return found


NAMES = frozenset(COLLECTIVE_WRITES)  # the torch.distributed collectives capture records

# func -> (position, keyword) of the argument it writes; looked up by the capture mode only for calls
# that returned no tensor.
WRITTEN_ARGUMENT = _written_arguments()

# Collectives async whatever their arguments: irecv takes no async_op= and returns a Work handle, its result
# arriving at the wait.
_ALWAYS_ASYNC = frozenset(["irecv"])


def written_tensors(func, args, kwargs) -> tuple:
    """``(slot, tensor)`` for each tensor ``func`` wrote, in the form capture records outputs."""
    import torch

    position, keyword = WRITTEN_ARGUMENT[func]
    target = args[position] if len(args) > position else kwargs.get(keyword)
    if isinstance(target, torch.Tensor):
        return ((None, target),)
    leaves = []
    if isinstance(target, (list, tuple)):
        for i, item in enumerate(target):
            if isinstance(item, torch.Tensor):
                leaves.append((i, item))
            elif isinstance(item, (list, tuple)):
                leaves.extend(((i, j), t) for j, t in enumerate(item) if isinstance(t, torch.Tensor))
    return tuple(leaves)


def drop_flags_before_arrival(state) -> None:
    """Forget the finite flags ``record_finite=True`` took of what a collective issued asynchronously produced
    (``async_op=True``, ``irecv``, or a functional collective, whose result a later wait completes): they were
    read at the call, before the result arrived, so those ops are left unexamined rather than called finite."""
    flags = state.finite_flags
    for call in state.calls:
        func = call[CALL_FUNC]
        if func in WRITTEN_ARGUMENT and issued_async(func, call[CALL_ARGS], call[CALL_KWARGS]) or \
                func not in WRITTEN_ARGUMENT and is_collective(func):
            for index in range(call[CALL_FIRST_RECORD], call[CALL_FIRST_RECORD] + call[CALL_NUM_OUTPUTS]):
                flags.pop(index, None)


def issued_async(func, args, kwargs) -> bool:
    """Whether a ``torch.distributed`` collective's result arrives after the call: ``irecv`` always, the others
    when called with ``async_op=True`` (read from the recorded arguments)."""
    import inspect

    if func.__name__ in _ALWAYS_ASYNC:
        return True
    try:
        bound = inspect.signature(func).bind_partial(*args, **(kwargs or {})).arguments
    except (TypeError, ValueError):  # a signature that cannot be read: the keyword alone
        bound = kwargs or {}
    return bool(bound.get("async_op", False))


def is_collective(func) -> bool:
    """A ``torch.distributed`` collective or a functional one: replaying it on one rank alone would block on,
    or pair with, the other ranks' calls."""
    if func in WRITTEN_ARGUMENT:
        return True
    name = getattr(func, "_qualified_op_name", None) or getattr(getattr(func, "_schema", None), "name", "")
    return isinstance(name, str) and name.startswith("_c10d_functional::") and "wait_tensor" not in name


def process_rank() -> tuple:
    """``(rank, world size)`` of the default process group, or ``(None, None)`` outside one."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not _built_with_distributed(dist) or not dist.is_initialized():
        return None, None
    return dist.get_rank(), dist.get_world_size()


@functools.lru_cache(maxsize=1)
def _built_with_distributed(dist) -> bool:
    """``torch.distributed.is_available()``: how torch was built, asked once per process."""
    return dist.is_available()
