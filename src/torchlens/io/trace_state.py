"""Trace-level facts a saved trace keeps beside its columns, so that a loaded trace prints what the live
one printed: where ``stop_after=`` stopped the forward, the caveats, the root module's class, the module
attributes read from outside the trace, whether repeated layers came from a loop or a reused module,
which output nodes show a tensor of their own, and the input slots that named a tensor an earlier slot named.

Each is one optional key of ``trace.json``: a file written before the key existed loads as it always did
(nothing stopped, no caveats, the class shown as the model's name, repetition told apart from the ops'
own lines), so the schema version is unchanged.
"""

from __future__ import annotations

from ..record.columns import Kind
from .format import TRACE_JSON, TraceFileError

_REPETITIONS = ("loop", "reused")


def write_trace_state(trace) -> dict:
    """The keys this module adds to ``trace.json``."""
    from ..labels.passes import repetition

    return {
        "stopped_after": trace.stopped_after,
        "caveats": list(trace.caveats),
        "root_class": trace._root_class,
        "rootless": trace._rootless,  # a callable traced without root=: no model whose parameters to count
        "outside_attributes": list(trace._outside_attributes),
        "repetition": repetition(trace),  # the live verdict: a loaded trace lacks the module call frames
        "own_outputs": sorted(trace._own_outputs),  # output nodes with their own tensor and gradient
        "input_aliases": trace._input_aliases,  # slots naming a tensor an earlier slot named
    }


def read_trace_state(trace, record: dict) -> None:
    """Set on ``trace`` what ``write_trace_state`` saved; a key that is absent leaves the class default."""
    stopped_after = _optional_string(record, "stopped_after")
    if stopped_after is not None:
        trace.stopped_after = stopped_after
    caveats = _strings(record, "caveats")
    if caveats:
        trace.caveats = caveats
    root_class = _optional_string(record, "root_class")
    if root_class is not None:
        trace._root_class = root_class
    rootless = record.get("rootless", False)  # absent in files of older versions
    if not isinstance(rootless, bool):
        raise TraceFileError(f"{TRACE_JSON}: 'rootless' must be true or false, not {rootless!r}")
    trace._rootless = rootless
    outside = _strings(record, "outside_attributes")
    if outside:
        trace._outside_attributes = outside
    own = _output_nodes(trace, record, "own_outputs")
    if own:
        trace._own_outputs = own
    aliases = _input_aliases(trace, record)
    if aliases:
        trace._input_aliases = aliases
    verdict = _optional_string(record, "repetition")
    if verdict is not None:
        if verdict not in _REPETITIONS:
            raise TraceFileError(f"{TRACE_JSON}: 'repetition' must be one of {_REPETITIONS} or null, not {verdict!r}")
        trace._saved_repetition = verdict


def _optional_string(record: dict, key: str):
    value = record.get(key)
    if value is not None and not isinstance(value, str):
        raise TraceFileError(f"{TRACE_JSON}: {key!r} must be a string or null")
    return value


def _strings(record: dict, key: str) -> tuple:
    value = record.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TraceFileError(f"{TRACE_JSON}: {key!r} must be a list of strings")
    return tuple(value)


def _output_nodes(trace, record: dict, key: str) -> frozenset:
    value = record.get(key, [])
    kinds = trace._kind
    if not isinstance(value, list) or not all(type(i) is int and 0 <= i < len(kinds) and kinds[i] == Kind.OUTPUT
                                              for i in value):
        raise TraceFileError(f"{TRACE_JSON}: {key!r} must list output nodes by index")
    return frozenset(value)


def _input_aliases(trace, record: dict) -> dict:
    value = record.get("input_aliases", {})
    kinds = trace._kind
    if not isinstance(value, dict) or not all(isinstance(k, str) and type(i) is int and 0 <= i < len(kinds)
                                              and kinds[i] == Kind.INPUT for k, i in value.items()):
        raise TraceFileError(f"{TRACE_JSON}: 'input_aliases' must map input slots to input nodes by index")
    return value
