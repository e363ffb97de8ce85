"""The record panel's content: one small JSON-ready dict per item and per module group.

Built once per render from the trace's columns.  Activation statistics are computed only for saved
activations, under ``torch.no_grad``, and never for a cleaned-up trace.
"""

from __future__ import annotations

import math
from decimal import Decimal

from .dot import describe_action
from .metrics import format_count, format_seconds
from ..record.finite import nonfinite_flags
from ..record.layouts import dense_values, magnitudes, shape_text
from ..tree import without_values
from ..record.summary import human_bytes
from ..errors import GradientUnavailable


def flops_function():
    """``torchlens.report.flops.op_flops``, imported late (viz and report are sibling bridges)."""
    from ..report.flops import op_flops

    return op_flops


def activation_stats(tensor) -> dict:
    """The panel's statistics of a tensor's values: ``numel``; ``nan``/``inf`` counts for floats; ``true`` for
    bools; ``min``/``max``/``mean``/``std`` over the finite values (complex: their magnitudes).  Large
    activations make this the bulk of a render, so the common, finite case takes few passes: one sum proves
    every value finite (``record.finite``), and min and max come from one reduction."""
    import torch

    with torch.no_grad():
        stats = {"numel": tensor.numel()}
        if tensor.numel() == 0 or without_values(tensor):  # a meta or fake tensor has a shape and no values
            return stats
        t = dense_values(tensor.detach())
        if t.is_complex():
            t = magnitudes(t)
        if t.dtype == torch.bool:
            stats["true"] = int(t.sum())
            return stats
        if t.is_floating_point():
            stats["nan"] = stats["inf"] = 0
            if nonfinite_flags(t) != (False, False):
                stats["nan"] = int(torch.isnan(t).sum())
                stats["inf"] = int(torch.isinf(t).sum())
                t = t[torch.isfinite(t)]
                if t.numel() == 0:
                    return stats
        try:
            t = t.double() if t.is_floating_point() else t.to(torch.float64)
        except NotImplementedError:  # bits and sub-byte integer dtypes (torch.bits8, torch.uint4): no arithmetic
            return stats
        low, high = torch.aminmax(t)
        stats.update(min=_num(low), max=_num(high), **_mean_std(t, max(-float(low), float(high))))
        return stats


def _mean_std(t, largest: float) -> dict:
    """``mean``, and ``std`` of more than one value, of finite float64 values whose largest magnitude is
    ``largest``.  Reduced directly, the sum a mean takes overflows for values near 1.8e308 and the squares a std
    sums for values above about 1e154: those are taken again of the values scaled by ``largest`` and scaled
    back, as a gradient's norm is (``record.grads``), since an Infinity would misstate finite values and is no
    JSON the page can parse."""
    figures = {"mean": t.mean()}
    if t.numel() > 1:
        figures["std"] = t.std()
    if all(math.isfinite(v) for v in figures.values()):
        return {name: _num(v) for name, v in figures.items()}
    scaled = t / largest
    figures = {name: getattr(scaled, name)() for name in figures}
    return {name: _scaled_back(float(v), largest) for name, v in figures.items()}


def _scaled_back(value: float, scale: float):
    """``value * scale`` as a figure of the panel: a number, or text where it is beyond float64's largest
    number (a std of values near it can be: that of 1.7e308 and -1.7e308 is 2.4e308)."""
    product = value * scale
    return _num(product) if math.isfinite(product) else format(Decimal(value) * Decimal(scale), ".6g")


def gradient_record(trace, op):
    """The panel's gradient row: statistics of d loss / d output, or why there is none (``grads=True``)."""
    if trace._gradcap is None:
        return None
    from ..record.grads import grad_stats_column

    stats = grad_stats_column(trace).get(op.index)
    if stats is not None:
        shown = {"norm": stats["grad_norm"], "min": stats["grad_min"], "max": stats["grad_max"],
                 "non-finite": stats["grad_nonfinite"]}
        held, _ = _held_grad(trace, op)
        if held is not None:
            shown = dict(activation_stats(held), **shown)
        return {k: (_num(v) if math.isfinite(v) else str(v)) if isinstance(v, float) else v for k, v in shown.items()}
    held, unreadable = _held_grad(trace, op)
    if held is not None and without_values(held):
        return "no values: a meta tensor (the backward ran on the meta device or under FakeTensorMode)"
    if unreadable is not None:
        return f"unreadable: {unreadable}"
    if not op.requires_grad:
        return "none: the output does not require grad"
    return "none yet: no backward reached it (or grads=[...] left it out)"


