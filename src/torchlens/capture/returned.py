"""What a forward may return: a result whose tensors a trace cannot record as its outputs is refused after the
forward, rather than traced with no outputs (a plausible, empty record) and compared by identity.

A generator, a coroutine or another iterator (``map``, ``zip``) makes or hands out its items only as it is
iterated, and a function (``lambda: h * 3``) computes only when called: either runs after tracing ended.  A set
holds its tensors in no order and at no path, and two runs' sets compare by the tensors' identity.  A future
(``torch.jit.fork``) hands out its value only when waited on.  A dict view (``d.values()``) is a window onto a
dict, whose tensors no walk of outputs reaches, and which shows whatever the dict holds when it is read.  The
result's tuples, lists, dicts and dataclasses are looked into for all but functions (one held beside the tensors
is a value).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import ItemsView, Iterator, KeysView, ValuesView

import torch

from ..tree import MAX_DEPTH, container_items, has_tensor

# What a result commonly holds, and never something to refuse or to look inside.
_LEAVES = frozenset((torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str, bytes))


def refuse_unrecordable_output(output, model, shown) -> None:
    """Raise ``TypeError`` for a forward's result no trace can record (see the module's docstring), whether it is
    the result or is held in it (``return h, {h * 2}``); ``shown``, the progress bar, is closed first."""
    found = _first_unrecordable(output, "output", 0, set())
    if found is None:
        return
    path, value, (what, advice) = found
    getattr(value, "close", lambda: None)()  # a coroutine never awaited would warn
    shown.close()
    held = f" holding a {type(value).__name__} at {path}" if value is not output else ""
    raise TypeError(f"{type(model).__name__}'s forward returned a {type(output).__name__}{held}, {what}; trace a "
                    f"forward that returns its results ({advice})")


def _first_unrecordable(value, path: str, depth: int, seen: set):
    """``(path, value, problem)`` for the first value no trace can record in ``value`` (itself, then what its
    tuples, lists, dicts and dataclasses hold, depth first), else None."""
    problem = _unrecordable(value, nested=depth > 0)
    if problem is not None:
        return path, value, problem
    if type(value) in _LEAVES or depth >= MAX_DEPTH or id(value) in seen or isinstance(value, torch.Tensor):
        return None
    children = container_items(value, attrs=False)
    if children is None:
        return None
    seen.add(id(value))
    for key, child in children:
        found = _first_unrecordable(child, f"{path}.{key}", depth + 1, seen)
        if found is not None:
            return found
    return None


def _unrecordable(output, nested: bool = False):
    """``(what is wrong, what to do)`` for a result no trace can record, else None.  ``nested``: ``output`` is held
    in the result, beside what was recorded; a function there is a value like any other."""
    if inspect.iscoroutine(output):  # an async def forward: its body runs when awaited, which list() cannot do
        return ("whose body runs only when awaited, after tracing ended",
                "e.g. run it to the end inside the traced callable: lambda x: asyncio.run(model(x)), with root=model")
    if inspect.isgenerator(output) or inspect.isasyncgen(output):
        return "whose body runs only when iterated, after tracing ended", "e.g. wrap it: lambda x: list(model(x))"
    if isinstance(output, Iterator):
        return ("an iterator whose items are made or handed out only when iterated, after tracing ended",
                "e.g. wrap it: lambda x: list(model(x))")
    if not nested and (inspect.isfunction(output) or inspect.ismethod(output)
                       or isinstance(output, functools.partial)):
        return ("which computes only when called, after tracing ended, so its ops would not be recorded",
                "e.g. call it in the traced callable: lambda x: model(x)()")
    if isinstance(output, (set, frozenset)) and any(isinstance(item, torch.Tensor) for item in output):
        return ("whose tensors have no order and no path to name them as outputs, and which compares by the "
                "tensors' identity", "return them in a tuple or a list")
    if isinstance(output, torch._C.Future) and (not output.done() or has_tensor(output.value())):
        return ("whose value is read with .wait(), and is not an output a trace can name (a torch.jit.fork, or a "
                "future another thread completes later)", "e.g. wait for it in the traced callable: "
                "lambda x: model(x).wait(), with root=model")
    if isinstance(output, (KeysView, ValuesView, ItemsView)) and has_tensor(list(output)):
        return ("a view of a dict, which shows what the dict holds when it is read, not what the forward returned, "
                "and whose tensors could not be named as outputs", "return the dict itself, or list(d.values())")
    return None
