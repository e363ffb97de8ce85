"""Whether a ``CaptureState.producers`` entry is about a given tensor (``is_bound``).

A module of its own because ``state.py`` and ``pass_through.py``, whose functions are methods of
``CaptureState``, both read it.
"""

from __future__ import annotations

from weakref import ref as weakref

import torch


def is_bound(entry: tuple, t: torch.Tensor) -> bool:
    """Whether a ``CaptureState.producers`` entry found under ``id(t)`` is about ``t`` itself, not about a
    dead tensor whose id ``t`` now reuses.

    An op output whose memory is saved by reference anyway is bound by the tensor itself (the capture hot
    path makes no weak reference for it): while the entry holds it, its id cannot be reused, so
    ``entry[0] is t`` decides.  Every other entry is weak, and goes stale when its tensor dies."""
    ref = entry[0]
    return ref is t or (type(ref) is weakref and ref() is t)
