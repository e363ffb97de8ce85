"""The collectives a trace recorded, by op: which collective, on which process group, over which ranks.

Capture records two kinds (see docs/distributed.md for what it cannot see):

- ``torch.distributed`` calls (``dist.all_reduce``, ``dist.all_gather_into_tensor`` ...), which dispatch
  through ``__torch_function__``; each is an op whose output is the tensor it wrote;
- functional collectives (``torch.ops._c10d_functional.*``, what ``funcol.all_reduce`` and DTensor
  issue), which return their result.

The process group is read from each call's recorded arguments after the forward, never on the hot path.
"""

from __future__ import annotations

import inspect

from ..capture.collectives import NAMES as _DISTRIBUTED_NAMES
from ..record.columns import is_first_output
from ..record.tables import require_pandas
from ..record.trace import checked_trace

_FUNCTIONAL = "_c10d_functional::"
# what a loaded trace's function names can say: the torch.distributed ones and the functional ops
_COLLECTIVE_NAMES = _DISTRIBUTED_NAMES | {
    "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "all_reduce_coalesced"}


def collectives(trace):
    """A pandas table, one row per collective call (its first output op): label, collective, group,
    group_ranks, async, module, shape."""
    checked_trace(trace, "collectives")
    rows = [row for row in (_describe(op) for op in trace.ops if _first_output(op)) if row is not None]
    columns = ["label", "collective", "group", "group_ranks", "async", "module", "shape"]
    return require_pandas("a torchlens.distributed table").DataFrame(rows, columns=columns)


def is_collective_op(op) -> bool:
    """Whether ``op`` is an output of a collective call, recorded live or read back with ``tl.load``."""
    return _describe(op) is not None


def _first_output(op) -> bool:
    """Whether ``op`` is the first output of its call: one row per call, whatever the outputs' slots (those of
    ``all_gather_coalesced``, a list of lists, are ``(0, 0)``, ``(0, 1)`` ...)."""
    return is_first_output(op._trace, op.index)


def _describe(op):
    from ..capture.collectives import WRITTEN_ARGUMENT, issued_async

    func = op.func
    if func is None:  # a loaded trace keeps the functions' names only: the group was not saved
        if op.kind != "op" or op.func_name not in _COLLECTIVE_NAMES or not _saved_as_collective(op):
            return None
        return {"label": op.label, "collective": op.func_name, "group": None, "group_ranks": None, "async": None,
                "module": op.module, "shape": op.shape}
    if func in WRITTEN_ARGUMENT:
        bound = _bind(func, op.args or (), op.kwargs or {})
        group = bound.get("group")
        return {"label": op.label, "collective": func.__name__, "group": _group_name(group),
                "group_ranks": _group_ranks(group), "async": issued_async(func, op.args or (), op.kwargs or {}),
                "module": op.module, "shape": op.shape}
    qualified = getattr(func, "_qualified_op_name", None) or getattr(getattr(func, "_schema", None), "name", "")
    if qualified.startswith(_FUNCTIONAL):
        names = [a for a in (op.args or ()) if isinstance(a, str)]
        if not names:  # wait_tensor and wrappers: not collectives themselves
            return None
        return {"label": op.label, "collective": qualified[len(_FUNCTIONAL):], "group": names[-1],
                "group_ranks": _group_ranks(names[-1]), "async": True, "module": op.module, "shape": op.shape}
    return None


def _saved_as_collective(op) -> bool:
    """Whether a loaded op's function was saved as a ``torch.distributed`` or functional collective, not a
    namesake (``torch.gather``, ``Tensor.scatter``).  Traces saved without the paths are taken by name."""
    paths = op._trace.saved_func_paths
    call = op._trace.call_indices[op.index]
    if paths is None or not 0 <= call < len(paths):
        return True
    return paths[call].startswith(("torch.distributed.", "torch._ops._c10d_functional."))


def _bind(func, args, kwargs) -> dict:
    try:
        return inspect.signature(func).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return dict(kwargs)


def _group_name(group) -> str:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        group = dist.group.WORLD
    return str(getattr(group, "group_name", group))


def _group_ranks(group):
    import torch.distributed as dist

    try:
        if isinstance(group, str):
            group = dist.distributed_c10d._resolve_process_group(group)
        return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except (RuntimeError, ValueError, AttributeError, KeyError):  # a group already destroyed
        return None
