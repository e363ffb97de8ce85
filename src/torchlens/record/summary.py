"""The text ``print(trace)`` shows: counts, structure, memory, timing, and a bounded op roster."""

from __future__ import annotations

_HEAD, _TAIL = 30, 5


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _shape(op) -> str:
    return "x".join(str(d) for d in op.shape) or "scalar"


def _what(op) -> str:
    """The function for ops; where the tensor sat for inputs, outputs and buffers."""
    return op.func_name if op.kind == "op" else (op.io_path or op.kind)


def summary_text(trace) -> str:
    ops = trace.ops
    n_compute = sum(1 for op in ops if op.kind == "op")
    recurrence = (f"recurrent (up to {trace.num_passes_max} passes of one layer)"
                  if trace.is_recurrent else "feed-forward (every layer ran once)")
    saved = "released by cleanup()" if trace.is_cleaned_up else \
        f"{len(trace._activations)} activations saved, {human_bytes(trace.saved_bytes)}"
    lines = [
        f"Trace of {trace.model_name}",
        f"  {len(ops)} ops ({n_compute} torch calls, {len(trace.inputs)} inputs, "
        f"{len(trace.outputs)} outputs), {len(trace.layers)} layers",
        f"  {len(trace.modules)} modules, {len(trace.module_calls)} module calls; {recurrence}",
        f"  {saved}",
        f"  captured in {trace.capture_duration * 1e3:.1f} ms (host times below are instrumented)",
    ]
    if trace.unattributed:
        lines.append(f"  {trace.unattributed} tensor arguments came from outside the trace (no parent op)")
    if trace._dropped:
        lines.append(f"  {len(trace._dropped)} saved activations were dropped (mutated behind capture)")
    if trace.budget_exhausted_at is not None:
        lines.append(f"  saving stopped at {trace._labels[trace.budget_exhausted_at]} (max_saved_bytes)")
    if trace.stopped_after is not None:
        lines.append(f"  the forward was stopped after {trace.stopped_after} (stop_after=): no output")
    if trace.interventions:
        lines.append(f"  {len(trace.interventions)} ops changed by interventions (log.interventions)")
    lines.append("Ops:")
    shown = list(range(len(ops))) if len(ops) <= _HEAD + _TAIL else \
        list(range(_HEAD)) + [None] + list(range(len(ops) - _TAIL, len(ops)))
    listed = [ops[i] for i in shown if i is not None]
    label_width = min(40, max(len(op.label) for op in listed) + 1)
    func_width = min(32, max(len(_what(op)) for op in listed) + 1)
    index_width = len(str(len(ops) - 1)) + 2
    for i in shown:
        if i is None:
            lines.append(f"  ... {len(ops) - _HEAD - _TAIL} more ops ...")
            continue
        op = ops[i]
        where = f"  @{op.module}" if op.module else ""
        lines.append(f"  {f'({i})':<{index_width}} {op.label:<{label_width}} {_what(op):<{func_width}} "
                     f"{_shape(op):<14}{where}".rstrip())
    return "\n".join(lines)
