"""``log.to_chrome_trace(path)``: a trace's ops and module calls as a chrome trace, on the host clock.

Each module call and each captured torch call becomes a duration event, nested as they ran, with the
op label, shapes, dtype and source line in its args.  Times are the capture's own ``perf_counter``
brackets around each call: host time under instrumentation, for seeing structure and order.  It is
not device time and shares no clock with a ``torch.profiler`` trace; for measured kernel time use
``torchlens.report.kernel_profile``, whose native chrome trace is the profiler's own.  The file says
so in ``otherData``, which trace viewers show as metadata.
"""

from __future__ import annotations

import json

import torch

from ..checks import check_file_to_write, check_flag
from ..record.trace import checked_trace

SCHEMA = "torchlens.host_clock_view.v1"
CLOCK_NOTE = ("Host-clock semantic view made by torchlens: ops and module calls timed with "
              "time.perf_counter around each call while the model ran under capture. Instrumented host "
              "time, not device time; not on the torch.profiler/Kineto clock, so never align it with a "
              "profiler trace. For measured kernel time use torchlens.report.kernel_profile.")
_PID, _TID = 1, 1


def _us(ns: int) -> float:
    return round(ns / 1000.0, 3)


def to_chrome_trace(trace, path, *, module_calls: bool = True) -> str:
    """Write ``trace`` as a chrome trace JSON to ``path`` (open it in Perfetto or chrome://tracing)."""
    checked_trace(trace, "to_chrome_trace")
    check_flag(module_calls, "module_calls", "give True to draw module calls around their ops, False for ops alone",
               who="to_chrome_trace")
    path = check_file_to_write(path, "path", "name a file in an existing folder (a str or a pathlib.Path)",
                               who="to_chrome_trace")
    calls = trace.calls
    starts = [c.t0_ns for c in calls]
    if module_calls:
        starts += [mc.start_ns for mc in trace.module_calls]
    base = min(starts, default=0)
    events = [
        {"ph": "M", "name": "process_name", "pid": _PID, "tid": 0,
         "args": {"name": f"torchlens host-clock view: {trace.model_name}"}},
        {"ph": "M", "name": "thread_name", "pid": _PID, "tid": _TID, "args": {"name": "forward (host clock)"}},
    ]
    if module_calls:
        events.extend(_module_events(trace, base))
    events.extend(_op_events(trace, base))
    data = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "distributedInfo": {"rank": 0},  # trace analyzers (HTA) key files by rank
        "otherData": {"schema": SCHEMA, "clock": CLOCK_NOTE, "model": trace.model_name,
                      "torch": torch.__version__, "ops": len(calls),
                      "module_calls": len(trace.module_calls) if module_calls else 0},
    }
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def _module_events(trace, base: int) -> list:
    events = []
    for mc in trace.module_calls:
        if mc.end_ns is None:
            continue  # the call never returned
        events.append({
            "ph": "X", "cat": "module_call", "name": mc.label, "pid": _PID, "tid": _TID,
            "ts": _us(mc.start_ns - base), "dur": _us(mc.end_ns - mc.start_ns),
            "args": {"module_call": mc.label, "address": mc.address, "class": mc.module.class_name,
                     "depth": mc.depth, "ops": mc._num_ops},
        })
    return events


def _op_events(trace, base: int) -> list:
    labels, layers, types, meta = trace.labels, trace.op_layer_labels, trace.op_types, trace.op_meta
    module_calls = trace.module_calls
    events = []
    for call in trace.calls:
        first, count = call.first_record, call.num_outputs
        outputs = range(first, first + count)
        m = trace.module_call_indices[first]
        args = {
            "label": labels[first],
            "layer": layers[first],
            "type": types[first],
            "func": trace.func_names[first],
            "shapes": [list(meta[i].shape) for i in outputs],
            "dtype": str(meta[first].dtype).replace("torch.", ""),
            "module_call": module_calls[m].label if m >= 0 else None,
        }
        if count > 1:
            args["outputs"] = [labels[i] for i in outputs]
        source = trace.ops[first].source
        if source is not None:
            args["source"] = f"{source.file}:{source.line}"
        events.append({"ph": "X", "cat": "op", "name": labels[first], "pid": _PID, "tid": _TID,
                       "ts": _us(call.t0_ns - base), "dur": _us(call.t1_ns - call.t0_ns), "args": args})
    return events
