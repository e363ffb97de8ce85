"""Writes a tensor's version counter does not show, and how capture still finds them.

A write through ``x.data`` moves the version counter of ``x.data`` alone, not that of ``x`` nor of the
views sharing its memory, and so does one through ``torch.from_dlpack(x)`` or ``torch.from_numpy(x.numpy())``,
a tensor of its own on ``x``'s bytes; ``torch.distributed``'s in-place collectives move none.  Each is noted in
``CaptureState.writers`` and the tensors it reached are made stale (``STALE_VERSION``), so that their next
read asks ``writers`` who wrote them last, as after a write through a view (``CaptureState.producer_of``).
``u.set_(y)`` is the converse: it moves ``u``'s counter and writes nothing, putting ``u`` on ``y``'s bytes, so
a read of ``u`` whose counter moved with no write seen looks for the bound tensor whose bytes it now holds
(``repointed_onto``).
The functions taking ``self`` are methods of ``CaptureState``.
"""

from __future__ import annotations

from weakref import ref as weakref

import torch

from ..record.layouts import memory_span, spans_meet, storage_holders, storage_key, version_of
from .bindings import bound_tensor, is_bound

# A ``producers`` entry's version that no tensor has: the tensor was written without its version counter
# moving (a collective through a view of it), so a read asks ``writers`` who wrote it last.
STALE_VERSION = -1
# What ``CaptureState._last_writer_of`` answers when capture saw no write moving a tensor's counter to its
# version (``t.set_(y)`` moves it and writes nothing; code out of capture's sight writes unseen).
UNSEEN = -2
# What holds a tensor's memory at a write through ``x.data`` when nothing else does: ``x``, ``x.data``, and
# the storage object the count is read through.
_DATA_WRITE_HOLDERS = 3


def note_data_write(self, t: torch.Tensor, base: torch.Tensor, index: int, key: int) -> None:
    """Record ``index`` wrote ``t``, which shares bytes with ``base`` but not its version counter (``t`` is
    ``base.data``, or a tensor on bytes ``base`` handed out: ``note_export``), so the write moved neither
    ``base``'s counter nor that of the views sharing it, though it changed their bytes.  ``base`` is bound to
    the write when ``t`` is all of it; the other bound tensors on those bytes (``base`` when ``t`` is a part
    of it) are made stale, and the write is noted at their version, so that their next read asks ``writers``
    who wrote them last (``producer_of``), as after a write through a view.  ``key`` is ``t``'s storage key.
    Such writes are rare in a forward: finding those tensors is one pass over the bound ones, skipped when
    no other tensor holds the memory."""
    version = version_of(base)
    span = _span_in(t, base)
    if span is not None and span == memory_span(base):
        self.producers[id(base)] = (weakref(base), index, version)
        if storage_holders(base) <= (_DATA_WRITE_HOLDERS if _same_storage(t, base) else 2):
            return
    if version is None:
        return
    key = storage_key(base)
    self._add_write(key, index, version, span)
    for tid, entry, _, _ in _current_on(self, key, t, index):
        self.producers[tid] = (entry[0], entry[1], STALE_VERSION)


def _current_on(self, key: int, t: torch.Tensor, index: int):
    """``(id, binding, tensor, version)`` of each tensor on storage ``key`` bound to an op other than ``index``, not
    since written, whose version counter is not ``t``'s: those a write through ``t`` changes unseen.  One pass over
    the bound tensors, made from a copy, so that the caller may rebind them meanwhile."""
    for tid, entry in list(self.producers.items()):
        held = bound_tensor(entry)
        if isinstance(held, torch.Tensor) and id(held) == tid and not _same_counter(held, t) and entry[1] != index \
                and storage_key(held) == key:
            version = version_of(held)
            if entry[2] == version:
                yield tid, entry, held, version


