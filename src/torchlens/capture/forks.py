"""A process forked while its forking thread traces: the child holds a copy of that trace, which it can
neither finish nor should record into.

``os.fork`` copies the forking thread alone, with its thread-local state: the capture mode on torch's
function-mode stack, the thread's module-call recorders and module hooks, its "tracing" mark and the
collector paused for the trace.  A worker forked inside a traced forward (``torch.multiprocessing`` or a
``DataLoader`` with the fork start method, a ``ProcessPoolExecutor``) would then record all its own work
into that copy, holding every activation, apply the trace's interventions to its own calls of the
intervened modules, refuse its own ``tl.trace`` as nested, and run with the collector off.

``leave_copied_trace`` runs in every child after a fork (registered once, at import): when the forking
thread was not tracing it reads two thread-locals and returns.  Otherwise it tears the copied trace's
capture down in the child, as the end of the forward would, so ops and module calls run untraced and a
trace of the child's own works, and marks it, so that a forward going on in the child after ``os.fork``
returns there ends in an error rather than a trace missing every op after the fork.  What other threads'
traces left installed (``_call_impl``, the fast-path shim) answers per thread: the child's calls reach
torch's own code through it.
"""

from __future__ import annotations

import gc
import os

from ..errors import TorchlensError
from .teardown import running_capture


def leave_copied_trace(thread_mark) -> None:
    """In a forked child: tear down the capture of the trace the forking thread was running, if any.
    ``thread_mark`` is the thread-local ``tl.trace`` marks a tracing thread on (``active``, ``collecting``)."""
    capture = running_capture()
    if capture is not None:
        capture.forked_into = os.getpid()
        capture.tear_down()
    if getattr(thread_mark, "active", False):
        thread_mark.active = False
        if getattr(thread_mark, "collecting", False):
            gc.enable()  # paused for the parent's trace, which this process will not finish


def refuse_forked_trace(capture) -> None:
    """After the forward: a trace whose process forked inside it, and which goes on in the child, ends here."""
    if capture.forked_into is not None:  # set in the child only: the parent's own trace never has it
        raise TorchlensError(f"this process (pid {capture.forked_into}) was forked inside a traced forward, and "
                             "the trace went on in it: its ops after the fork were not recorded, so it returns "
                             "no trace. Trace in the parent process, or start a trace of its own in the child")
