"""The trace's inputs: each tensor of the call's arguments, named by the forward parameter it binds to.

``add_inputs`` registers every tensor the call passes (in containers too, and the tensors a
``functools.partial`` binds or a forward's tensor defaults supply) as an input record named by its slot,
``input.<parameter>`` and the path inside it.  The common call, a module's forward called with arguments
that bind plainly, is named from a layout cached per forward function (``call_slots``) rather than
``Signature.bind``, which costs about 12 us for a transformers forward.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Mapping
from typing import NamedTuple

import torch

from ..cache import per_object
from ..errors import add_note
from ..record.columns import INPUT
from ..record.finalize import io_tensor_leaves
from ..tree import MAX_DEPTH, cut_off_path, path_text


def _forward_signature(model):
    if isinstance(model, torch.nn.Module):
        forward = model.forward
        func = getattr(forward, "__func__", None)
        if func is not None and getattr(forward, "__self__", None) is model:
            return _bound_signature(func)  # cached per forward function, first parameter (self) dropped
        target = forward
    else:
        target = model
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


@per_object  # a forward's closure may hold its model: not kept past the function
def _bound_signature(func):
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def call_slots(model, args, kwargs):
    """``(input slot, value)`` per argument of the common call, a module's forward called with arguments
    that bind plainly (positional ones, then keywords that name its parameters), in the order
    ``Signature.bind`` gives them, without calling it (about 12 us for a transformers forward); None for
    any other call, which ``bind`` decides."""
    if not isinstance(model, torch.nn.Module):
        return None
    forward = model.forward
    func = getattr(forward, "__func__", None)
    if func is None or getattr(forward, "__self__", None) is not model:
        return None
    layout = _call_layout(func)
    if layout is None:
        return None
    slots, required, keywords, required_keywords, tensor_defaults = layout
    if tensor_defaults:
        return None  # a parameter whose default is a tensor: bind says which were not given (``add_inputs``)
    given = len(args)
    if given > len(slots):
        return None  # *args, or too many: let bind decide
    if not kwargs:
        return zip(slots, args) if given >= required and not required_keywords else None
    named = []
    for name, value in kwargs.items():
        position, slot = keywords.get(name, _UNNAMED)
        if position < given:
            return None  # **kwargs, a positional-only name, or a value given twice: let bind decide
        named.append((position, slot, value))
    taken = {position for position, _, _ in named}
    if not taken.issuperset(range(given, required)) or not required_keywords <= kwargs.keys():
        return None  # a required argument is missing: bind raises
    named.sort(key=_first)
    return [*zip(slots, args), *((slot, value) for _, slot, value in named)]


_UNNAMED = (-1, None)  # a keyword no parameter of the forward takes by name
_first = operator.itemgetter(0)


class CallLayout(NamedTuple):
    """How a forward's parameters bind, found once per forward function."""
    slots: tuple  # the input slot (``input.<name>``) of each leading positional parameter
    required: int  # how many of those have no default
    keywords: dict  # {name: (position, input slot)} of the parameters a keyword can name
    required_keywords: frozenset  # the keyword-only parameters without a default
    tensor_defaults: bool  # whether a parameter's default is a tensor


@per_object  # a forward's closure may hold its model: not kept past the function
def _call_layout(func):
    """The forward's ``CallLayout``, or None when it has no signature."""
    sig = _bound_signature(func)
    if sig is None:
        return None
    slots, required, keywords, required_keywords = [], 0, {}, set()
    for position, p in enumerate(sig.parameters.values()):
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            slots.append(f"input.{p.name}")
            if p.default is p.empty:
                required = len(slots)
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            keywords[p.name] = position, f"input.{p.name}"
        if p.kind == p.KEYWORD_ONLY and p.default is p.empty:
            required_keywords.add(p.name)
    return CallLayout(tuple(slots), required, keywords, frozenset(required_keywords), bool(_tensor_defaults(sig)))


def _tensor_defaults(sig) -> tuple:
    """``(name, tensor)`` per parameter whose default is a tensor (``def forward(self, x, scale=torch.tensor(2.))``):
    a call that leaves it out reads that tensor, an input of the trace as much as one passed."""
    return tuple((p.name, p.default) for p in sig.parameters.values() if isinstance(p.default, torch.Tensor))


def _defaults_left_out(model, sig, given) -> list:
    """``(name, tensor)`` per tensor default of ``model``'s forward that the call did not give: found once per
    forward function (``_call_layout``) for a module, by a walk of the signature for any other callable."""
    forward = getattr(model, "forward", None) if isinstance(model, torch.nn.Module) else None
    func = getattr(forward, "__func__", None)
    if func is not None and getattr(forward, "__self__", None) is model:
        layout = _call_layout(func)
        if layout is None or not layout.tensor_defaults:
            return []
    return [(name, value) for name, value in _tensor_defaults(sig) if name not in given]


