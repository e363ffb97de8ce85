"""Per-op values behind ``color_by=``, the colour each value gets, and the legend that explains them.

Values are read per op and summed over whatever a node stands for (a layer's passes, a collapsed module's
ops).  An op with no value (no FLOPs formula, a pseudo-op with no host time) stays uncoloured and the
legend says so: a missing number is never drawn as zero.  Times that would leave every op uncoloured (an empty
mapping, the device time of a kernel profile that recorded no device activity) are refused, saying what to use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..checks import check_number
from ..record.columns import Kind, is_first_output
from ..record.finite import nonfinite_flags
from ..record.grads import norm_of_norms
from ..record.summary import COUNT_UNITS, human_bytes, unit_for

METRICS = ("duration", "flops", "memory", "nonfinite", "device_time", "cpu_time", "grad_norm")
SUMMED_METRICS = ("duration", "flops", "memory", "device_time", "cpu_time")  # a node of several ops shows the sum
# The metrics read from times passed in: their keyword, the kernel profile column, what the time is.
_PASSED = {"device_time": ("device_times", "device_ns", "device time"),
           "cpu_time": ("cpu_times", "cpu_ns", "self CPU time")}
_CPU_RUN = "a CPU-only run (the profiler times device kernels only for a model on a GPU, with ProfilerActivity.CUDA)"
_CPU_INSTEAD = "colour by its self CPU time per op instead, with color_by='cpu_time', cpu_times=<the kernel profile>"
# Light to dark: low values pale, the costliest ops dark red.
_SCALE = ("#fff7c4", "#fee391", "#fec44f", "#fe9929", "#ec7014", "#cc4c02", "#8c2d04")
_DARK = frozenset(_SCALE[4:])
UNKNOWN_FILL = "#eeeeee"
# Checked-finite is cyan: green is the input colour and blue the output colour (dot.KIND_FILL).
NONFINITE_FILL, ORIGIN_FILL, FINITE_FILL = "#f4a3a3", "#c0001a", "#ccf2f4"
_DARK = _DARK | {ORIGIN_FILL}

_NOTES = {
    "duration": "host wall time per op; instrumented, so right for ranking ops and wrong for quoting them "
                "(time a model with torch.utils.benchmark.Timer)",
    "flops": "analytic forward FLOPs from torchlens's formula registry (a multiply-add counts 2)",
    "memory": "bytes of the tensor each op produced (0 for an in-place op, which wrote into another op's tensor)",
    "device_time": "device time per op from the kernel profile passed in",
    "cpu_time": "profiler self CPU time per op from the kernel profile passed in (the aten ops and runtime calls "
                "it ran on the host; not device time)",
    "nonfinite": "ops whose output held NaN or Inf, from flags recorded during capture or saved activations",
    "grad_norm": "2-norm of d loss / d (op output), from a trace taken with grads=True after a backward; "
                 "NaN/Inf gradients take the darkest colour",
}


def resolve_metric(color_by, device_times=None, cpu_times=None):
    """Normalise ``color_by`` to ``(name, times)``; a mapping alone means device times."""
    if isinstance(color_by, Mapping):
        return "device_time", _checked_times("device_time", color_by)
    if color_by is not None and color_by not in METRICS:
        raise ValueError(f"color_by must be one of {', '.join(map(repr, METRICS))} (or a mapping of op label "
                         f"to device seconds), not {color_by!r}")
    given = {"device_times": device_times, "cpu_times": cpu_times}
    for keyword, times in given.items():
        if times is not None and _PASSED.get(color_by, ("",))[0] != keyword:  # it would color nothing, silently
            also = ", or give the times as color_by=device_times" if keyword == "device_times" else ""
            raise ValueError(f"{keyword}= colors the graph only with color_by='{keyword[:-1]}': pass it too{also}")
    if color_by not in _PASSED:
        return color_by, None
    keyword = _PASSED[color_by][0]
    if given[keyword] is None:
        raise ValueError(f"color_by={color_by!r} needs {keyword}=, a mapping of op label to seconds, or the kernel "
                         "profile (tl.report.kernel_profile) to read them from")
    return color_by, _checked_times(color_by, given[keyword])


def _checked_times(metric, times) -> Mapping:
    """``{op label: seconds}`` from a mapping or a kernel profile, refused when it would leave every op grey."""
    keyword, _, what = _PASSED[metric]
    if _is_profile(times):
        return _profile_times(metric, times)
    if not isinstance(times, Mapping):
        raise TypeError(f"{keyword} must map op labels to seconds, not {type(times).__name__}")
    if not times:  # every op would be drawn grey, as if none had been measured
        hint = f" (a kernel profile of {_CPU_RUN} has none: {_CPU_INSTEAD})" if metric == "device_time" else ""
        raise ValueError(f"{keyword}= is empty: no op has a {what}, so nothing would be coloured{hint}")
    return times


def _is_profile(source) -> bool:
    return not isinstance(source, Mapping) and hasattr(source, "has_device") and hasattr(source, "device_time")


def _profile_times(metric, profile) -> dict:
    """A kernel profile's per-op times as ``{op label: seconds}``.  A profile that recorded no device activity (a
    CPU-only run) has no device time at all: refused, naming the CPU time it does have, not drawn all grey."""
    keyword, column, what = _PASSED[metric]
    if metric == "device_time" and not profile.has_device:
        raise ValueError(f"{keyword}= is a kernel profile of {_CPU_RUN}: it recorded no device activity, so there "
                         f"is no device time to colour by; {_CPU_INSTEAD}")
    times = {row["op"]: row[column] / 1e9 for row in profile.ops if row[column] is not None}
    if not times:
        raise ValueError(f"the kernel profile passed as {keyword}= measured no forward op's {what} (a backward-only "
                         "profile measures no forward; an incomplete join leaves ops unmeasured: see its .coverage)")
    return times


def op_values(trace, metric, times=None) -> list:
    """One value per op (None where unknown); for ``nonfinite`` True/False/None."""
    n = len(trace)
    if metric == "duration":
        calls = trace.calls
        return [(c.t1_ns - c.t0_ns) / 1e9 if c is not None else None
                for c in (calls[k] if k >= 0 else None for k in trace.call_indices)]
    if metric == "memory":
        from ..record.module_table import produced_bytes

        return [produced_bytes(trace, i) if kind == Kind.OP else None for i, kind in enumerate(trace._kind)]
    if metric == "flops":
        from .records import flops_function

        flops = flops_function()
        return [flops(op) if op.kind == "op" else None for op in trace.ops]
    if metric in _PASSED:
        return _passed_values(trace, metric, times)
    if metric == "nonfinite":
        return nonfinite_marks(trace)
    if metric == "grad_norm":
        return _grad_norms(trace, n)
    raise ValueError(metric)


def _passed_values(trace, metric, times) -> list:
    """Each op's time from ``{op label: seconds}``; a key that is no single op is refused, naming the keyword."""
    keyword, _, what = _PASSED[metric]
    values: list = [None] * len(trace)
    for label, seconds in times.items():
        target = trace[label]
        ops = getattr(target, "ops", None)
        if ops is not None and not hasattr(target, "first"):
            raise ValueError(f"{keyword} key {label!r} is a module, not an op label")
        if ops is not None and len(ops) > 1:
            raise ValueError(f"{keyword} key {label!r} names a layer with {len(ops)} passes: "
                             f"key each pass ({label}:1, {label}:2, ...)")
        index = target.first.index if hasattr(target, "first") else target.index
        values[index] = float(check_number(seconds, f"{keyword}[{label!r}]", f"give the op's {what} in seconds, a "
                                           "finite number 0 or more", who="render", at_least=0, finite=True))
    return values


