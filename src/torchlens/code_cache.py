"""A cache of what is derived from a code object, kept for as long as the code lives: code made at run time
(``exec``, a ``torch.fx`` module's forward) is freed with its function rather than held by a cache."""

from __future__ import annotations

import weakref


def per_code(compute):
    """``compute(code)``, cached for as long as the code object ``code`` lives: by id (hashing a code object
    hashes its bytecode, about a microsecond), with a weak reference whose callback forgets the entry as the
    code dies, before its id can be reused.  Code made at run time (``exec``, a ``torch.fx`` module's forward)
    is then freed with its function.  A stand-in for code (in a trace read by ``tl.load``) is not cached."""
    cache: dict = {}

    def cached(code):
        entry = cache.get(id(code))
        if entry is None or entry[0]() is not code:
            key = id(code)
            try:
                watch = weakref.ref(code, lambda _, key=key: cache.pop(key, None))
            except TypeError:
                return compute(code)
            entry = cache[key] = (watch, compute(code))
        return entry[1]

    return cached
