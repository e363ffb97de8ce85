"""A process forked while a trace runs: the child holds a copy of that trace, which it can neither finish
nor should record into.

``os.fork`` copies the forking thread alone, with its thread-local state: the capture mode on torch's
function-mode stack, its "tracing" mark and the collector paused for the trace.  A worker forked inside
a traced forward (``torch.multiprocessing`` or a ``DataLoader`` with the fork start method, a
``ProcessPoolExecutor``) would then record all its own work into that copy, holding every activation,
apply the trace's interventions to its own calls of the intervened modules, refuse its own ``tl.trace``
as nested, and run with the collector off.

Traces other threads were running are copied too, their threads not: what they put in place process-wide
(``_call_impl``'s recorders, module hooks, ``Function.apply``) answers by thread id, and a thread the child
starts may get the id of one of those threads, and then be recorded into that trace and have its
interventions applied to what it computes.

``leave_copied_trace`` runs in every child after a fork (registered once, at import): when no trace runs
it checks two dicts, sets one thread-local and returns.  Otherwise it gives the locks of capture's
process-wide state new ones (a thread holding one is gone) and tears every copied trace's capture
down in the child, as the end of its forward would, so ops and module calls run untraced and a trace of
the child's own works, and marks each, so that a forward going on in the child after ``os.fork`` returns
there ends in an error rather than a trace missing every op after the fork.
"""

from __future__ import annotations

import gc
import os
import threading

from ..errors import TorchlensError
from . import call_impl, compiled, fastpath, function_outputs
from .teardown import running_captures


def leave_copied_trace(thread_mark, collector_was_on: dict) -> None:
    """In a forked child: tear down the capture of every trace the parent's threads were running.
    ``thread_mark`` is the thread-local ``tl.trace`` marks a tracing thread on (``active``);
    ``collector_was_on``: each tracing thread's id -> whether the collector ran when its trace began."""
    captures = running_captures()
    if captures or collector_was_on:
        _unlock_capture()
    if captures:
        forking = threading.get_ident()
        for thread, capture in list(captures.items()):
            capture.forked_into = os.getpid()
            if thread == forking:
                capture.tear_down()
            else:
                capture.abandon()
    thread_mark.active = False
    if collector_was_on:  # the collector is paused for the parent's traces, which this process will not finish
        if any(collector_was_on.values()):  # (the first trace to begin saw it as the user left it)
            gc.enable()
        collector_was_on.clear()


def _unlock_capture() -> None:
    """New locks for what traces set up process-wide: a parent's thread that held one as the process forked
    (a trace beginning or ending) is not in the child, and would hold it there for ever."""
    call_impl._lock = threading.RLock()
    fastpath._lock = threading.RLock()
    compiled._lock = threading.RLock()
    function_outputs._receivers_lock = threading.RLock()


def refuse_forked_trace(capture) -> None:
    """After the forward: a trace whose process forked inside it, and which goes on in the child, ends here
    (the driver asks only when ``capture.forked_into`` is set: in the child, never in the parent)."""
    if capture.forked_into is not None:
        raise TorchlensError(f"this process (pid {capture.forked_into}) was forked inside a traced forward, and "
                             "the trace went on in it: its ops after the fork were not recorded, so it returns "
                             "no trace. Trace in the parent process, or start a trace of its own in the child")