def _grad_norms(trace, n) -> list:
    """Each op's gradient norm; a trace with no gradients at all is refused, saying how to get them, rather than
    drawn all grey as if every op had been left out."""
    from ..record.grads import grad_capture_of, grad_stats_column

    grad_capture_of(trace)  # a trace taken without grads=True: GradientUnavailable says to trace with it
    column = grad_stats_column(trace)
    if not column:
        raise ValueError("color_by='grad_norm' needs gradients: run a backward through log.output first (or "
                         "log.backward(loss))")
    values = [None] * n
    for i, stats in column.items():
        norm = stats["grad_norm"]
        values[i] = norm if math.isfinite(norm) else math.inf  # exploded: the top of the scale
    return values


def nonfinite_marks(trace) -> list:
    """True where an op's output held NaN/Inf, False where checked finite, None where not checked."""
    import torch

    flags: list = [None] * len(trace)
    for i, finite in trace.finite_flags.items():
        flags[i] = bool(finite[0] or finite[1])
    if not trace.is_cleaned_up:
        trace.drop_written()
        for i, tensor in trace.saved_activations.items():
            if flags[i] is None and isinstance(tensor, torch.Tensor):
                finite = nonfinite_flags(tensor)
                flags[i] = None if finite is None else any(finite)
    for i, kind in enumerate(trace.kinds):  # an output node shows its producer's tensor, where an op made it
        if kind == Kind.OUTPUT and flags[i] is None and trace.output_producer(i) >= 0:
            flags[i] = flags[trace.output_producer(i)]
    return flags


