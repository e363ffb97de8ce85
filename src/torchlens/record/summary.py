"""The text ``print(trace)`` shows: counts, structure, memory, timing, and a bounded op roster."""

from __future__ import annotations

from ..errors import counted, first_few
from ..tree import without_values
from .columns import Kind, per_example_ops
from .layouts import shape_text

_HEAD, _TAIL = 30, 5


COUNT_UNITS = (("", 1.0), ("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12))
BYTE_UNITS = (("B", 1.0), ("KiB", 1024.0), ("MiB", 1024.0 ** 2), ("GiB", 1024.0 ** 3))


def unit_for(n: float, units, shown) -> tuple[str, float]:
    """The ``(suffix, scale)`` to print ``n`` in: the largest unit it reaches, or the next one up where the
    figure as printed would be a whole next unit.  ``shown(value, suffix)`` rounds a value as the caller prints
    it: the unit is chosen before rounding, so without this 999,999 reads 1000.00 k and 1,048,575 B 1024.0 KiB.
    """
    k = max((i for i, (_, scale) in enumerate(units) if abs(n) >= scale), default=0)
    if k + 1 < len(units):
        suffix, scale = units[k]
        if abs(shown(n / scale, suffix)) >= units[k + 1][1] / scale:
            k += 1
    return units[k]


def _bytes_shown(value: float, suffix: str) -> float:
    return round(value, 0 if suffix == "B" else 1)


def human_bytes(n: float) -> str:
    unit, scale = unit_for(n, BYTE_UNITS, _bytes_shown)
    return f"{n:.0f} B" if unit == "B" else f"{n / scale:.1f} {unit}"


def aligned_lines(table: list, right=()) -> list:
    """The rows of ``table`` (lists of strings) as lines, each column as wide as its longest cell and two spaces
    apart: left-aligned, or right-aligned for the column positions in ``right`` (numbers)."""
    widths = [max(len(row[k]) for row in table) for k in range(len(table[0]))]
    return ["  ".join(c.rjust(w) if k in right else c.ljust(w) for k, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in table]


def _shape(op) -> str:
    return shape_text(op.shape)


def _what(op) -> str:
    """The function for ops; where the tensor sat for inputs, outputs and buffers."""
    return op.func_name if op.kind == "op" else (op.io_path or op.kind)


def torch_call_count(trace) -> int:
    """Distinct torch calls (a call returning several tensors is one call with several ops)."""
    return len({c for c, k in zip(trace._call, trace._kind) if k == 0 and c >= 0})


def _tensors_and_calls(trace, n_compute: int) -> str:
    calls = torch_call_count(trace)
    if calls == n_compute:
        return counted(calls, "torch call")
    return f"{counted(n_compute, 'tensor')} from {counted(calls, 'torch call')}"


def _buffers(trace) -> str:
    """The buffers read as ops (a rotary embedding's ``inv_freq``), when there are any: the parts of the op count
    add up to it."""
    count = sum(1 for kind in trace._kind if kind == Kind.BUFFER)
    return f"{counted(count, 'buffer')}, " if count else ""


def _recurrence(trace) -> str:
    from ..labels.passes import repetition

    if not trace.is_recurrent:
        return "feed-forward (every layer ran once)"
    kind = repetition(trace)
    if kind == "reused":
        what, how = _reused(trace)
        return f"reused {what} ({how} from several places: up to {trace.num_passes_max} passes of one layer; no loop)"
    if kind == "loop":
        return f"recurrent (up to {trace.num_passes_max} passes of one layer)"
    return f"repeated layers (up to {trace.num_passes_max} passes of one layer)"


def _reused(trace) -> tuple:
    """What a trace that repeated with no loop reused, and how: a module called from several places (the
    passes of its ops lie in different calls of it; the root module's forward calling itself included), a
    parameter read on several lines (``F.linear(x, self.w)`` twice: the passes lie in one call, or in calls of
    different modules), or both."""
    groups, sizes, calls, rows = trace.groups, trace.group_sizes, trace.module_call_indices, trace._call_rows
    # The root forward (-1) is the root module's first call, when the root module calls itself (``self:2``).
    root = next((i for i, row in enumerate(trace._module_rows) if row.address == "self"), -1)
    first_call: dict = {}  # layer group -> the module call its first pass ran in (-1: the root forward)
    modules = parameters = False
    for i, group in enumerate(groups):
        if sizes[group] < 2:
            continue
        if group not in first_call:
            first_call[group] = calls[i]
            continue
        call, first = calls[i], first_call[group]
        module, first_module = (rows[c].module if c >= 0 else root for c in (call, first))
        if call != first and module >= 0 and module == first_module:
            modules = True
        else:
            parameters = True
    if modules and parameters:
        return "modules and parameters", "a module called, or a parameter used,"
    return ("modules", "a module called") if modules else ("parameters", "a parameter used")


def short_path(file: str) -> str:
    """A source path as a reader wants it: relative to the working directory (unless it lies in an
    installed package there, e.g. a virtualenv inside the project), else to the import root it was found
    under (``transformers/models/gpt2/modeling_gpt2.py``), else as recorded."""
    import os
    import sys

    if not file or not os.path.isabs(file):
        return file
    cwd = os.getcwd()
    if file.startswith(cwd + os.sep):
        relative = os.path.relpath(file, cwd)
        if not {"site-packages", "dist-packages"} & set(relative.split(os.sep)):
            return relative
    roots = sorted((p.rstrip(os.sep) for p in sys.path if p and os.path.isabs(p)), key=len, reverse=True)
    for root in roots:
        if file.startswith(root + os.sep):
            return os.path.relpath(file, root)
    return file


# Where a tensor of unknown origin (no op of the trace made it) comes from, for the reader to check.
UNSEEN_PLACES = ("made where the trace cannot see: before the forward, on another thread, by a call that never "
                 "reaches __torch_function__ (torch.from_numpy, a legacy constructor such as torch.IntTensor([n])), "
                 "or inside a TorchScript or torch.compile'd function the forward called (docs/capture_honesty.md)")


def _unattributed_where(trace) -> str:
    """Where the tensors of unknown origin were read, and which module calls returned them (a TorchScript
    module, a C++ extension, work done on another thread)."""
    readers = [op.label for op in trace.ops if op.kind == "op" and op.unattributed_args]
    calls = [f"{c.label} ({c.module.class_name})" for c in trace.module_calls if -1 in c._row.outputs]
    where = f": read by {first_few(readers)}" if readers else ""
    where += f"; returned by {first_few(calls)}" if calls else ""
    held = [name for name in trace._outside_attributes if not name.endswith("]")]
    cached = [name for name in trace._outside_attributes if name.endswith("]")]
    if held:  # a plain tensor attribute is no buffer: named, with how to have it recorded as one
        one = len(held) == 1
        where += (f"; {first_few(held)} {'is a plain tensor attribute' if one else 'are plain tensor attributes'} of "
                  f"the model, not {'a registered buffer' if one else 'registered buffers'} (register_buffer(name, "
                  f"tensor, persistent=False) would record {'it' if one else 'each'} as a buffer, leaving the "
                  "state dict as it is)")
    if cached:  # made before this forward: when the model was built, or by an earlier forward filling a cache
        one = len(cached) == 1
        held_in = "is held in a container attribute" if one else "are held in container attributes"
        where += (f"; {first_few(cached)} {held_in} of the model (a dict, list or tuple, where no buffer is "
                  "registered): made before this forward, when the model was built or by an earlier forward filling "
                  f"a cache, so the ops that made {'it' if one else 'them'} are not in this trace (empty such a cache "
                  "before tracing to record them)")
    if not held and not cached and not calls:
        # nothing names where they came from: the places a trace cannot see, for the reader to check
        where += "; " + UNSEEN_PLACES
    return where


def _dropped_lines(trace) -> list:
    """How many saved activations were dropped, and why: one line per reason (``dropped_activations``
    holds each op's), with how many ops it covers and the first few of them."""
    dropped = trace._dropped
    if not dropped:
        return []
    by_reason: dict = {}
    for index in sorted(dropped):
        by_reason.setdefault(dropped[index], []).append(trace._labels[index])
    one = len(dropped) == 1
    lines = [f"  {len(dropped)} saved activation{'' if one else 's'} {'was' if one else 'were'} dropped:"]
    lines += [f"    {len(labels)} ({first_few(labels)}): {reason}" for reason, labels in by_reason.items()]
    return lines


def _without_values(trace) -> str:
    """Said of saved activations that are meta or fake tensors (a shape-only trace): they hold no values."""
    count = sum(map(without_values, trace._activations.values()))
    return f"; {count} of them meta or fake tensors: shapes and dtypes, no values" if count else ""


def repr_text(trace) -> str:
    """The one-line form of a trace; an intervened run says so, so that it is not read as the clean run."""
    stopped = f", stopped after {trace.stopped_after}" if trace.stopped_after is not None else ""
    edited = f", {counted(len(trace.interventions), 'op')} changed by interventions" if trace.interventions else ""
    return (f"<Trace of {trace.model_name}: {counted(len(trace), 'op')}, {counted(len(trace.layers), 'layer')}, "
            f"{counted(len(trace.module_calls), 'module call')}{stopped}{edited}>")


def summary_text(trace) -> str:
    trace.drop_written()  # a saved tensor written since the trace is counted as dropped, not as saved
    ops = trace.ops
    n_compute = sum(1 for op in ops if op.kind == "op")
    recurrence = _recurrence(trace)
    saved = "released by cleanup()" if trace.is_cleaned_up else \
        f"{counted(len(trace._activations), 'activation')} saved, {human_bytes(trace.saved_bytes)} as tensor sizes " \
        "summed (a view counts in full; log.saved_bytes)" + _without_values(trace)
    lines = [
        f"Trace of {trace.model_name}",
        f"  {counted(len(ops), 'op')} ({_tensors_and_calls(trace, n_compute)}, {counted(len(trace.inputs), 'input')}, "
        f"{_buffers(trace)}{counted(len(trace.outputs), 'output')}), {counted(len(trace.layers), 'layer')}",
        f"  {counted(len(trace.modules), 'module')}, {counted(len(trace.module_calls), 'module call')}; {recurrence}",
        f"  {saved}",
        f"  captured in {trace.capture_duration * 1e3:.1f} ms (host times below are instrumented)",
    ]
    if trace.unattributed:
        lines.append(f"  {counted(trace.unattributed, 'tensor argument')} came from outside the trace (no parent op)"
                     + _unattributed_where(trace))
    batched = sorted(per_example_ops(trace))
    if batched:
        labels = first_few(trace._labels[i] for i in batched)
        lines.append(f"  {counted(len(batched), 'op')} ran inside torch.vmap ({labels}): recorded with one example's "
                     "shape, while the kernels ran on the whole batch (FLOPs not counted)")
    lines += _dropped_lines(trace)
    if trace.budget_exhausted_at is not None:
        lines.append(f"  saving stopped at {trace._labels[trace.budget_exhausted_at]} (max_saved_bytes)")
    if trace.stopped_after is not None:
        lines.append(f"  the forward was stopped after {trace.stopped_after} (stop_after=): no output")
    if trace.interventions:
        lines.append(f"  {counted(len(trace.interventions), 'op')} changed by interventions (log.interventions)")
    lines += [f"  caveat: {text}" for text in trace.caveats]
    lines.append("Ops:")
    shown = list(range(len(ops))) if len(ops) <= _HEAD + _TAIL else \
        list(range(_HEAD)) + [None] + list(range(len(ops) - _TAIL, len(ops)))
    listed = [ops[i] for i in shown if i is not None]
    # Columns as wide as their longest entry: a capped width let a long one (GPT-2's cache output,
    # output.past_key_values.layers.0.keys) push its line's shape and module call out of line with the rest.
    label_width = max(len(op.label) for op in listed) + 1
    func_width = max(len(_what(op)) for op in listed) + 1
    shape_width = max([14, *(len(_shape(op)) for op in listed)])
    index_width = len(str(len(ops) - 1)) + 2
    for i in shown:
        if i is None:
            lines.append(f"  ... {len(ops) - _HEAD - _TAIL} more ops (every op: log.ops, or log.to_pandas()) ...")
            continue
        op = ops[i]
        where = f"  @{op.module}" if op.module else ""
        lines.append(f"  {f'({i})':<{index_width}} {op.label:<{label_width}} {_what(op):<{func_width}} "
                     f"{_shape(op):<{shape_width}}{where}".rstrip())
    return "\n".join(lines)
