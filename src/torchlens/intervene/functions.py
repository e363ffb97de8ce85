"""Whether the forward is now inside the ``forward`` of a custom ``torch.autograd.Function`` whose backward will run.

Such a Function's gradient is its own ``backward``, computed from what its ``forward`` saved: an edit made inside
the forward changes the values that follow, but not that backward, so the gradients autograd computes would be
those of the unedited Function.  ``intervene/runtime.py`` refuses such an edit, as it refuses one inside a
checkpoint region (``checkpointing.py``, whose reentrant regions are such a Function, found there first).
"""

from __future__ import annotations

import inspect
import sys

import torch

from ..errors import InterventionError
from ..tree import outputs_equal
from .path import site_where

_APPLY = getattr(getattr(torch.autograd.Function.apply, "__func__", None), "__code__", None)


def function_with_backward():
    """The custom Function whose ``forward`` is now running (the innermost, or one around it: the inner one's forward
    runs under no_grad, so only an outer one may be recorded), when autograd recorded its call (its backward will
    run), else None.  Looked at only when an action changes a value, never per op.

    ``Function.apply`` runs ``forward`` under no_grad, so the grad mode now says nothing: a forward given its
    ``ctx`` (no ``setup_context``) has the node's next functions already, set only when autograd records the call;
    one without (``setup_context`` defined) cannot be asked, and counts as recorded when an input requires grad."""
    if _APPLY is None:  # torch's apply in C (outside the supported range): no frame to find
        return None
    callee, frame = None, sys._getframe(1)
    while frame is not None:
        if frame.f_code is _APPLY and _recorded(frame, callee):
            return frame.f_locals.get("cls")
        callee, frame = frame, frame.f_back
    return None


def _recorded(apply_frame, callee) -> bool:
    """Whether autograd recorded the ``Function.apply`` call running in ``apply_frame``, whose ``forward`` runs in
    ``callee``.  A reentrant checkpoint region is such a call, which ``checkpointing.py`` decides on."""
    cls = apply_frame.f_locals.get("cls")
    if getattr(cls, "__module__", "") == "torch.utils.checkpoint":
        return False
    ctx = _ctx_of(callee) if callee is not None else None
    if ctx is not None:
        return any(fn is not None for fn, _ in ctx.next_functions)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in apply_frame.f_locals.get("args", ()))


def _ctx_of(frame):
    """The ``ctx`` an old-style ``forward(ctx, ...)`` was given (also through a decorator taking ``*args``, as
    ``torch.amp.custom_fwd``), or None."""
    code = frame.f_code
    first = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
    if first is None and code.co_flags & inspect.CO_VARARGS:
        varargs = frame.f_locals.get(code.co_varnames[code.co_argcount + code.co_kwonlyargcount], ())
        first = varargs[0] if varargs else None
    return first if isinstance(first, torch.autograd.function.BackwardCFunction) else None


def refuse_inside_function(key, op, new: torch.Tensor, value: torch.Tensor) -> None:
    """Refuse an edit at the site ``key`` (resolved to ``op``) made inside a custom Function's forward whose backward
    will run; a new value equal to the one it replaces (a copy) changes nothing that backward misses, and is
    allowed."""
    cls = function_with_backward()
    if cls is not None and not _same_values(new, value):
        raise InterventionError(
            f"intervention at {site_where(key, op)}: the site is inside the forward of the custom autograd.Function "
            f"{getattr(cls, '__qualname__', cls)}, whose own backward gives the gradient of its output, unaware of "
            "the edit, so gradients through it would be those of the unedited Function. Intervene at the op or "
            "module that reads the Function's output, or trace under torch.no_grad() when no gradient is needed")


def _same_values(new: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``new`` holds the values ``value`` does, by the package's one comparison of outputs (a NaN where
    the other holds a NaN is the same value: a copy of a value holding NaN is a copy); False where torch
    cannot compare them."""
    try:
        with torch._C.DisableTorchFunction():  # a comparison, no op of the model
            return outputs_equal(new, value)
    except (RuntimeError, NotImplementedError):
        return False
