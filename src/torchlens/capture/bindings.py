"""Whether a ``CaptureState.producers`` entry is about a given tensor (``is_bound``), and which tensor it is
about (``bound_tensor``).

A module of its own because ``state.py`` and ``pass_through.py``, whose functions are methods of
``CaptureState``, both read it.
"""

from __future__ import annotations

from weakref import ref as weakref

import torch


def is_bound(entry: tuple, t: torch.Tensor) -> bool:
    """Whether a ``CaptureState.producers`` entry found under ``id(t)`` is about ``t`` itself, not about a
    dead tensor whose id ``t`` now reuses.

    An op output whose memory ``save="all"`` saves by reference anyway is bound by the tensor itself (the capture
    hot path makes no weak reference for it): while the entry holds it, its id cannot be reused, so
    ``entry[0] is t`` decides.  Every other entry is weak (an op a selection saved among them: a selected
    module's call may let it go before the trace ends), and goes stale when its tensor dies."""
    ref = entry[0]
    return ref is t or (type(ref) is weakref and ref() is t)


def bound_tensor(entry: tuple):
    """The tensor a ``CaptureState.producers`` entry holds (itself or through a weak reference), or None when
    it died.  ``is_bound(entry, t)`` is ``bound_tensor(entry) is t``, written out there for the hot path."""
    ref = entry[0]
    return ref() if type(ref) is weakref else ref
