"""``View``: what every record a trace hands out is, a (trace, index) pair made when it is read;
``RecordList``: the records of one kind, made as they are read.

The trace holds its records as columns and rows of plain data and keeps no view, so a trace forms no
reference cycle and is freed as soon as nothing refers to it or to one of its records.  Two views are
equal when they address the same record of the same trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter


class OfATrace:
    """What every record a trace hands out is: read through its trace, so never pickled nor deep-copied
    apart from it (pickling it would pickle the trace, and refuse in the trace's words, not the record's).
    A shallow copy is the record itself: it addresses the same record of the same trace."""

    __slots__ = ()

    def __reduce_ex__(self, protocol):
        raise TypeError(_not_kept_apart(self, "pickled"))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        raise TypeError(_not_kept_apart(self, "deep-copied"))


def _not_kept_apart(record, how: str) -> str:
    name = type(record).__name__
    return (f"a{'n' if name[0] in 'AEIOU' else ''} {name} cannot be {how}: it is part of a Trace, read through it, "
            "and a trace holds the model and torch's callables. Keep the trace with log.save(path) and read it "
            "back, as a separate trace, with tl.load(path) (one tensor alone: torch.save(op.activation, path))")


class View(OfATrace):
    """One record of one trace: record ``index`` of its kind."""

    __slots__ = ("_trace", "index")

    def __init__(self, trace, index: int):
        self._trace = trace
        self.index = index

    def __eq__(self, other):
        return type(other) is type(self) and other._trace is self._trace and other.index == self.index

    def __hash__(self):
        return hash((id(self._trace), type(self).__name__, self.index))


def row_field(name: str, doc: str = "") -> property:
    """A view's attribute that is its row's ``name`` as held (``address = row_field("address")``): read
    through the view's ``_row`` at each access, like the view's other fields.  ``doc`` is what ``help()``
    shows for it (without one, a property shows the getter's own: ``operator.attrgetter``'s)."""
    return property(attrgetter(f"_row.{name}"), doc=doc)


_SHOWN = 12  # the most records ``repr`` of a RecordList lists


class RecordList(OfATrace, Sequence):
    """The records of one kind (ops, layers, module calls, modules, parameters, buffers) as a sequence
    that also converts to a DataFrame.  Each item is a view made when it is read, ``view(trace, key)``
    for one of ``keys``: a slice gives a list of them."""

    __slots__ = ("_trace", "_view", "_keys", "_to_frame")

    def __init__(self, trace, view, keys, to_frame):
        self._trace = trace
        self._view = view
        self._keys = keys
        self._to_frame = to_frame

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, i):
        if isinstance(i, slice):
            trace, view = self._trace, self._view
            return [view(trace, k) for k in self._keys[i]]
        if isinstance(i, str):  # a name: the list would answer with the error of its internal key list
            from .lookup import find_by_address  # (lookup reads the views: imported where a name is refused)

            name = self._view.__name__
            by_address = name in ("Param", "Buffer") and \
                any(self._view(self._trace, k).address == i for k in self._keys)
            instead = find_by_address(name, i) if by_address else \
                f"log[{i!r}] finds an op, layer, module call or module by its label or address"
            raise TypeError(f"the {name} records of a trace are a list, indexed by position (an int or a slice), "
                            f"not by name: {instead}")
        if i.__class__ is bool:  # an int to Python, but never meant as record 0 or record 1 (as log[True] is refused)
            raise TypeError(f"index the {self._view.__name__} records with an int or a slice, not a bool ({i!r})")
        try:
            key = self._keys[i]
        except IndexError:
            raise IndexError(f"{self._view.__name__} index {i} is out of range: this trace has {len(self)} "
                             f"{self._view.__name__} records") from None
        except TypeError:  # the key list's own message names a list or a range, not these records
            raise TypeError(f"index the {self._view.__name__} records with an int or a slice, not "
                            f"{type(i).__name__}") from None
        return self._view(self._trace, key)

    def __iter__(self):
        trace, view = self._trace, self._view
        return (view(trace, k) for k in self._keys)

    def __eq__(self, other):
        if isinstance(other, (RecordList, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # like a list

    def __repr__(self) -> str:
        """The records as a list shows them, up to ``_SHOWN``: a real model's thousands of ops would print a page
        each, so a longer list shows its first and last few records and counts those left out."""
        if len(self) <= _SHOWN:
            return repr(list(self))
        head, tail = self[:_SHOWN - 2], self[-2:]
        left_out = f"... {len(self) - _SHOWN} more {self._view.__name__} records (of {len(self)}) ..."
        return f"[{', '.join(map(repr, head))}, {left_out}, {', '.join(map(repr, tail))}]"

    def to_pandas(self):
        return self._to_frame(self)
