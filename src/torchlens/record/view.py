"""``View``: what every record a trace hands out is, a (trace, index) pair made when it is read.

The trace holds its records as columns and rows of plain data and keeps no view, so a trace forms no
reference cycle and is freed as soon as nothing refers to it or to one of its records.  Two views are
equal when they address the same record of the same trace.
"""

from __future__ import annotations


class View:
    """One record of one trace: record ``index`` of its kind."""

    __slots__ = ("_trace", "index")

    def __init__(self, trace, index: int):
        self._trace = trace
        self.index = index

    def __eq__(self, other):
        return type(other) is type(self) and other._trace is self._trace and other.index == self.index

    def __hash__(self):
        return hash((id(self._trace), type(self).__name__, self.index))