def _span_in(t: torch.Tensor, base: torch.Tensor):
    """``memory_span(t)`` placed in ``base``'s storage (``t`` may have one of its own on a part of those bytes,
    made from a DLPack capsule or a NumPy array), or None when unknown."""
    span = memory_span(t)
    try:
        shift = t.untyped_storage().data_ptr() - base.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, ValueError):  # a layout without a storage (sparse)
        return None
    if span is None or not shift:
        return span
    return (span[0] + shift, span[1] + shift, *span[2:])


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _same_counter(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor or views of one base, and so share a version counter."""
    return _root(a) is _root(b)


def _same_storage(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``t`` holds ``base``'s storage object, as ``base.data`` does; a tensor made from ``base``'s
    DLPack capsule has one of its own on the same bytes, so ``base``'s holders are counted without it."""
    try:
        return t.untyped_storage()._cdata == base.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, ValueError):  # a layout without a storage (sparse)
        return True


def note_export(self, t: torch.Tensor, whole_storage: bool = False) -> None:
    """``t.__dlpack__()``, ``t.numpy()`` or ``t.__array__()`` handed ``t``'s bytes out, or ``t.untyped_storage()``
    its whole storage (``whole_storage``): a tensor made from what they return (``torch.from_dlpack(t)``,
    ``torch.from_numpy(t.numpy())``, ``u.set_(t.untyped_storage(), ...)``) shares them without sharing ``t``'s
    version counter, as ``t.data`` does.  Noted by the address of the first byte handed out, where such a
    tensor's storage starts, with ``t``'s base, which every view sharing its counter keeps alive (``t`` itself
    may be a view made for the call alone: ``torch.from_dlpack(y[2:])``)."""
    try:
        start = t.untyped_storage().data_ptr() if whole_storage else t.data_ptr()
    except (RuntimeError, NotImplementedError, ValueError):  # a layout without a storage (sparse)
        return
    if start:
        self.exports[start] = weakref(_root(t))


def exported_alias(self, t: torch.Tensor, key: int) -> tuple | None:
    """``(weak t, weak exported)`` when ``t``, which shares no version counter with a tensor that handed out
    its bytes (``note_export``), lives in them (its storage, whose key is ``key``, starts where those bytes
    do): a write to ``t`` is then one through ``exported.data``, noted so (``note_data_write``) for this and
    every later write to ``t``.  ``t`` may be bound to an op: ``u.set_(storage, ...)`` keeps ``u`` bound to
    the op that made it, since torch hands ``set_`` no ``__torch_function__``."""
    ref = self.exports.get(key)
    exported = ref() if ref is not None else None
    if exported is None or _same_counter(exported, t):
        return None
    alias = self.data_bases[id(t)] = (weakref(t), weakref(exported))
    return alias


def moved_unseen(self, t: torch.Tensor, key: int, version) -> bool:
    """Whether ``t``, just written once more (now at ``version``), had moved since it was bound with no noted
    write of its storage to tell why: ``u.set_(y)`` (a call torch hands no ``__torch_function__``) moves
    ``u``'s counter and puts it on ``y``'s memory, which ``u``'s writes then change without moving ``y``'s."""
    entry = self.producers.get(id(t))
    if entry is None or version is None or entry[2] is None or entry[2] >= version - 1 or not is_bound(entry, t):
        return False
    writes = self.writers.get(key)
    return not writes or writes[-1][1] != version - 1


def note_write_past_counters(self, t: torch.Tensor, index: int, key: int) -> None:
    """Record ``index`` wrote ``t``, whose counter no other bound tensor on its storage may share (see
    ``moved_unseen``): those whose bytes it reached are made stale, and the write is noted at their version,
    so that their next read names it (``producer_of``), as after a write through ``x.data``."""
    span = memory_span(t)
    noted = set()  # the versions the write is noted at: one per version counter found
    for tid, entry, held, version in _current_on(self, key, t, index):
        if version is not None and spans_meet(memory_span(held), span):
            if version not in noted:
                noted.add(version)
                self._add_write(key, index, version, span)
            self.producers[tid] = (entry[0], entry[1], STALE_VERSION)


