"""Rows of a kernel profile: per captured op, per layer, per module call (inclusive and exclusive).

Input is a ``JoinResult`` (profiler numbers keyed by marker ids) plus the trace; output is plain dicts.
A call that returned several tensors is one row, on its first output, with the others listed in
``outputs``, so no time is counted twice.  A number is ``None`` when it was not measured (no device
activity recorded, or the op's marker is missing from the profiler's results), never 0.
"""

from __future__ import annotations

from ..record.modules import script_modules
from .profile_join import ATEN_OPS, CPU_NS, DEVICE_NS, KERNELS, MEMOPS

SUMMED = ("cpu_ns", "aten_ops", "device_ns", "kernels", "memops")


def add(a, b):
    """Sum where ``None`` (unknown) wins: an unknown part makes the total unknown."""
    if a is None or b is None:
        return None
    return a + b


def _metrics(tally, measured: bool, has_device: bool, prefix: str) -> dict:
    if not measured:
        return {f"{prefix}{k}": None for k in SUMMED}
    tally = tally or (0, 0, 0, 0, 0)
    device = has_device or None  # device columns are unknown without device activity
    return {
        f"{prefix}cpu_ns": tally[CPU_NS],
        f"{prefix}aten_ops": tally[ATEN_OPS],
        f"{prefix}device_ns": tally[DEVICE_NS] if device else None,
        f"{prefix}kernels": tally[KERNELS] if device else None,
        f"{prefix}memops": tally[MEMOPS] if device else None,
    }


def op_rows(trace, serial_of_call: dict, joined, backward: bool) -> list:
    """One dict per captured call, in execution order."""
    labels, layers, types = trace.labels, trace.op_layer_labels, trace.op_types
    module_calls = trace.module_calls
    rows = []
    for c, call in enumerate(trace.calls):
        first, count = call.first_record, call.num_outputs
        serial = serial_of_call.get(c)
        measured = serial is not None and joined.marker_counts.get(("op", serial)) == 1
        measured_backward = measured
        if joined.backward_only:  # a backward-only profile of an earlier trace: no forward figures
            measured_backward = serial in joined.backward_measured
        m = trace.module_call_indices[first]
        row = {
            "op": labels[first],
            "layer": layers[first],
            "type": types[first],
            "module": module_calls[m].label if m >= 0 else None,
            "outputs": [labels[i] for i in range(first + 1, first + count)],
            "host_ns": joined.op_span.get(serial) if measured else None,
            "aten": list(joined.op_aten.get(serial, ())) if measured else None,
        }
        row.update(_metrics(joined.op_forward.get(serial), measured, joined.has_device, ""))
        if backward:
            row.update(_metrics(joined.op_backward.get(serial), measured_backward, joined.has_device, "bwd_"))
        row["_index"] = first
        rows.append(row)
    return rows


def _metric_names(backward: bool) -> list:
    names = list(SUMMED)
    if backward:
        names += [f"bwd_{k}" for k in SUMMED]
    return names


# The fields each level's rows begin with, before their figures.
_LEADING = {"op": ("op", "layer", "type", "module", "outputs", "host_ns", "aten"),
            "layer": ("layer", "type", "passes", "outputs"),
            "module": ("module_call", "address", "class", "depth", "ops", "self_ops", "marked")}


def table_columns(level: str, backward: bool) -> list:
    """The fields of ``level``'s rows, in their order: the columns of a table with no rows (a forward that ran no
    torch call), which has them as any other does."""
    names = _metric_names(backward)
    if level == "module":  # each figure inclusive, then its call's own
        names = [name for k in names for name in (k, f"self_{k}")]
    return [*_LEADING[level], *names]


def layer_rows(trace, rows: list, backward: bool) -> list:
    """One dict per layer, summed over its passes; a multi-output call's row also lists, in ``outputs``, the layers
    of its further outputs, which have no row of their own (as its op row lists their op labels)."""
    names = _metric_names(backward)
    by_layer: dict = {}
    for row in rows:
        entry = by_layer.get(row["layer"])
        if entry is None:
            entry = by_layer[row["layer"]] = {"layer": row["layer"], "type": row["type"], "passes": 0,
                                              "outputs": _output_layers(trace, row), **{k: 0 for k in names}}
        entry["passes"] += 1
        for k in names:
            entry[k] = add(entry[k], row[k])
    return list(by_layer.values())


def _output_layers(trace, row) -> list:
    """The layer labels of a call's further outputs (``max_2_3`` beside ``max_1_2``), from its first record on."""
    first, layers = row["_index"], trace.op_layer_labels
    return [layers[i] for i in range(first + 1, first + 1 + len(row["outputs"]))]


def module_rows(trace, rows: list, joined, backward: bool) -> list:
    """Per module call: ``self_*`` (its own ops plus work inside it outside any op) and inclusive."""
    names = _metric_names(backward)
    calls = trace.module_calls
    device_keys = ("device_ns", "kernels", "memops")
    zero = {k: (None if not joined.has_device and k.endswith(device_keys) else 0) for k in names}
    own = [dict(zero) for _ in calls]
    counts = [0] * len(calls)
    for row in rows:
        m = trace.module_call_indices[row["_index"]]
        if m >= 0:
            counts[m] += 1 + len(row["outputs"])  # op labels, as ModuleCall.ops counts them
            for k in names:
                own[m][k] = add(own[m][k], row[k])
    for index, tally in joined.module_direct.items():
        if 0 <= index < len(calls):
            direct = _metrics(tally, True, joined.has_device, "")
            for k in SUMMED:
                own[index][k] = add(own[index][k], direct[k])
    if backward:  # a TorchScript module's backward nodes are no captured op's: not its measured zero
        for index in (c for indices in script_modules(trace).values() for c in indices):
            own[index].update((k, None) for k in names if k.startswith("bwd_"))
    for index in range(len(calls)):
        if joined.marker_counts.get(("module", index)) != 1:
            # Its direct work is unknown; its ops' numbers still stand on their own markers.
            own[index]["_unmarked"] = True
    inclusive = [dict(t) for t in own]
    inclusive_counts = list(counts)
    for index in range(len(calls) - 1, -1, -1):  # children are recorded after their parent
        parent = calls[index].parent
        if parent is not None:
            for k in names:
                inclusive[parent.index][k] = add(inclusive[parent.index][k], inclusive[index][k])
            inclusive_counts[parent.index] += inclusive_counts[index]
    out = []
    for index, mc in enumerate(calls):
        row = {"module_call": mc.label, "address": mc.address, "class": mc.module.class_name,
               "depth": mc.depth, "ops": inclusive_counts[index], "self_ops": counts[index],
               "marked": not own[index].get("_unmarked", False)}
        for k in names:
            row[k] = inclusive[index][k]
            row[f"self_{k}"] = own[index][k]
        out.append(row)
    return out
