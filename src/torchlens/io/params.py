"""The model's parameters in a saved trace: address, shape, dtype and ``requires_grad`` of each.

A loaded trace holds no model, so without this table it would have no ``log.params``; with it, every
``Param`` record comes back with the ops that used it (from the saved ``param_addresses``), and
``Param.grad`` returns the gradient saved with the trace (io/grads.py) or says why there is none.
Traces saved before the table existed load with no ``Param`` records, and ``log.params`` says so.

The summary's per-module parameter counts are saved beside the table, as the live trace counted them
from its modules: a module's count includes a weight it shares with another (a tied embedding and head),
which the table lists once, at its first address, so the counts cannot be rebuilt from the table.
"""

from __future__ import annotations

from .encode import torch_constant, torch_constant_name
from .format import TRACE_JSON, TraceFileError


def write_params(trace) -> list | None:
    """``[[address, shape, dtype name, requires_grad], ...]`` for ``trace.json`` (shape null: uninitialized); None
    for a trace loaded from a file that predates the table, which has no ``Param`` records because none were kept:
    written as an empty table, the copy would say the model had no parameters."""
    if not trace._params_listed:
        return None
    return [[p.address, None if p.shape is None else [int(d) for d in p.shape], torch_constant_name(p.dtype),
             bool(p.requires_grad)] for p in trace.params]


def read_params(trace, rows) -> None:
    """Give a loaded trace its ``Param`` records (none when the file predates the table)."""
    trace._params_listed = rows is not None
    if rows is None:
        return
    from ..record.params import ParamState, build_params

    if not isinstance(rows, list):
        raise TraceFileError(f"{TRACE_JSON}: 'params' must be a list")
    saved = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str) and _is_shape(row[1])
                and isinstance(row[3], bool)):
            raise TraceFileError(f"{TRACE_JSON}: params: {row!r} is not [address, shape, dtype, requires_grad]")
        address, shape, dtype, requires_grad = row
        saved.append((address, ParamState(shape, torch_constant("dtype", dtype), requires_grad)))
    trace._param_rows = build_params(trace, saved)


def _is_shape(shape) -> bool:
    """A saved parameter shape: a list of sizes, or None for an uninitialized (lazy) parameter."""
    return shape is None or isinstance(shape, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)


def write_module_param_counts(trace) -> list:
    """``[[module address, parameter count], ...]``: what the live summary shows for each module; None when
    the counts were themselves rebuilt from the ops (an older file loaded and saved again), so that the
    copy keeps saying so."""
    from ..record.module_table import module_param_counts

    counts = module_param_counts(trace)
    if trace._param_counts_from_ops:
        return None
    return [[address, int(count)] for address, count in counts.items()]


def read_module_param_counts(trace, rows) -> None:
    """Give a loaded trace its saved per-module counts (absent from older files: the summary then counts
    the parameters the ops used, and says so)."""
    if rows is None:
        return
    if not isinstance(rows, list) or not all(
            isinstance(row, list) and len(row) == 2 and isinstance(row[0], str)
            and isinstance(row[1], int) and not isinstance(row[1], bool) and row[1] >= 0 for row in rows):
        raise TraceFileError(f"{TRACE_JSON}: 'module_param_counts' must be a list of [module address, count]")
    trace._module_param_counts = dict(rows)