def note_unversioned_write(self, t: torch.Tensor, record_index: int) -> None:
    """A ``torch.distributed`` collective wrote ``t``, whose output record is ``record_index``.

    c10d's in-place kernels (``all_reduce``, ``broadcast`` ...) move no version counter, so when ``t``
    is a view, its base would still look like the output of the op that made it.  The write is noted
    in ``writers`` and the base's binding made stale, so a later read of the base names the collective,
    as for an in-place op written through a view (``producer_of``)."""
    self._add_write(storage_key(t), record_index, version_of(t), memory_span(t))
    base = t._base
    entry = self.producers.get(id(base)) if base is not None else None
    if entry is not None and is_bound(entry, base):
        self.producers[id(base)] = (entry[0], entry[1], STALE_VERSION)


def repointed_onto(self, t: torch.Tensor):
    """The bound tensor whose bytes ``t`` now holds, when ``t``'s counter moved with no write capture saw: a
    tensor on the same storage, with a counter of its own, reaching every byte ``t`` reaches, as ``t.set_(y)``
    (which torch hands no ``__torch_function__``) leaves ``t`` and ``y``.  One with ``t``'s very layout first
    (``t`` then holds its value), else the latest bound; None when no bound tensor holds those bytes.  One
    pass over the bound tensors: ``set_`` is rare in a forward, and only a read after it pays."""
    span, key = memory_span(t), storage_key(t)
    if span is None or not span[1]:
        return None
    found = None
    for tid, entry in list(self.producers.items()):
        held = bound_tensor(entry)
        if not isinstance(held, torch.Tensor) or id(held) != tid or held is t or _same_counter(held, t) \
                or storage_key(held) != key:
            continue
        holds = memory_span(held)
        if holds == span and held.dtype == t.dtype:
            return held
        if holds is not None and holds[0] <= span[0] and span[1] <= holds[1]:
            found = held if found is None or self.producers[id(found)][1] < entry[1] else found
    return found


def unwritten_since(self, t: torch.Tensor, entry: tuple) -> bool:
    """Whether no write capture saw reached ``t``'s storage since ``t`` was bound (``entry``), though its
    counter moved: the storage may be one ``t`` was put on since (``t.set_(y)``, after ``y`` was written)."""
    writes = self.writers.get(storage_key(t))
    return not writes or writes[-1][0] <= entry[1]


def set_onto_other_bytes(self, t: torch.Tensor, entry: tuple, version, index) -> bool:
    """Whether ``t``'s counter moved since it was bound (``entry``) with no write capture saw reaching its bytes
    (``index``, from ``_last_writer_of``), as ``t.set_(y)`` moves it.  An inference tensor has no counter to
    have moved, and its views no ``_base`` to tell them from a tensor ``set_`` put on its bytes: only the writes
    noted on its storage tell, so a view of an in-place result (``relu_`` then ``view``) holds that view's op's
    value, and is never read through another tensor (each would name the other)."""
    if version is None:
        return False
    return index == UNSEEN or (index is None and self._unwritten_since(t, entry))


def read_through(self, t: torch.Tensor, holder: torch.Tensor) -> int:
    """The parent of a read of ``t``, put on ``holder``'s memory by ``t.set_(holder)``: the op whose value
    ``holder`` is.  When ``t`` holds another part or layout of those bytes, no op output is the value
    read, and replay is told so (``alias_reads``)."""
    index = self.producer_of(holder)
    return self._read_not_saved(index) if index >= 0 and memory_span(t) != memory_span(holder) else index


def read_not_saved(self, index: int) -> int:
    """Note that the call about to be recorded reads a value of ``index``'s memory its saved output is not
    (replay cannot take it), and return ``index``."""
    read = (len(self.calls), index)
    self.alias_reads.add(read)
    self.recent_alias_reads.append(read)
    return index
