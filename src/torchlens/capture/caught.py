"""Exceptions the traced forward caught: the module calls they left, and the exceptions themselves let go.

A module call an exception leaves returned nothing, which its record must say: ``record_call`` (both capture
paths) marks it with outputs of None, where a call that returned None has outputs of ``()``.  Once the forward
is over, the driver asks ``forget_caught_exceptions`` for the calls so marked; the trace names them in a caveat,
else they would read as calls that returned nothing on purpose (a model trying one module and falling back on
another when it raises).
"""

from __future__ import annotations

from ..record.columns import MODULE_CALL_OUTPUTS, MODULE_CALL_PARENT
from ..record.modules import enclosing_calls


def forget_caught_exceptions(state, stop=None) -> tuple:
    """The indices of the module calls an exception left, each given outputs of ``()``, with the exceptions
    ``state`` holds dropped.

    ``stop`` is the exception of a ``stop_after=`` stop, if one ended the forward: the calls it left (the
    innermost, which ``state.raised_in`` names, and every call around it) stopped, they did not fail.  The
    exceptions (``state.failure``, ``state.raised_in``) go whatever happened: each one's traceback holds the
    forward's frames, and those frames hold ``state``, a cycle that would keep every saved activation alive
    after the trace is dropped, until the cycle collector runs."""
    calls, raised_in = state.module_calls, state.raised_in
    state.failure = state.raised_in = None
    if raised_in is None:  # no exception ever left a module call
        return ()
    if stop is not None and raised_in[0] is stop:
        for k in enclosing_calls(raised_in[1], lambda k: calls[k][MODULE_CALL_PARENT]):
            if calls[k][MODULE_CALL_OUTPUTS] is None:  # (a stop at a module site recorded what it returned)
                calls[k][MODULE_CALL_OUTPUTS] = ()
    caught = tuple(k for k, call in enumerate(calls) if call[MODULE_CALL_OUTPUTS] is None)
    for k in caught:
        calls[k][MODULE_CALL_OUTPUTS] = ()
    return caught


def caught_calls_caveat(trace, caught: tuple) -> tuple:
    """The caveat naming the module calls an exception left (``forget_caught_exceptions``), if any."""
    if not caught:
        return ()
    labels = ", ".join(trace.module_calls[k].label for k in caught)
    return (f"module calls left by an exception that the forward caught ({labels}) returned nothing: they list no "
            "outputs, and the ops they ran before it are in the trace",)
