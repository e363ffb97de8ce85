"""What a forward may return: a result whose tensors a trace cannot record as its outputs is refused after the
forward, rather than traced with no outputs (a plausible, empty record) and compared by identity.

A generator, a coroutine or another iterator (``map``, ``zip``) makes or hands out its items only as it is
iterated, and a function (``lambda: h * 3``) computes only when called: either runs after tracing ended.  A set
holds its tensors in no order and at no path, and two runs' sets compare by the tensors' identity.  A future
(``torch.jit.fork``) hands out its value only when waited on.  A dict view (``d.values()``) is a window onto a
dict, whose tensors no walk of outputs reaches, and which shows whatever the dict holds when it is read; a dict
keyed by tensors hides its keys from that walk, which reads a dict's values.  A walk of outputs looks
``MAX_DEPTH`` levels deep (a list of a list ... of a tensor, as a chain of pairs kept step by step makes):
tensors nested deeper are out of its reach too.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import ItemsView, Iterator, KeysView, ValuesView

import torch

from ..tree import MAX_DEPTH, TENSOR_TYPES, container_items, has_tensor, holds_tensor, path_text

_SCALARS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)
_LEAVES = frozenset((*TENSOR_TYPES, *_SCALARS))


def refuse_unrecordable_output(output, model, shown) -> None:
    """Raise ``TypeError`` for a forward's result no trace can record (see the module's docstring), or one
    holding such a value among its outputs (``(logits, generator)``); ``shown``, the progress bar, is closed
    first."""
    found = _unrecordable(output)
    value, path = output, ()
    # A tensor subclass is recorded as the tensor it is: its attributes (a FakeTensor's fake_mode and the tables
    # it keeps keyed by tensors) are no part of the output.
    if found is None and not isinstance(output, torch.Tensor):
        value, path, found = _held_unrecordable(output, (), 0, set()) or (output, (), None)
    if found is None:
        return
    getattr(value, "close", lambda: None)()  # a coroutine never awaited would warn
    shown.close()
    what, advice = found
    where = f" at {path_text('output', path)}" if path else ""
    if path and found not in _ANY_PART:  # the advice for a whole result (wrap the model) does not fit a part of it
        advice = f"make {path_text('output', path)} {_settled_form(value)} inside the forward"
    raise TypeError(f"{type(model).__name__}'s forward returned a {type(value).__name__}{where}, {what}; trace a "
                    f"forward that returns its results ({advice})")


def _held_unrecordable(value, path, depth, seen):
    """``(value, path, problem)`` of the first value inside an output, at any depth a walk of outputs reaches,
    that hides its tensors from that walk or makes them after tracing ended.  Functions and other iterators
    are left alone there: an output object may well keep a callback or a counter as an attribute."""
    if depth >= MAX_DEPTH:  # where the walk of outputs stops
        return (value, path, _TOO_DEEP) if id(value) not in seen and holds_tensor(value) else None
    children = container_items(value, True) if id(value) not in seen else None
    if children is None:
        return None
    seen.add(id(value))
    for key, child in children:
        if type(key) in TENSOR_TYPES:  # a dict keyed by tensors: a walk of outputs reads its values alone
            return value, path, _TENSOR_KEYS
        kind = type(child)
        if kind in _LEAVES:  # by type first: an output object's attributes are mostly tensors and plain values
            continue
        if _may_be_refused(kind):
            problem = _unrecordable(child)
            if problem is not None and not _kept_as_data(child):
                return child, path + (key,), problem
        elif isinstance(child, _SCALARS) or isinstance(child, torch.Tensor):
            continue
        found = _held_unrecordable(child, path + (key,), depth + 1, seen)
        if found is not None:
            return found
    return None


_TENSOR_KEYS = ("keyed by tensors, which a walk of outputs does not read (it reads a dict's values), and which "
                "compares by the tensors' identity", "key it by names or positions, or return its keys and values "
                "in lists")
_TOO_DEEP = (f"which holds tensors more than {MAX_DEPTH} levels deep, below the depth a trace looks into for its "
             "outputs", "return them less deeply nested, a list of the tensors say")
_ANY_PART = (_TENSOR_KEYS, _TOO_DEEP)  # problems whose advice fits a part of an output as well as the whole


def _settled_form(value) -> str:
    """What a part of an output that no trace can record should be made into, said for the refusal."""
    if inspect.iscoroutine(value) or inspect.isasyncgen(value):
        return "the value it computes (await it)"
    if isinstance(value, torch._C.Future):
        return "the value it holds (.wait())"
    return "a list or a tuple of its values"


def _kept_as_data(value) -> bool:
    """A function or a plain iterator (not a generator) an output object may keep as data beside its tensors."""
    return inspect.isfunction(value) or inspect.ismethod(value) or isinstance(value, functools.partial) or \
        isinstance(value, Iterator) and not inspect.isgenerator(value)


# The kinds of value ``_unrecordable`` may refuse: any other type is settled by one lookup (a ModelOutput and the
# cache objects it holds are walked at every trace).
_REFUSABLE = (types.CoroutineType, types.AsyncGeneratorType, Iterator, types.FunctionType, types.MethodType,
              functools.partial, set, frozenset, torch._C.Future, KeysView, ValuesView, ItemsView)
_refusable_types: dict = {}  # type -> whether it is a subclass of one of _REFUSABLE


def _may_be_refused(kind) -> bool:
    verdict = _refusable_types.get(kind)
    if verdict is None:
        if len(_refusable_types) > 4096:  # classes made at run time come and go
            _refusable_types.clear()
        verdict = _refusable_types[kind] = issubclass(kind, _REFUSABLE)
    return verdict


def _unrecordable(output):
    """``(what is wrong, what to do)`` for a result no trace can record, else None."""
    if not _may_be_refused(type(output)):
        return None
    if inspect.iscoroutine(output):  # an async def forward: its body runs when awaited, which list() cannot do
        return ("whose body runs only when awaited, after tracing ended",
                "e.g. run it to the end inside the traced callable: lambda x: asyncio.run(model(x)), with root=model")
    if inspect.isgenerator(output) or inspect.isasyncgen(output):
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
    if isinstance(output, torch._C.Future) and (not output.done() or has_tensor(output.value())):
        return ("whose value is read with .wait(), and is not an output a trace can name (a torch.jit.fork, or a "
                "future another thread completes later)", "e.g. wait for it in the traced callable: "
                "lambda x: model(x).wait(), with root=model")
    if isinstance(output, (KeysView, ValuesView, ItemsView)) and has_tensor(list(output)):
        return ("a view of a dict, which shows what the dict holds when it is read, not what the forward returned, "
                "and whose tensors could not be named as outputs", "return the dict itself, or list(d.values())")
    return None
