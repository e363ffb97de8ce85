"""Gradients in a saved trace: ``gradients.safetensors`` beside the activations, and a ``grads`` record.

The folder keeps the same rules as the rest of a saved trace (manifest sizes and hashes, safetensors,
no pickle): the tensors are d loss / d (op output) per op and each parameter's ``.grad``; the JSON
record holds which ops were selected, how many backwards were seen, the arrival (backward) order, the
statistics columns (which survive ``cleanup()``) and what autograd packed for backward per call.
A trace taken without ``grads=`` writes neither.
"""

from __future__ import annotations

import math
import os

from ..record.grads import FROM_BATCHED_BACKWARD, grad_of_another_layout, unreadable
from ..record.params import listed_params
from .encode import unsavable
from .format import TRACE_JSON, TraceFileError, check_index, reading_record
from .tensorfile import laid_out, layouts_of, read_tensor_file, write_tensors

GRAD_TENSORS = "gradients.safetensors"


def _float(v):
    return v if v is None or math.isfinite(v) else repr(v)  # JSON has no NaN/Inf: "nan", "inf", "-inf"


def _unfloat(v):
    if v is None or isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    if v in ("nan", "inf", "-inf"):
        return float(v)
    raise TraceFileError(f"{TRACE_JSON}: grads: {v!r} is not a number")


def write_grads(trace, folder: str, with_tensors: bool):
    """Write ``gradients.safetensors`` (when there are gradients to write); return (file names, record)."""
    packing = trace._packlog
    packed = None if packing is None else {
        "note": packing.note_text,
        "packed": [[c, [[int(k), int(b)] for k, b in sizes.items()]] for c, sizes in sorted(packing.packed.items())]}
    capture = trace._gradcap
    if capture is None:
        return [], (None if packed is None else {"saved_for_backward": packed})
    from ..record.grads import grad_stats_column

    record = {
        "saved_for_backward": packed,
        "selected": sorted(capture.selected),
        "num_backwards": capture.backwards,
        "order": list(capture.order),
        "stats": [[i, {k: _float(v) for k, v in s.items()}] for i, s in sorted(grad_stats_column(trace).items())],
        "tensors": [],
        "param_tensors": [],
        # [op index or parameter address, why]: a gradient no safetensors file can hold (a loaded trace's too)
        "not_saved": [[owner, why] for owner, why in trace._unsaved_grads.items()],
        "param_grads": _param_grads_missing(trace, with_tensors),  # None: saved; else why they were not
    }
    tensors = {}
    if with_tensors and not trace.is_cleaned_up:
        for i, g in sorted(capture.grads.items()):
            _add(tensors, record, i, f"g{i}", g, "tensors")
        layouts = {p.address: (p.shape, p.dtype) for p in listed_params(trace) if p.shape is not None}
        for n, (address, g) in enumerate(_param_grads(trace)):
            if g is None:
                continue
            why = grad_of_another_layout(layouts.get(address), g)
            if why is None:
                _add(tensors, record, address, f"p{n}", g, "param_tensors")
            else:
                record["not_saved"].append([address, f"its gradient was not saved ({why})"])
    if not tensors:
        return [], record
    write_tensors(os.path.join(folder, GRAD_TENSORS), tensors, metadata={"format": "torchlens-grads"})
    record["strides"] = layouts_of(tensors)  # channels_last and transposed gradients load laid out as they were
    return [GRAD_TENSORS], record


def _param_grads(trace) -> list:
    """``[(address, .grad)]`` of the traced model's parameters, or those a loaded trace read back."""
    if trace.loaded_from is not None:
        return list((trace._param_grads or {}).items())
    return [(address, p.grad) for address, p in trace._model_params or ()]


def _param_grads_missing(trace, with_tensors: bool):
    if trace.loaded_from is not None and trace._param_grads is None:  # the reason it was read with stays
        return trace._param_grads_missing or "it was saved without gradient tensors"
    if trace.is_cleaned_up:
        return "it was saved after cleanup(), which releases the model and so its parameters' .grad"
    if not with_tensors:
        return "it was saved with activations=False, which writes no tensors"
    return None


def _add(tensors: dict, record: dict, owner, key: str, grad, column: str) -> None:
    """Write ``grad`` under ``key``, or name in ``not_saved`` why it cannot be (a sparse ``.grad``, a batched
    backward's gradient)."""
    why = f"not saved: {FROM_BATCHED_BACKWARD}" if unreadable(grad) else unsavable(grad)
    if why is None:
        tensors[key] = grad  # streamed by write_tensors, never copied whole
        record[column].append([owner, key])
    else:
        record["not_saved"].append([owner, f"its gradient was not saved ({why.removeprefix('not saved: ')})"])


def read_grads(trace, record, folder: str, files) -> None:
    """Give a loaded ``trace`` the gradients its folder holds (nothing when it was traced without them)."""
    with reading_record(folder, "grads"):
        _read_grads(trace, record, folder, files)


