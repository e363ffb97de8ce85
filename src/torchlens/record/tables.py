"""DataFrame views of a trace's records (pandas is imported only here, only when asked for)."""

from __future__ import annotations

from ..errors import MissingPackage
from .columns import is_first_output
from .grads import GRAD_COLUMNS, grad_stats_column


def require_pandas(what: str = "to_pandas()"):
    """pandas, which ``what`` builds its table with (an optional dependency)."""
    try:
        import pandas
    except ImportError as exc:  # pragma: no cover - exercised only where pandas is absent
        raise MissingPackage(f"{what} needs pandas: pip install pandas") from exc
    return pandas


def ops_frame(ops) -> "pandas.DataFrame":
    pd = require_pandas()
    rows = []
    grad_stats, with_grads = _grad_stats(ops)
    flags = ops[0]._trace._finite if ops else {}  # record_finite=True's (has_nan, has_inf) by op index
    for op in ops:
        source = op.source
        rows.append({
            "label": op.label,
            "layer_label": op.layer_label,
            "pass_index": op.pass_index,
            "num_passes": op.num_passes,
            "type": op.type,
            "kind": op.kind,
            "func_name": op.func_name,
            "shape": op.shape,
            "dtype": str(op.dtype).replace("torch.", ""),
            "device": str(op.device),
            "nbytes": op.nbytes,
            "parents": op.parents,
            "children": op.children,
            "module": op.module,
            "modules": op.modules,
            "params": op.params,
            "source_file": source.file if source else None,
            "source_line": source.line if source else None,
            "duration": call_duration_once(op),
            "grad_fn": op.grad_fn,
            "is_inplace": op.is_inplace,
            "multi_output_index": op.multi_output_index,
            "has_activation": op.index in op._trace._activations,
        })
        if flags:  # a column of a trace taken with record_finite=True: None where capture took no flag
            rows[-1]["finite"] = flags.get(op.index)
        if with_grads:  # columns appear once a backward delivered gradients
            rows[-1].update(grad_stats.get(op.index, _NO_GRAD))
    return pd.DataFrame(rows)


def call_duration_once(op):
    """``op.duration`` on its call's first output and None (NaN) on the call's further outputs: the time is the
    call's, so a column holding it on every output of ``torch.split`` sums to more time than the forward took,
    where ``hot_path`` counts the call once."""
    return op.duration if op.call is None or is_first_output(op._trace, op.index) else None


def _layer_duration(layer):
    """The summed time of a layer's passes, counted as the ops table counts it (None for a layer of further
    outputs of multi-output calls, or of no torch call)."""
    times = [t for t in map(call_duration_once, layer.ops) if t is not None]
    return sum(times) if times else None


def _grad_stats(ops) -> tuple:
    """The gradients' statistics, and whether a backward delivered gradients (meta ones have none)."""
    if not ops:
        return {}, False
    trace = ops[0]._trace
    stats = grad_stats_column(trace)
    held = getattr(trace._gradcap, "grads", None) if not trace._cleaned else None
    return stats, bool(stats) or bool(held)


_NO_GRAD = dict.fromkeys(GRAD_COLUMNS)


def layers_frame(layers) -> "pandas.DataFrame":
    pd = require_pandas()
    return pd.DataFrame([
        {
            "layer_label": layer.layer_label,
            "type": layer.first.type,
            "func_name": layer.first.func_name,
            "num_passes": layer.num_passes,
            "shape": _agreed(layer, "shape"),
            "module": _agreed(layer, "module_address"),
            "duration": _layer_duration(layer),
        }
        for layer in layers
    ])


def _agreed(layer, name: str):
    """``name`` of a layer whose passes all agree on it; None where they differ, since no pass's value stands for
    the others' (a shared module given inputs of two lengths: each pass's shape is in the ops' table)."""
    try:
        return getattr(layer, name)
    except AttributeError:  # Layer refuses a field its passes differ in
        return None


def _frame(rows: list, columns: list) -> "pandas.DataFrame":
    """A frame of ``rows`` (dicts) with ``columns`` even when there is no row (a function traced without a model
    has no module calls, modules, parameters or buffers): an empty table still has the columns code reads."""
    return require_pandas().DataFrame(rows, columns=columns)


def module_calls_frame(calls) -> "pandas.DataFrame":
    return _frame([
        {
            "label": c.label,
            "address": c.address,
            "call_index": c.call_index,
            "class_name": c.module.class_name,
            "parent": c.parent.label if c.parent else None,
            "depth": c.depth,
            "num_ops": c._num_ops,
            "input_ops": c.input_ops,
            "output_ops": c.output_ops,
            "duration": c.duration,
        }
        for c in calls
    ], ["label", "address", "call_index", "class_name", "parent", "depth", "num_ops", "input_ops", "output_ops",
        "duration"])


def modules_frame(modules) -> "pandas.DataFrame":
    return _frame([
        {
            "address": m.address,
            "all_addresses": m.all_addresses,
            "class_name": m.class_name,
            "num_calls": m.num_calls,
            "params": m.param_names,
        }
        for m in modules
    ], ["address", "all_addresses", "class_name", "num_calls", "params"])


def params_frame(params) -> "pandas.DataFrame":
    frame = _frame([
        {"address": p.address, "shape": p.shape, "dtype": str(p.dtype).replace("torch.", ""),
         "numel": p.numel, "requires_grad": p.requires_grad, "module": p.module_address, "ops": p.op_labels}
        for p in params
    ], columns=["address", "shape", "dtype", "numel", "requires_grad", "module", "ops"])
    # A lazy module's uninitialized parameter has no size: a missing count, where a float column would turn every
    # count into a float (16.0) and that one into NaN.
    frame["numel"] = frame["numel"].astype("Int64")
    return frame


def buffers_frame(buffers) -> "pandas.DataFrame":
    return _frame([{"address": b.address, "ops": b.op_labels, "readers": b.readers} for b in buffers],
                  ["address", "ops", "readers"])
