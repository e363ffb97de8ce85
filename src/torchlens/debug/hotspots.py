"""``hot_path``: rank where a captured forward spent its time, FLOPs or activation memory.

It reads an existing trace (no extra forward) and groups its torch calls by op, layer, module call or
the user's source line.  Durations are the instrumented host times capture recorded around each torch
call: good for finding the hot spot, not for quoting it (``torch.utils.benchmark.Timer`` owns that).
Ops with no value for the metric (an op with no FLOPs formula) are counted and named as excluded, never
ranked as if they cost nothing.  Inputs, buffers and outputs are not torch calls and are not ranked.
"""

from __future__ import annotations

import math

from ..checks import as_position
from ..errors import counted, listed, refusing_unknown_keywords
from ..record.columns import is_first_output
from ..record.grads import norm_of_norms
from ..record.module_table import produced_bytes
from ..record.modules import enclosing_calls
from ..record.summary import aligned_lines
from ..record.trace import checked_trace

METRICS = {
    "duration": "s",
    "flops": "FLOPs",
    "memory": "bytes",
    "grad_norm": "2-norm",
    "saved_for_backward": "bytes",
}
GROUPS = ("op", "layer", "module", "source")
DURATION_NOTE = ("duration = instrumented host time around each torch call (no device sync, capture "
                 "bookkeeping nearby): use it to rank, not to quote; quote with torch.utils.benchmark.Timer")
_METRIC_NOTES = {
    "duration": DURATION_NOTE,
    "flops": "flops = analytic forward FLOPs (a multiply-add counts 2); see torchlens.report.flops",
    "memory": ("memory = bytes of the tensor each op produced (its output's size, saved or not; an in-place op "
               "adds 0, having written into a tensor another op produced), as log.summary()'s Act. mem counts them"),
    "grad_norm": ("grad_norm = 2-norm of d loss / d (op output), accumulated over the backwards seen (grads=True); "
                  "a group's value is the 2-norm over its ops (square root of the sum of squares); percent is "
                  "its share of the total's square, the sum of squares, which rows without common ops add up in"),
    "saved_for_backward": ("saved_for_backward = bytes of the distinct storages autograd packed for backward "
                           "while running each call (saved_for_backward=True); a storage several ops keep "
                           "counts for each of them"),
}
_SHOWN = 20
ZERO_TOTAL_NOTE = "percent: n/a, a share of a total of 0 is undefined (NaN in .rows and .to_pandas())"


class HotPath:
    """Ranked rows plus what they mean: ``rows``, ``by``, ``group``, ``unit``, ``total``, ``excluded``."""

    def __init__(self, rows, *, by, group, total, excluded, considered, model_name):
        self.rows = rows
        self.by = by
        self.group = group
        self.unit = METRICS[by]
        self.total = total
        self.excluded = tuple(excluded)
        self.considered = considered
        self.calls = considered  # distinct torch calls ranked (hot_path sets it: a call may return several ops)
        self.trace_calls = considered  # every torch call of the trace, as print(log) counts them (set by hot_path)
        self.model_name = model_name
        self.note = _METRIC_NOTES[by]

    def to_pandas(self):
        """One row per group, hottest first; the metadata is in ``DataFrame.attrs``."""
        from ..record.tables import require_pandas

        frame = require_pandas().DataFrame(self.rows, columns=["address", "count", "total", "percent"])
        frame.attrs.update({"by": self.by, "group": self.group, "unit": self.unit, "total": self.total,
                            "excluded": list(self.excluded), "note": self.note})
        return frame

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, i):
        i = as_position(i)  # a NumPy integer is a position
        if type(i) is not int and not isinstance(i, slice):  # a bool too: never meant as row 0 or row 1
            found = f"; find a row by its address with next(r for r in hot.rows if r['address'] == {i!r})" \
                if isinstance(i, str) else ""
            raise TypeError(f"a hot path's rows are a list, hottest first, indexed by position (an int or a slice), "
                            f"not {type(i).__name__}{found}")
        if isinstance(i, int) and not -len(self.rows) <= i < len(self.rows):
            raise IndexError(f"hot path row {i} is out of range: it has {len(self.rows)} rows")
        return self.rows[i]

    def __str__(self) -> str:
        table = [["address", "count", "total", "percent"]] + [
            [row["address"], str(row["count"]), _fmt(row["total"], self.by), percent_text(row["percent"], self.total)]
            for row in self.rows[:_SHOWN]]
        lines = [f"hot path of {self.model_name} by {self.by} ({self.unit}), grouped by {self.group}: "
                 f"{self._calls_text()}, total {_fmt(self.total, self.by)} {self.unit}"]
        lines += ["  " + line for line in aligned_lines(table, right=(1, 2, 3))]
        if len(self.rows) > _SHOWN:
            lines.append(f"  ... {len(self.rows) - _SHOWN} more rows (see .rows or .to_pandas())")
        if self.excluded:
            shown = listed(self.excluded, 5)
            lines.append(f"  excluded, no {self.by} value: {counted(len(self.excluded), 'op')} ({shown})")
        if self.rows and self.total == 0:
            lines.append(f"  {ZERO_TOTAL_NOTE}")
        lines.append(f"  note: {self.note}")
        return "\n".join(lines)

    __repr__ = __str__

    def _calls_text(self) -> str:
        # Counted as print(log) counts them; the others are listed under "excluded" below.
        total = self.trace_calls
        return f"{self.calls} torch calls" if total == self.calls else f"{self.calls} of {total} torch calls"


