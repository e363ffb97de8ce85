"""Columns of a ``Trace`` derived on first read, a group at a time, from the raw lists of the capture.

``record.finalize`` reads at the end of a trace only what could change afterwards and hands the rest to
the ``Trace`` as a ``RawRecord``; each column declared ``Derived(group)`` on the ``Trace`` class builds
its whole group the first time any of them is read, and the values then sit on the trace as plain
attributes.  A trace read by ``tl.load`` is given every column and never reaches here.
"""

from __future__ import annotations

import gc
import os
import threading

_DERIVING = threading.RLock()  # reentrant: the labels read the columns they are derived from
_paused_collector = False  # whether a derive running now turned the collector off (read after a fork)


class Derived:
    """One derived column: on first read, its group is derived (``derive``) and the column returned.

    An instance attribute shadows a descriptor that defines only ``__get__``, so once derived every read
    costs what any attribute read costs."""

    __slots__ = ("group", "name")

    def __init__(self, group: str):
        self.group = group

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, trace, owner=None):
        if trace is None:
            return self
        derive(trace, self.group, self.name)
        return trace.__dict__[self.name]


def derive(trace, group: str, name: str) -> None:
    """Set the columns of ``group`` (``name`` among them) on ``trace`` from its raw lists, once even when
    several threads read it first, with the collector paused as during the trace: building them
    allocates many small objects, which no collector pass need walk."""
    global _paused_collector
    with _DERIVING:
        held = vars(trace)
        if name in held:
            return  # another thread derived it meanwhile
        raw = trace._raw
        if raw is None:
            raise AttributeError(f"this trace holds no raw record to derive {name} from")
        collecting = gc.isenabled()
        gc.disable()
        if collecting:  # (a derive inside a derive finds it off already)
            _paused_collector = True
        try:
            held.update(getattr(raw, group)(trace))
            if "_kind" in held and "_call_rows" in held and "_labels" in held and "_param_addresses" in held:
                trace._raw = None  # every group derived: the raw lists are no longer needed
        finally:
            if collecting:
                _paused_collector = False
                gc.enable()


def _after_fork_in_child() -> None:
    """A process forked while another thread derived: that thread is not in the child, which gets a new lock
    (the copied one is held for ever) and the collector back on if that derive turned it off."""
    global _DERIVING, _paused_collector
    _DERIVING = threading.RLock()
    if _paused_collector:
        _paused_collector = False
        gc.enable()


if hasattr(os, "register_at_fork"):  # (not on Windows, which has no os.fork)
    os.register_at_fork(after_in_child=_after_fork_in_child)