def _read_grads(trace, record, folder: str, files) -> None:
    grads = record.get("grads")
    if grads is None:
        return
    from ..capture.grads import GradCapture
    from ..capture.packing import PackLog

    n = len(trace.kinds)
    if not isinstance(grads, dict):
        raise TraceFileError(f"{TRACE_JSON}: 'grads' must be a table")
    packed = grads["saved_for_backward"] if "saved_for_backward" in grads else _packing_of_first_layout(grads)
    if packed is not None:
        trace._packlog = PackLog(None)
        trace._packlog.note_text = None if packed["note"] is None else str(packed["note"])
        trace._packlog.packed = {int(c): {int(k): int(b) for k, b in sizes} for c, sizes in packed["packed"]}
    if "selected" not in grads:  # saved_for_backward without gradients
        return
    stats = {check_index(i, 0, n, "grads"): {_stat_name(k): _unfloat(v) for k, v in s.items()}
             for i, s in grads["stats"]}
    tensors = {}
    if GRAD_TENSORS in files:
        tensors = laid_out(read_tensor_file(folder, GRAD_TENSORS), grads.get("strides"), "grads: 'strides'")
    capture = GradCapture()
    capture.selected = {check_index(i, 0, n, "grads") for i in grads["selected"]}
    capture.backwards = int(grads["num_backwards"])
    capture.order = [check_index(i, 0, n, "grads") for i in grads["order"]]
    for i, key in grads["tensors"]:
        g = tensors.get(key)
        meta = trace.op_meta[check_index(i, 0, n, "grads")]
        if g is None or tuple(g.shape) != tuple(meta.shape) or g.dtype != meta.dtype:
            raise TraceFileError(f"{folder}/{GRAD_TENSORS}: gradient {key!r} is missing or does not match op #{i}")
        capture.grads[i] = g
    trace._gradcap = capture
    trace._unsaved_grads = {(check_index(owner, 0, n, "grads") if isinstance(owner, int) else str(owner)): str(why)
                            for owner, why in grads.get("not_saved", ())}  # absent in files written before it
    missing = grads.get("param_grads", None if GRAD_TENSORS in files or grads["param_tensors"] else
                        "it was saved without gradient tensors")  # files written before the field existed
    if missing is None:
        trace._param_grads = _param_grads_read(trace, grads["param_tensors"], tensors)
    else:
        trace._param_grads_missing = str(missing)
        _name_grads_without_tensors(trace, capture, str(missing))
    if stats:  # taken of every gradient as it was saved, also of those no file holds (complex128, after cleanup())
        trace._grad_stats = stats


def _packing_of_first_layout(grads: dict) -> dict:
    """What autograd packed for backward, as the first files to hold gradients kept it: beside the gradients
    (``pack_note``, ``packed``), which always accounted it, where later files keep it under ``saved_for_backward``
    (absent without ``saved_for_backward=True``) with the same content."""
    return {"note": grads["pack_note"], "packed": grads["packed"]}


def _param_grads_read(trace, rows, tensors: dict) -> dict:
    """``address -> .grad`` of the saved parameter gradients, each in the file and, where the ``params`` table
    lists its parameter, of that parameter's shape and dtype (as autograd and ``p.grad = ...`` require): a
    gradient named but missing read as None, "no gradient", and one of another parameter as that one's."""
    expected = {p.address: (tuple(p.shape), p.dtype) for p in trace.params} if trace._params_listed else None
    saved = {}
    for address, key in rows:
        g = tensors.get(key)
        if not isinstance(address, str) or g is None:
            raise TraceFileError(f"{GRAD_TENSORS}: the gradient {key!r} of parameter {address!r} is missing")
        if expected is not None and expected.get(address) != (tuple(g.shape), g.dtype):
            raise TraceFileError(f"{GRAD_TENSORS}: gradient {key!r} is {tuple(g.shape)} {g.dtype}, which does not "
                                 f"match parameter {address!r} ({expected.get(address, 'not in the params table')})")
        saved[address] = g
    return saved


def _name_grads_without_tensors(trace, capture, why: str) -> None:
    """Ops a backward reached whose gradient the folder holds no tensor for (saved with activations=False):
    reading one raises saying so, where None would claim that no backward reached it."""
    for i in capture.order:
        if i not in capture.grads:
            trace._unsaved_grads.setdefault(i, f"its gradient was not saved (the trace {why.removeprefix('it ')}); "
                                               "its norm, min, max and non-finite count are in to_pandas()")


def _stat_name(k) -> str:
    from ..record.grads import GRAD_COLUMNS

    if k not in GRAD_COLUMNS:
        raise TraceFileError(f"{TRACE_JSON}: grads: {k!r} is not a gradient statistic")
    return k