def nonfinite_origins(trace) -> set:
    """Labels ``torchlens.debug.nonfinite_origin`` names as origins."""
    from ..debug.nonfinite import nonfinite_origin

    try:
        report = nonfinite_origin(trace)
    except Exception:  # no flags, nothing non-finite: the colouring still stands without an origin
        return set()
    candidates = [getattr(report, "origin", None)] + list(getattr(report, "other_origins", ()))
    labels = set()
    for candidate in candidates:
        label = getattr(candidate, "label", candidate)
        if isinstance(label, str):
            labels.add(label)
    return labels


def aggregate(values, ops, metric=None, trace=None):
    """Sum of the known values of ``ops`` (any() for flags); None when none is known.  Gradient norms combine as
    the norm of the gradients taken together, as ``hot_path(by="grad_norm")`` groups them: a sum of norms is the
    norm of nothing.  A duration is its call's, held by each of its outputs: given the ``trace``, it counts on
    the call's first output only (``is_first_output``), as ``hot_path`` and ``to_pandas`` count it."""
    if metric == "duration" and trace is not None:
        ops = [i for i in ops if is_first_output(trace, i)]
    known = [values[i] for i in ops if values[i] is not None]
    if not known:
        return None
    if isinstance(known[0], bool):
        return any(known)
    if metric == "grad_norm":
        return norm_of_norms(known)
    return sum(known)


class Coloring:
    """Maps a node's aggregated value to a fill colour, and describes the mapping for the legend."""

    def __init__(self, metric, values, origins=()):
        self.metric = metric
        self.values = values
        self.origins = set(origins)
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                   and math.isfinite(v)]
        self.low = min(numbers) if numbers else 0.0
        self.high = max(numbers) if numbers else 0.0

    def fill(self, value, labels=()):
        """Fill colour for a node with aggregated ``value`` whose ops are ``labels``."""
        if self.metric == "nonfinite":
            if value is None:
                return UNKNOWN_FILL
            if value and self.origins.intersection(labels):
                return ORIGIN_FILL
            return NONFINITE_FILL if value else FINITE_FILL
        if value is None:
            return UNKNOWN_FILL
        return _SCALE[self._bin(value)]

    def font(self, fill) -> str:
        """Text colour readable on ``fill``."""
        return "white" if fill in _DARK else "black"

    def _bin(self, value) -> int:
        if value <= self.low or self.high <= self.low:
            return 0
        span = math.log(self.high) - math.log(self.low)
        position = (math.log(min(value, self.high)) - math.log(self.low)) / span
        return min(len(_SCALE) - 1, int(position * len(_SCALE)))

    def legend(self) -> dict:
        """``{"title", "note", "entries": [(colour, text), ...]}``."""
        entries = []
        if self.metric == "nonfinite":
            entries = [(NONFINITE_FILL, "output held NaN or Inf"), (FINITE_FILL, "checked finite"),
                       (UNKNOWN_FILL, "not checked (capture with record_finite=True or save activations)")]
            if self.origins:
                entries.insert(0, (ORIGIN_FILL, "origin: first op to produce a non-finite value"))
        else:
            if self.high > self.low:
                span = math.log(self.high) - math.log(self.low)
                for k, colour in enumerate(_SCALE):
                    top = math.exp(math.log(self.low) + span * (k + 1) / len(_SCALE))
                    entries.append((colour, f"up to {format_value(self.metric, top)}"))
            elif self.high > 0:
                entries.append((_SCALE[0], format_value(self.metric, self.high)))
            entries.append((UNKNOWN_FILL, "no value for this op"))
        note = _NOTES[self.metric]
        if self.metric == "grad_norm":
            note += ("; a node standing for several ops (a rolled layer, a collapsed module) shows the norm of their "
                     "gradients taken together")
        elif self.metric != "nonfinite":
            note += ("; a node standing for several ops (a rolled layer, a collapsed module) shows their sum, "
                     "marked + when some of them have no value (a lower bound)")
        return {"title": f"colour: {self.metric.replace('_', ' ')}", "note": note, "entries": entries}


def format_value(metric, value) -> str:
    if value is None:
        return "unknown"
    if metric in ("duration", *_PASSED):
        return format_seconds(value)
    if metric == "memory":
        return human_bytes(value)
    if metric == "flops":
        return format_count(value)
    if metric == "grad_norm":
        return f"{value:.3g}"
    return str(value)


def format_seconds(seconds) -> str:
    if seconds is None:
        return "unknown"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("\u00b5s", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def _short_shown(value: float, suffix: str) -> float:
    return float(f"{value:.0f}" if suffix == "" else f"{value:.3g}")


def format_count(n) -> str:
    """A count in a node's short form: three significant digits and a unit up to T (``1.05M``)."""
    unit, scale = unit_for(n, (*COUNT_UNITS, ("P", 1e15)), _short_shown)
    return f"{n:.0f}" if unit == "" else f"{n / scale:.3g}{unit}"
