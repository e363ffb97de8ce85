"""``max_saved_bytes``: the bytes a trace's saved activations hold, counted as ``log.saved_bytes`` counts them.

Each saved tensor counts once at its own size (``record.layouts.held_bytes``), however many records hold it:
an op that returns its argument itself (dropout in eval mode, ``x.contiguous()`` on a contiguous ``x``) saves
the tensor its parent saved, or, when it requires grad, another ``detach()`` of it over the same elements
(``record.layouts.alias_key``), which holds no more memory.  A key counts while a weak reference says one of
the objects counted under it is alive, so a freed tensor's id or memory reused by another is counted anew.
"""

from __future__ import annotations

from weakref import ref as weakref

from ..record.layouts import alias_key, held_bytes


class SaveBudget:
    """The bytes counted so far against a limit, and which tensor objects they are."""

    __slots__ = ("limit", "used", "_held")

    def __init__(self, limit):
        self.limit = limit
        self.used = 0
        self._held: dict = {}  # alias_key(tensor) -> [weak references to the objects counted, records saving them]

    def _entry(self, t):
        entry = self._held.get(alias_key(t))
        return entry if entry is not None and any(alive() is not None for alive in entry[0]) else None

    def admit(self, t) -> bool:
        """Count ``t`` for one more record; False, counting nothing, when its bytes would pass the limit."""
        entry = self._entry(t)
        if entry is not None:  # saved already for another record: no more memory
            _hold(entry, t)
            return True
        size = held_bytes(t)
        if self.used + size > self.limit:
            return False
        self.used += size
        self._held[alias_key(t)] = [[weakref(t)], 1]
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
            _hold(shared, new)
            return
        self._held[alias_key(new)] = [[weakref(new)], 1]
        self.used += held_bytes(new)

    def _uncount(self, t) -> bool:
        """One record fewer holds ``t``; whether that was the last (``t`` is no longer counted)."""
        entry = self._entry(t)
        if entry is None:
            return False
        entry[1] -= 1
        if entry[1]:
            return False
        del self._held[alias_key(t)]
        return True


def _hold(entry, t) -> None:
    """One more record saves ``t``, counted under ``entry`` already (itself, or another object over its elements):
    the entry stays alive while any of them is."""
    entry[1] += 1
    if all(alive() is not t for alive in entry[0]):
        entry[0].append(weakref(t))
