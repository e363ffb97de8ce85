"""Writes a call makes to its arguments: predicted before it runs, found after it.

Copy-on-write needs to know before a call whether it will write an activation already saved
(``protect_before_write``: by name, ``add_`` and ``x[i] = v``; by keyword, ``out=`` and ``inplace=True``;
by schema, the ``Tensor(a!)`` arguments of an operator called through ``torch.ops``, as custom ops are,
whatever its name, or of QAT's fused fake-quantize kernel; and the normalisations whose kernels update their running
statistics).  After the call, a moved version counter says which tensor arguments it wrote
(``written_arguments``); an inference tensor has no counter, so for it the prediction by name decides.
``inplace_cache`` keeps the verdict of each function that lasts as long as the program, and the compiled
handler reads the same dict; any other function's is kept only as long as the function lives.
"""

from __future__ import annotations

import types

import torch
from torch._ops import OpOverload, OpOverloadPacket

from ..cache import per_object
from ..record.columns import writes_first_argument
from ..record.layouts import memory_span, spans_meet, storage_key
from .collectives import WRITTEN_ARGUMENT, written_tensors
from .fused_writes import WRITES_BY_ATEN_SCHEMA, WRITES_RUNNING_STATS, running_stats_written
from .state import NOT_RETURNED
from ..tree import tensor_leaves

Tensor = torch.Tensor
inplace_cache: dict = dict.fromkeys(WRITTEN_ARGUMENT, True)  # collectives write their output argument
# Normalisations that may update running statistics in their kernel: truthy, so the hot path asks.
_RUNNING_STATS = "running statistics"
inplace_cache.update(dict.fromkeys(WRITES_RUNNING_STATS, _RUNNING_STATS))
# Torch's operators and functions written in C: made once, holding nothing of a model.
_LASTING_TYPES = (OpOverload, OpOverloadPacket, types.BuiltinFunctionType, types.MethodDescriptorType,
                  types.WrapperDescriptorType, types.MethodWrapperType, types.ClassMethodDescriptorType)


def predicts_inplace(func) -> bool:
    """Whether ``func`` writes its first argument by name (``add_``, ``__iadd__``, ``__setitem__``)."""
    return write_verdict(func) is True


def write_verdict(func):
    """``func``'s entry in ``inplace_cache``, made on first ask: True when it writes its first argument and
    returns it (by name, or, for an operator called through ``torch.ops``, by schema), the ``(position,
    name)`` pairs of the arguments an operator's schema declares written otherwise, False when it writes none."""
    verdict = inplace_cache.get(func)
    if verdict is not None:
        return verdict
    if not _lasting(func):
        return _passing_verdict(func)
    verdict = inplace_cache[func] = _verdict_of(func)
    return verdict


def _lasting(func) -> bool:
    """Whether ``func`` lasts as long as the program: one of torch's operators, a function written in C (but
    one bound to a tensor or a module), or a function defined at the top of a module or class.  A function made
    inside another (a model's own, whose closure may hold the model or its tensors), a bound method (which
    holds its object) or a callable object (a compiled submodule's call) may not, and a process-wide cache
    must not keep it alive."""
    if isinstance(func, _LASTING_TYPES):
        return not isinstance(getattr(func, "__self__", None), (Tensor, torch.nn.Module))
    return type(func) is types.FunctionType and "<locals>" not in func.__qualname__


def _verdict_of(func):
    if isinstance(func, (OpOverload, OpOverloadPacket)):
        return _operator_writes(func)
    return writes_first_argument(func)


# The verdict of a function inplace_cache must not hold (``_lasting``), kept for as long as it lives; computed on
# each ask for one that takes no weak reference.
_passing_verdict = per_object(_verdict_of)


def _operator_writes(op):
    """An operator's verdict, read from its schema whatever its name: a custom op named as torch names its
    in-place functions (``fill_``) that returns nothing, or a tensor of its own, does not return what it
    wrote, and may write another argument than its first."""
    written = _schema_writes(op)
    returned = [r for schema in _schemas(op) for r in schema.returns]  # (of any overload, for a packet)
    if written and [position for position, _ in written] == [0] and any(
            r.alias_info is not None and r.alias_info.is_write for r in returned):
        return True  # it returns the first argument it wrote (aten.add_.Tensor), as add_ by name does
    return written


