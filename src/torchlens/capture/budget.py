"""``max_saved_bytes``: the bytes a trace's saved activations hold, counted as ``log.saved_bytes`` counts them.

Each saved tensor object counts once at its own size (``record.layouts.held_bytes``), however many records
hold it: an op that returns its argument itself (dropout in eval mode, ``x.contiguous()`` on a contiguous
``x``) saves the tensor its parent saved, which holds no more memory.  A tensor is known by ``id`` while a
weak reference says it is still the same object, so a freed tensor's id reused by another is counted anew.
"""

from __future__ import annotations

from weakref import ref as weakref

from ..record.layouts import held_bytes


class SaveBudget:
    """The bytes counted so far against a limit, and which tensor objects they are."""

    __slots__ = ("limit", "used", "_held")

    def __init__(self, limit):
        self.limit = limit
        self.used = 0
        self._held: dict = {}  # id(tensor) -> [weak reference, records saving it]

    def _entry(self, t):
        entry = self._held.get(id(t))
        return entry if entry is not None and entry[0]() is t else None

    def admit(self, t) -> bool:
        """Count ``t`` for one more record; False, counting nothing, when its bytes would pass the limit."""
        entry = self._entry(t)
        if entry is not None:  # saved already for another record: no more memory
            entry[1] += 1
            return True
        size = held_bytes(t)
        if self.used + size > self.limit:
            return False
        self.used += size
        self._held[id(t)] = [weakref(t), 1]
        return True

    def release(self, t) -> None:
        """One record lets go of ``t``: its bytes leave the count with the last record holding it."""
        if self._uncount(t):
            self.used -= held_bytes(t)

    def replaced(self, old, new) -> None:
        """One record's saved ``old`` became ``new``, a copy (copy-on-write before a write): the record counts for
        the copy, once however many records share it, and ``old`` saved again later (the write's own record)
        counts anew.  A copy is made to keep the trace faithful, so it is counted even past the limit: what is
        saved after it is refused then."""
        if self._entry(old) is None:
            return
        self.release(old)
        shared = self._entry(new)
        if shared is not None:
            shared[1] += 1
            return
        self._held[id(new)] = [weakref(new), 1]
        self.used += held_bytes(new)

    def _uncount(self, t) -> bool:
        """One record fewer holds ``t``; whether that was the last (``t`` is no longer counted)."""
        entry = self._entry(t)
        if entry is None:
            return False
        entry[1] -= 1
        if entry[1]:
            return False
        del self._held[id(t)]
        return True