def _held_grad(trace, op) -> tuple:
    """``(gradient tensor, None)`` where the trace holds one for ``op``; ``(None, why)`` where one arrived that
    cannot be read (a loaded trace whose file holds no tensor for it, a batched backward's), whose statistics,
    if any, are all there is to show; ``(None, None)`` where none arrived."""
    if trace.is_cleaned_up or not op.has_grad:
        return None, None
    try:
        return op.grad, None
    except GradientUnavailable as exc:
        return None, str(exc).removeprefix(f"{op.label}: ")


def _num(x) -> float:
    return float(f"{float(x):.6g}")


class RecordBuilder:
    """Turns ops, items and module groups into panel records."""

    def __init__(self, trace, coloring=None):
        self.trace = trace
        self.coloring = coloring
        self.flops = flops_function()
        self._flops_cache: dict = {}

    def op_flops(self, op):
        if op.kind != "op":
            return None
        if op.index not in self._flops_cache:
            try:
                self._flops_cache[op.index] = self.flops(op)
            except Exception:  # a formula that cannot read this op leaves FLOPs unknown, not wrong
                self._flops_cache[op.index] = None
        return self._flops_cache[op.index]

    def op_record(self, op) -> dict:
        trace = self.trace
        rec = {
            "label": op.label, "layer": op.layer_label, "kind": op.kind, "type": op.type,
            "function": op.func_name, "shape": shape_text(op.shape), "dtype": str(op.dtype).replace("torch.", ""),
            "device": str(op.device), "memory": human_bytes(op.nbytes),
        }
        if op.num_passes > 1:
            rec["pass"] = f"{op.pass_index} of {op.num_passes}"
        if op.io_path:
            rec["path"] = op.io_path
        stack = _stack(op)
        if stack:
            rec["modules"] = stack
        source = op.source
        if source is not None:
            rec["source"] = f"{source.file}:{source.line} in {source.function}"
            code = source.code
            if code:
                rec["code"] = code
        if op.params:
            rec["params"] = list(op.params)
        if op.kind == "op":
            rec["duration"] = format_seconds(op.duration) + " (host, instrumented)"
            flops = self.op_flops(op)
            rec["flops"] = format_count(flops) if flops is not None else "unknown"
            coloring = self.coloring
            if coloring is not None and coloring.metric in ("device_time", "cpu_time"):  # profiler times passed in
                rec[coloring.metric] = format_seconds(coloring.values[op.index])
            if op.grad_fn:
                rec["grad_fn"] = op.grad_fn
            if op.is_inplace:
                rec["inplace"] = True
        rec["parents"] = op.parents
        if op.unattributed_args:
            rec["outside"] = f"{op.unattributed_args} tensor argument(s) made outside the trace (no parent op)"
        rec["children"] = op.children
        if op.finite is not None:
            rec["finite"] = {"nan": bool(op.finite[0]), "inf": bool(op.finite[1])}
        if not trace.is_cleaned_up and op.has_activation:
            rec["activation"] = activation_stats(trace.saved_activations[op.index])
        elif op.dropped_reason is not None:
            rec["activation"] = {"dropped": op.dropped_reason}
        else:
            rec["activation"] = f"not saved: {self._unsaved_reason(op)}"
        self._add_intervention(rec, op)
        gradient = gradient_record(trace, op)
        if gradient is not None:
            rec["gradient"] = gradient
        return rec

    def _unsaved_reason(self, op) -> str:
        """Why an op has no saved value to give statistics of (a record without one would not say)."""
        trace = self.trace
        if trace.is_cleaned_up:
            return "the trace was cleaned up (cleanup() released every activation)"
        stop = trace.budget_exhausted_at
        if stop is not None and op.index >= stop:
            return f"max_saved_bytes was reached at {trace.labels[stop]}; nothing from there on was saved"
        return "save= did not select this op"

    def _add_intervention(self, rec, op) -> None:
        """An intervened op says so: its activation is the action's value, ``original`` the op's own."""
        applied = op.intervention
        if applied is None:
            return
        action = describe_action(applied.action)
        rec["intervention"] = f"{action} at {applied.site_text}: the activation below is the changed value"
        original = None if self.trace.is_cleaned_up else self.trace._originals.get(op.index)  # None: not kept
        if original is not None:
            rec["original"] = activation_stats(original)

    def layer_record(self, item) -> dict:
        ops = [self.trace.ops[i] for i in item.ops]
        if len(ops) == 1:
            return self.op_record(ops[0])
        first = ops[0]
        rec = self.op_record(first)
        rec["label"] = item.label
        rec["passes"] = [op.label for op in ops]
        rec.pop("pass", None)
        rec.pop("activation", None)
        shapes = sorted({shape_text(op.shape) for op in ops})
        rec["shape"] = ", ".join(shapes)
        # Totals say they are totals, and a per-pass figure says so: the first pass's alone would pass for all.
        low, high = min(op.nbytes for op in ops), max(op.nbytes for op in ops)
        sizes = human_bytes(low) if low == high else f"{human_bytes(low)} to {human_bytes(high)}"
        rec["memory"] = f"{sizes} per pass"
        if first.kind == "op":
            total = sum(op.duration or 0.0 for op in ops)
            rec["duration"] = f"{format_seconds(total)} over {len(ops)} passes (host, instrumented)"
            flops = [self.op_flops(op) for op in ops]
            rec["flops"] = f"{format_count(sum(flops))} over {len(ops)} passes" if None not in flops else "unknown"
        rec["parents"] = self._in_order(p for op in ops for p in op.parents)
        rec["children"] = self._in_order(c for op in ops for c in op.children)
        self._pass_fields(rec, ops)
        return rec

    def _pass_fields(self, rec, ops) -> None:
        """Fields that differ by pass, over every pass: the first pass's alone would stand for all of them (a
        NaN from pass 2 on, the module calls of a loop, a gradient or an intervention on a later pass)."""
        stacks = [_stack(op) for op in ops]
        if any(stack != stacks[0] for stack in stacks):
            rec["modules"] = [f"{op.label}: {' > '.join(stack) or '-'}" for op, stack in zip(ops, stacks)]
        flags = [op.finite for op in ops if op.finite is not None]
        if flags:
            rec["finite"] = {"nan": any(f[0] for f in flags), "inf": any(f[1] for f in flags)}
            if len(flags) < len(ops):
                rec["finite"]["unchecked passes"] = len(ops) - len(flags)
        coloring = self.coloring
        if coloring is not None and coloring.metric in ("device_time", "cpu_time") and ops[0].kind == "op":
            known = [coloring.values[op.index] for op in ops if coloring.values[op.index] is not None]
            counted_over = f"{len(known)} of {len(ops)}" if len(known) < len(ops) else str(len(ops))
            # a pass with no time adds no zero: the total says over how many passes it was taken
            rec[coloring.metric] = f"{format_seconds(sum(known))} over {counted_over} passes" if known else "unknown"
        changed = [op for op in ops if op.intervention is not None]
        rec.pop("intervention", None), rec.pop("original", None)
        if changed:
            rec["intervention"] = [f"{op.label}: {describe_action(op.intervention.action)} at "
                                   f"{op.intervention.site_text}" for op in changed]
        gradients = [gradient_record(self.trace, op) for op in ops]
        if gradients[0] is not None:
            rec["gradient"] = [f"{op.label}: {_text(g)}" for op, g in zip(ops, gradients)]

    def _in_order(self, labels) -> list:
        """Distinct labels in execution order."""
        return sorted(set(labels), key=lambda label: self.trace._by_label(label).index)

    def group_record(self, group) -> dict:
        trace = self.trace
        calls = [trace.module_calls[c] for c in group.calls]
        first = calls[0]
        rec = {"label": group.label, "kind": "module", "class": group.class_name, "depth": group.depth,
               "calls": [c.label for c in calls], "ops": _ops_per_call(calls)}
        # A rolled box's calls each had their own inputs and outputs: the first call's alone would stand for all.
        rec["inputs"] = [line for call in calls for line in self._call_tensors(call, call.input_ops, len(calls))]
        rec["outputs"] = [line for call in calls for line in self._call_tensors(call, call.output_ops, len(calls))]
        durations = [c.duration for c in calls if c.duration is not None]
        if durations:
            over = f" over {len(durations)} calls" if len(calls) > 1 else ""  # a total, not one call's
            rec["duration"] = f"{format_seconds(sum(durations))}{over} (host, instrumented)"
        if first.module.param_names:
            rec["params"] = [f"{first.address}.{name}" for name in first.module.param_names]
        return rec

    def _call_tensors(self, call, labels, num_calls) -> list:
        """``label (shape)`` for each tensor into or out of a call; prefixed by the call in a box of several."""
        lines = [f"{label} ({shape_text(self.trace._by_label(label).shape)})" for label in labels]
        return [f"{call.label}: {line}" for line in lines] if num_calls > 1 else lines


def _stack(op) -> list:
    """The module calls an op ran in, outermost first."""
    stack, call = [], op.module_call
    while call is not None:
        stack.append(f"{call.label} ({call.module.class_name})")
        call = call.parent
    return list(reversed(stack))


def _text(value) -> str:
    """A record field as one line (a statistics dict as ``name value`` pairs)."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def _ops_per_call(calls):
    """The ops inside one call, or, for a rolled box of several calls, per call (``3-4 per call`` when they
    differ): the first call's count alone would pass for every call's."""
    counts = [len(call.ops) for call in calls]
    if len(counts) == 1:
        return counts[0]
    low, high = min(counts), max(counts)
    return f"{low} per call" if low == high else f"{low}-{high} per call"
