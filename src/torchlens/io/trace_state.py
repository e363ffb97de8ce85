"""Trace-level facts a saved trace keeps beside its columns, so that a loaded trace prints what the live
one printed: where ``stop_after=`` stopped the forward, the caveats, the root module's class, the module
attributes read from outside the trace, whether repeated layers came from a loop or a reused module,
which output nodes show a tensor of their own, the input slots that named a tensor an earlier slot named, and the
running statistics a kernel left non-finite (``nonfinite_origin`` names the op that wrote them) and the ops
whose kernels wrote statistics from outside the trace (which it says it could not examine).

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
        # running statistics a kernel left non-finite (nonfinite_origin): [op, address, nan, inf, earlier ops]
        "stats_left_nonfinite": [[op, address, nan, inf, list(earlier)]
                                 for op, stats in trace._stats_left_nonfinite.items()
                                 for address, (nan, inf), earlier in stats],
        # ops whose kernels wrote running statistics from outside the trace (nonfinite_origin: unexamined)
        "stats_untracked": list(trace._stats_untracked),
        # calls that read torch.vmap's batched tensors: with their readers, ops of one example's shape
        "per_example_calls": sorted(trace._per_example_calls),
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
    stats = _stats(trace, record)
    if stats:
        trace._stats_left_nonfinite = stats
    trace._per_example_calls = frozenset(_indices(record, "per_example_calls", len(trace.calls), "calls"))
    untracked = _indices(record, "stats_untracked", len(trace._kind), "ops")
    if untracked:
        trace._stats_untracked = untracked
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


def _indices(record: dict, key: str, count: int, of: str) -> tuple:
    """The list of indices saved under ``key``, each below ``count`` (of ops, or of calls: ``of``)."""
    value = record.get(key, [])  # absent in files of older versions
    if not isinstance(value, list) or not all(type(i) is int and 0 <= i < count for i in value):
        raise TraceFileError(f"{TRACE_JSON}: {key!r} must list {of} by index")
    return tuple(value)


def _input_aliases(trace, record: dict) -> dict:
    value = record.get("input_aliases", {})
    kinds = trace._kind
    if not isinstance(value, dict) or not all(isinstance(k, str) and type(i) is int and 0 <= i < len(kinds)
                                              and kinds[i] == Kind.INPUT for k, i in value.items()):
        raise TraceFileError(f"{TRACE_JSON}: 'input_aliases' must map input slots to input nodes by index")
    return value


def _stats(trace, record: dict) -> dict:
    """``write_trace_state``'s ``stats_left_nonfinite`` as capture made it: op -> ((address, flags, earlier), ...)."""
    value, found = record.get("stats_left_nonfinite", []), {}
    ops = range(len(trace._kind))
    for entry in value if isinstance(value, list) else [None]:
        if not (isinstance(entry, list) and len(entry) == 5 and type(entry[0]) is int and entry[0] in ops
                and isinstance(entry[1], str) and all(type(f) is bool for f in entry[2:4])
                and isinstance(entry[4], list) and all(type(e) is int and e in ops for e in entry[4])):
            raise TraceFileError(f"{TRACE_JSON}: 'stats_left_nonfinite' must list [op, buffer address, has_nan, "
                                 "has_inf, [earlier ops]] entries")
        found.setdefault(entry[0], []).append((entry[1], (entry[2], entry[3]), tuple(entry[4])))
    return {op: tuple(stats) for op, stats in found.items()}