def _whole_call(model, args, kwargs) -> tuple:
    """``(callable, args, kwargs)`` of the call a ``functools.partial`` makes: the arguments bound in it
    are the forward's inputs as much as those passed (``partial(model, attention_mask=mask)`` reads the
    mask), and they bind to the parameters of the callable it wraps, not to the partial's ``*args``."""
    while isinstance(model, functools.partial):
        args, kwargs, model = (*model.args, *args), {**model.keywords, **kwargs}, model.func
    return model, args, kwargs


def add_inputs(state, model, args, kwargs) -> dict:
    """Register each tensor of the call's arguments as an input, named by its slot; return
    ``{slot: input record}`` for the slots holding a tensor another slot already named (``labels=input_ids``:
    one tensor, one input, which ``log["input.labels"]`` finds too)."""
    if isinstance(model, functools.partial):
        model, args, kwargs = _whole_call(model, args, kwargs)
    inputs = call_slots(model, args, kwargs)
    if inputs is None:
        sig = _forward_signature(model)
        names = None
        if sig is not None:
            try:
                bound = sig.bind(*args, **kwargs)
                names = list(bound.arguments.items())
                names += _defaults_left_out(model, sig, bound.arguments)
            except TypeError:
                pass
        if names is None:
            names = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
        inputs = [(f"input.{name}", value) for name, value in names]
    # Every argument's tensors found before any is registered: a refusal leaves no input watched.
    found = [((slot, value),) if type(value) is torch.Tensor else _argument_leaves(value, slot)
             for slot, value in inputs]
    producers, aliases = state.producers, {}
    for leaves in found:
        for path, t in leaves:
            if id(t) not in producers:
                state.add_source(t, INPUT, path)
            else:  # the same tensor passed twice is one input
                aliases[path] = producers[id(t)][1]
    return aliases


def _argument_leaves(value, slot: str) -> list:
    """``io_tensor_leaves`` of one argument, refused where it holds tensors nested deeper than that walk looks:
    read by the forward, they would show as tensors from nowhere, not as the trace's inputs."""
    cut = cut_off_path(value, attrs=True)
    if cut is not None:
        raise TypeError(f"tl.trace: the argument {path_text(slot, cut)} holds tensors more than {MAX_DEPTH} levels "
                        "deep, below the depth a trace looks into for its inputs; pass them less deeply nested (a "
                        "list of the tensors, say)")
    return io_tensor_leaves(value, slot)


def note_how_arguments_were_passed(exc: BaseException, args, model=None) -> None:
    """A note on a forward that failed taking ``args`` by tl.trace's rule (a list is one argument, a named
    tuple's fields are several, a dict is one argument), saying how to pass them the other way; tl.validate's
    untraced run adds it too."""
    one_list = len(args) == 1 and type(args[0]) is list
    if isinstance(exc, TypeError) and one_list and "positional argument" in str(exc):
        add_note(exc, "torchlens: the list was passed as one positional argument (only a tuple's items are "
                     "passed as several): to call forward(a, b), give tl.trace(model, (a, b))")
    elif isinstance(exc, (TypeError, AttributeError)) and one_list and "list" in str(exc):
        # a DataLoader collates an (inputs, labels) dataset into a list, which the forward got as its input
        add_note(exc, f"torchlens: the forward got a list of {len(args[0])} items as its one positional argument "
                     "(only a tuple's items are passed as several); a DataLoader collates an (inputs, labels) dataset "
                     "into such a list: give tl.extract args_of=lambda batch: batch[0], or tl.trace the inputs alone")
    elif isinstance(exc, (TypeError, AttributeError)) and type(args) is not tuple and isinstance(args, tuple):
        # a named tuple (a batch) given as the arguments is a tuple: its fields were passed one by one
        add_note(exc, f"torchlens: the {type(args).__name__} was passed as the positional arguments, one per field "
                     "(a tuple's items are passed as several); to pass it as one argument, wrap it: "
                     "tl.trace(model, (batch,)), or args_of=lambda batch: (batch,) in tl.extract")
    else:
        named = parameters_named_by(model, args)
        if named:
            # a tokenized batch given as the argument: the model read the whole mapping as its first parameter,
            # and fails wherever that first meets it (transformers' GPT-2: "unhashable type: 'slice'")
            add_note(exc, f"torchlens: the {type(args[0]).__name__} was passed as the forward's one positional "
                         f"argument, and its keys name the forward's parameters ({', '.join(named)}): to pass it as "
                         "keyword arguments, as model(**batch) does, give tl.trace(model, (), batch), or "
                         "kwargs_of=dict in tl.extract")


def parameters_named_by(model, args) -> list:
    """The keys of a mapping passed as the one positional argument that name parameters of ``model``'s forward:
    keyword arguments passed as one value.  [] for any other call."""
    if model is None or len(args) != 1 or not isinstance(args[0], Mapping):
        return []
    sig = _forward_signature(model)
    if sig is None:
        return []
    names = {p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [key for key in args[0] if isinstance(key, str) and key in names]
