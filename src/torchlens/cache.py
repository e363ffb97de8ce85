"""A cache of what is derived from an object, kept for as long as the object lives: code made at run time
(``exec``, a ``torch.fx`` module's forward) and a forward function whose closure holds its model are freed with
what holds them, rather than kept by a cache that outlives them."""

from __future__ import annotations

import weakref


def per_object(compute):
    """``compute(obj)``, cached for as long as ``obj`` (a code object, a function) lives: by id (hashing a code
    object hashes its bytecode, about a microsecond), with a weak reference whose callback forgets the entry as
    ``obj`` dies, before its id can be reused.  What takes no weak reference (a stand-in for code, in a trace
    read by ``tl.load``) is computed on each call."""
    cache: dict = {}

    def cached(obj):
        entry = cache.get(id(obj))
        if entry is None or entry[0]() is not obj:
            key = id(obj)
            try:
                watch = weakref.ref(obj, lambda _, key=key: cache.pop(key, None))
            except TypeError:
                return compute(obj)
            entry = cache[key] = (watch, compute(obj))
        return entry[1]

    return cached
