"""What a forward may return: a result whose tensors a trace cannot record as its outputs is refused after the
forward, rather than traced with no outputs (a plausible, empty record) and compared by identity.

A generator, a coroutine or another iterator (``map``, ``zip``) makes or hands out its items only as it is
iterated, and a function (``lambda: h * 3``) computes only when called: either runs after tracing ended.  A set
holds its tensors in no order and at no path, and two runs' sets compare by the tensors' identity.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator

import torch


def refuse_unrecordable_output(output, model, shown) -> None:
    """Raise ``TypeError`` for a forward's result no trace can record (see the module's docstring); ``shown``,
    the progress bar, is closed first."""
    problem = _unrecordable(output)
    if problem is None:
        return
    getattr(output, "close", lambda: None)()  # a coroutine never awaited would warn
    shown.close()
    what, advice = problem
    raise TypeError(f"{type(model).__name__}'s forward returned a {type(output).__name__}, {what}; trace a "
                    f"forward that returns its results ({advice})")


def _unrecordable(output):
    """``(what is wrong, what to do)`` for a result no trace can record, else None."""
    if inspect.isgenerator(output) or inspect.iscoroutine(output) or inspect.isasyncgen(output):
        return "whose body runs only when iterated, after tracing ended", "e.g. wrap it: lambda x: list(model(x))"
    if isinstance(output, Iterator):
        return ("an iterator whose items are made or handed out only when iterated, after tracing ended",
                "e.g. wrap it: lambda x: list(model(x))")
    if inspect.isfunction(output) or inspect.ismethod(output) or isinstance(output, functools.partial):
        return ("which computes only when called, after tracing ended, so its ops would not be recorded",
                "e.g. call it in the traced callable: lambda x: model(x)()")
    if isinstance(output, (set, frozenset)) and any(isinstance(item, torch.Tensor) for item in output):
        return ("whose tensors have no order and no path to name them as outputs, and which compares by the "
                "tensors' identity", "return them in a tuple or a list")
    return None