def _schemas(op) -> list:
    if isinstance(op, OpOverloadPacket):
        return [getattr(op, overload)._schema for overload in op.overloads()]
    return [op._schema]


def _schema_writes(func):
    """The arguments an operator called through ``torch.ops`` declares it writes (``Tensor(a!)``: a
    ``torch.library.custom_op`` with ``mutates_args``, a ``torch.library.define`` schema), whatever its
    name, as ``(position, name)`` pairs (position None for a keyword-only one), or False.  ``out`` is left
    to the keyword rule every call follows."""
    if not isinstance(func, (OpOverload, OpOverloadPacket)):
        return False
    written = {}
    for schema in _schemas(func):
        for k, argument in enumerate(schema.arguments):
            alias = argument.alias_info
            if alias is not None and alias.is_write and argument.name != "out":
                written[(None if argument.kwarg_only else k, argument.name)] = None
    return tuple(written) or False


def _note_kernel_writes_by_schema() -> None:
    """Give each torch-level function of ``WRITES_BY_ATEN_SCHEMA`` the verdict of its aten schema, whose
    ``Tensor(a!)`` arguments the function's own signature hides."""
    for name in WRITES_BY_ATEN_SCHEMA:
        func, packet = getattr(torch, name, None), getattr(torch.ops.aten, name, None)
        if func is not None and packet is not None:
            inplace_cache[func] = _schema_writes(packet)


_note_kernel_writes_by_schema()


def schema_written(verdict: tuple, args, kwargs) -> list:
    """The tensors a ``torch.ops`` call writes by its schema (``verdict``, from ``_schema_writes``), in order."""
    found = []
    for position, name in verdict:
        value = args[position] if position is not None and position < len(args) else kwargs.get(name)
        if isinstance(value, Tensor):
            found.append(value)
        elif type(value) in (list, tuple):  # Tensor(a!)[]
            found.extend(t for t in value if isinstance(t, Tensor))
    return found


def protect_before_write(st, func, args, kwargs) -> None:
    """Copy-on-write: a predicted in-place write must not alter an activation saved earlier."""
    inplace = inplace_cache.get(func)
    if inplace is None:
        inplace = write_verdict(func)
    if inplace is _RUNNING_STATS:
        for t in running_stats_written(func, args, kwargs):
            st.protect_saved(t)
        return
    if type(inplace) is tuple:  # an operator whose schema names what it writes
        st.protect_saved_all(schema_written(inplace, args, kwargs))
        return
    if func in WRITTEN_ARGUMENT:  # a collective: where it writes, not always its first argument (gather's list)
        st.protect_saved_all([t for _, t in written_tensors(func, args, kwargs)])
        return
    if inplace or kwargs.get("inplace"):
        target = _first_argument(args, kwargs)
        if isinstance(target, Tensor):
            st.protect_saved(target)
        elif type(target) in (list, tuple):  # a list written whole (_foreach_add_, dist.all_gather)
            st.protect_saved_all(target)
    elif "out" in kwargs:
        st.protect_saved_all(kwargs["out"])


class Written(list):
    """The tensor arguments a call wrote, with ``outputs``: for each, its position among the call's outputs
    (a call returns what it writes by name, in order: ``add_`` its first argument, ``_foreach_add_`` each
    tensor of its list, ``out=(values, indices)`` those two), or None for an argument written only through
    another one the call writes by name (``a`` in ``torch.max(a, 1, out=(a[:, :1], i))``): what it holds
    then is no output of the call; and ``by_schema``: whether the call is an operator whose schema names the
    arguments it writes (a custom op's ``mutates_args``), which are its outputs only when it returns None.  A
    write not made by name (a fused kernel's, a compiled submodule's) has the position of the written tensor among
    the tensors the call returned, or ``NOT_RETURNED`` when it returned others."""

    __slots__ = ("outputs", "by_schema")