def percent_text(percent, total) -> str:
    """A row's percent as a printed table shows it: "n/a" where the total is 0, of which no row has a share."""
    return "n/a" if total == 0 else f"{percent:.1f}%"


def _fmt(value, by) -> str:
    if by == "grad_norm":
        return f"{value:.4g}"
    return f"{value:.6f}" if by == "duration" else f"{int(value):,}"


@refusing_unknown_keywords("tl.debug.hot_path")
def hot_path(log, by: str = "duration", group: str = "op") -> HotPath:
    """Rank ``log``'s torch calls by ``by`` ("duration", "flops", "memory", "grad_norm" (a trace taken with
    ``grads=True``, after a backward), "saved_for_backward" (``saved_for_backward=True``)), grouped by ``group``
    ("op": pass-qualified ops, "layer", "module": module calls, inclusive of nested calls, "source": the
    user's file:line, or the module for ops no user line called)."""
    checked_trace(log, "hot_path")
    # A string first: ``["duration"] in METRICS`` (a dict) fails on hashing, before saying what to give.
    if not isinstance(by, str) or by not in METRICS:
        raise ValueError(f"by={by!r} is not a metric hot_path knows; use one of: {', '.join(METRICS)}")
    if group not in GROUPS:
        raise ValueError(f"group={group!r} is not a grouping hot_path knows; use one of: {', '.join(GROUPS)}")
    values, excluded = _metric_values(log, by)
    members: dict = {}
    parent_of = log.module_call_parents.__getitem__
    for index, value in values:
        for key in _keys(log, index, group, parent_of):
            members.setdefault(key, []).append(value)
    combine = norm_of_norms if by == "grad_norm" else sum  # norms combine as the norm of the concatenation
    grand = combine([v for _, v in values])
    rows = []
    for key, parts in members.items():
        total = combine(parts)
        rows.append({"address": key, "count": len(parts), "total": total, "percent": _percent(total, grand, by)})
    rows.sort(key=_hottest_first, reverse=True)
    ranked = HotPath(rows, by=by, group=group, total=grand, excluded=excluded, considered=len(values),
                     model_name=log.model_name)
    from ..record.summary import torch_call_count

    ranked.calls = len({log.call_indices[i] for i, _ in values})  # counted as print(log) counts them
    ranked.trace_calls = torch_call_count(log)
    return ranked


def _percent(total, grand, by) -> float:
    """A row's share of the grand total; for gradient norms, the share of its square in the sum of squares.  A
    total of 0 (the FLOPs of an empty batch, gradients all zero) has no shares: NaN, where 0.0 read as "costs
    nothing beside the others"."""
    if grand == 0:
        return math.nan
    share = total / grand
    return 100.0 * (share * share if by == "grad_norm" else share)


def _hottest_first(row) -> tuple:
    """Sort key, largest first.  A NaN total (a gradient holding NaN) cannot be compared, and left in
    the sort it leaves the other rows out of order: it ranks first, where a NaN needs looking at."""
    total = row["total"]
    is_nan = total != total
    return (is_nan, 0 if is_nan else total)


def _metric_values(log, by):
    """``[(op index, value)]`` for torch-call ops with a value, and the labels of those without."""
    values, excluded = [], []
    if by == "flops":
        from ..report.flops import flops_column

        column = flops_column(log)
    elif by == "grad_norm":
        column = _grad_norms(log)
    elif by == "saved_for_backward":
        from ..record.grads import op_saved_for_backward_bytes
    for op in log.ops:
        if op.kind != "op":
            continue
        i = op.index
        first_output = is_first_output(log, i)
        if by == "duration":
            if not first_output:
                continue  # one call, one duration: it is on the call's first output
            value = op.duration
        elif by == "flops":
            parts = column[i]
            value = None if parts is None else sum(parts.values())
        elif by == "grad_norm":
            value = column.get(i)
        elif by == "saved_for_backward":
            if not first_output:
                continue  # packing is per call: on the call's first output
            value = op_saved_for_backward_bytes(log, i)
        else:
            value = produced_bytes(log, i)
        if value is None:
            excluded.append(op.label)
        else:
            values.append((i, value))
    return values, excluded


def _grad_norms(log) -> dict:
    """``{op index: gradient norm}``; ops with no gradient (yet) are excluded, by name."""
    from ..errors import GradientUnavailable
    from ..record.grads import FROM_BATCHED_BACKWARD, grad_capture_of, grad_stats_column, unreadable

    capture = grad_capture_of(log)  # a trace taken without grads=True says how to get them
    stats = grad_stats_column(log)
    if not stats and not log.is_cleaned_up and any(map(unreadable, capture.grads.values())):
        raise GradientUnavailable("hot_path(by='grad_norm') can read none of the trace's gradients: for each, "
                                  + FROM_BATCHED_BACKWARD)
    if not stats:
        raise ValueError("hot_path(by='grad_norm') needs gradients: run a backward through log.output first "
                         "(or log.backward(loss))")
    return {i: s["grad_norm"] for i, s in stats.items()}


def _keys(log, index, group, parent_of) -> list:
    from ..record.summary import short_path

    if group == "op":
        return [log.labels[index]]
    if group == "layer":
        return [log.op_layer_labels[index]]
    m = log.module_call_indices[index]
    calls = log.module_calls
    if group == "module":
        return [calls[k].label for k in enclosing_calls(m, parent_of)]
    source = log.ops[index].source
    if source is not None:
        return [f"{short_path(source.file)}:{source.line}"]
    if m >= 0:  # no user frame called it (a bare nn.Sequential): the module it ran in stands for the site
        module = calls[m].module
        return [f"{module.address} ({module.class_name})"]
    return ["(no user source)"]
