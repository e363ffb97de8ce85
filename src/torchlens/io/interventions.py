"""Interventions in a saved trace: which ops an intervention changed, and the values they made.

``op.intervention`` and ``op.original`` of a loaded trace answer as they did live, so that a loaded
intervened trace never passes for a plain one.  The site and the action are written as their
descriptions (an action or a predicate is code, and a saved trace holds no code): a loaded
``op.intervention.action`` is a ``SavedAction`` whose ``repr`` is the live action's.  The original
values go to ``originals.safetensors``, under the same manifest rules as the activations, when
activations are written.
"""

from __future__ import annotations

import os

from .encode import WITHOUT_ACTIVATIONS, unsavable
from .format import TRACE_JSON, TraceFileError, check_index, check_string, reading_record
from .tensorfile import laid_out, layouts_of, read_tensor_file, write_tensors

ORIGINAL_TENSORS = "originals.safetensors"


class SavedAction:
    """An action as a loaded trace knows it: its description (it cannot be run again)."""

    __slots__ = ("description",)

    def __init__(self, description: str):
        self.description = description

    def __repr__(self) -> str:
        return self.description


def _site_text(site):
    if isinstance(site, tuple):
        return [_site_text(s) for s in site]
    return site if isinstance(site, str) else "<predicate>"


def _action_text(action):
    if isinstance(action, tuple):
        return [_action_text(a) for a in action]
    return repr(action)


def write_interventions(trace, folder: str, with_tensors: bool):
    """``(file names, record)`` for ``trace.json``'s ``interventions``; (``[]``, None) without any."""
    applied = trace._interventions
    if not applied:
        return [], None
    record = {"applied": [[int(i), _site_text(a.site), _action_text(a.action)] for i, a in sorted(applied.items())],
              "originals": []}
    tensors, unsaved = {}, []
    for i, t in ([] if trace.is_cleaned_up else sorted(trace._originals.items())):
        why = unsavable(t) if with_tensors else WITHOUT_ACTIVATIONS
        if why is None:
            tensors[f"o{i}"] = t  # streamed by write_tensors, never copied whole
            record["originals"].append([int(i), f"o{i}"])
        else:  # an original no file can hold (sparse, complex128) is left out, as activations are, saying why
            unsaved.append([int(i), why])
    if unsaved:
        record["originals_unsaved"] = unsaved
    if not tensors:
        return [], record
    write_tensors(os.path.join(folder, ORIGINAL_TENSORS), tensors, metadata={"format": "torchlens-originals"})
    record["strides"] = layouts_of(tensors)  # a channels_last original loads laid out as it was, as activations do
    return [ORIGINAL_TENSORS], record


def read_interventions(trace, record, folder: str, files) -> None:
    """Give a loaded trace its ``op.intervention`` and ``op.original`` (nothing for a plain trace)."""
    saved = record.get("interventions")
    if saved is None:
        return
    with reading_record(folder, "interventions"):
        _read(trace, saved, folder, files)


def _read(trace, saved, folder: str, files) -> None:
    from ..intervene.runtime import Applied

    n = len(trace.kinds)
    applied = {}
    for i, site, action in saved["applied"]:
        i = check_index(i, 0, n, "interventions")
        applied[i] = Applied(_from_text(site, str), _from_text(action, SavedAction), trace.labels[i])
    originals = {}
    if saved["originals"]:
        if ORIGINAL_TENSORS not in files:
            raise TraceFileError(f"{ORIGINAL_TENSORS}: named in {TRACE_JSON} but not in the manifest")
        tensors = laid_out(read_tensor_file(folder, ORIGINAL_TENSORS), saved.get("strides"),
                           "interventions: 'strides'")  # absent in files written before it
        for i, key in saved["originals"]:
            i = check_index(i, 0, n, "interventions")
            t, meta = tensors.get(key), trace.op_meta[i]
            if t is None or tuple(t.shape) != tuple(meta.shape) or t.dtype != meta.dtype:
                raise TraceFileError(f"{ORIGINAL_TENSORS}: original {key!r} is missing or does not match op #{i}")
            originals[i] = t
    trace._interventions = applied
    trace._originals = originals
    trace._originals_unsaved = {check_index(i, 0, n, "interventions"): str(why)
                                for i, why in saved.get("originals_unsaved", ())}


def _from_text(value, make):
    if isinstance(value, list):
        return tuple(make(check_string(v, "interventions")) for v in value)
    return make(check_string(value, "interventions"))