def written_arguments(func, args, kwargs, versions, out=None):
    """The tensor arguments the call wrote (version counter moved, or by name for inference tensors and for
    the ``torch.distributed`` collectives, which write their result without moving the version counter), as a
    ``Written``, or None.  ``out``: what the call returned."""
    written = None
    by_name = func in WRITTEN_ARGUMENT
    for v, before in versions:
        moved = before is not None and v._version != before
        if moved or (before is None or by_name) and _predicted_write(func, args, kwargs, v):
            if written is None:
                written = Written()
            written.append(v)
    if written is None:
        return None
    if len(written) > 1:
        written = Written(_without_views_only_read(func, args, kwargs, written))
    written.outputs = _output_positions(func, args, kwargs, written, out)
    written.by_schema = type(write_verdict(func)) is tuple and "out" not in kwargs
    return written


def _output_positions(func, args, kwargs, written: list, out) -> list:
    """``Written.outputs``: where each written tensor is among the call's outputs.  A write not made by name
    (a fused kernel's, a compiled submodule's writing its input) is found among the tensors the call returned
    (``out``), by identity; it is ``NOT_RETURNED`` when the call returned other tensors."""
    targets = named_targets(func, args, kwargs)
    if not targets:
        returned = [t for _, t in tensor_leaves(out)]
        return [next((k for k, r in enumerate(returned) if r is t), NOT_RETURNED) for t in written]
    # A tensor listed twice (``_foreach_add_([a, a], 1)``) was last written by its last place.
    return [max((k for k, u in enumerate(targets) if u is t), default=None) for t in written]


def named_targets(func, args, kwargs) -> list:
    """The tensors ``func`` writes by name, in the order it returns them: its first argument (each tensor
    of it, for a list) when it writes in place, else its ``out=`` tensors, else the arguments its schema
    says it writes."""
    if func in WRITTEN_ARGUMENT:  # where each collective writes (gather its second argument, lists whole)
        return [t for _, t in written_tensors(func, args, kwargs)]
    verdict = write_verdict(func)
    if type(verdict) is tuple and "out" not in kwargs:
        return schema_written(verdict, args, kwargs)
    if verdict is True or kwargs.get("inplace"):
        first = _first_argument(args, kwargs)
    else:
        first = kwargs.get("out")
    if isinstance(first, Tensor):
        return [first]
    if type(first) in (list, tuple):
        return [t for t in first if isinstance(t, Tensor)]
    return []


def _without_views_only_read(func, args, kwargs, written: list) -> list:
    """``written`` less the arguments that only share a version counter with the one the call writes by
    name: views of one base share its counter, so ``b += a`` for two halves of one tensor moves ``a``'s
    version too, though no byte of ``a`` changed.  An argument is kept when the write may reach its bytes,
    or when no argument written by name shares its storage (its counter moved for a reason of its own)."""
    targets = [t for t in written if _predicted_write(func, args, kwargs, t)]
    if not targets:
        return written
    reached = [(storage_key(t), memory_span(t)) for t in targets]
    kept = []
    for t in written:
        key = storage_key(t)
        sharing = [span for k, span in reached if k == key]
        if any(t is u for u in targets) or not sharing or any(spans_meet(span, memory_span(t)) for span in sharing):
            kept.append(t)
    return kept


def _first_argument(args, kwargs):
    """The argument an in-place function writes: its first, by position, or by keyword when none is
    positional, as torch's Python-level in-place functions hand it on (``nn.init.constant_`` passes
    ``tensor=``)."""
    if args:
        return args[0]
    return next(iter(kwargs.values()), None)


def _predicted_write(func, args, kwargs, t) -> bool:
    """Whether ``func`` writes ``t`` by name: how writes to inference tensors (no version counter), and a
    collective's writes (which move none), are known."""
    if func in WRITTEN_ARGUMENT:
        return any(u is t for _, u in written_tensors(func, args, kwargs))
    if _first_argument(args, kwargs) is t and (predicts_inplace(func) or kwargs.get("inplace")):
        return True
    verdict = write_verdict(func)
    if type(verdict) is tuple and any(u is t for u in schema_written(verdict, args, kwargs)):
        return True
    out = kwargs.get("out")
    return out is t or (isinstance(out, (tuple, list)) and any(o is t for o in out))
