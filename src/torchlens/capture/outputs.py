"""What a call produced, as records: the output tensors of a call and the record of each.

``output_leaves`` finds the tensors of a result that is not one tensor (a tuple, a structseq, a list, a
write into the receiver, a collective's output argument, the ``out=`` tensors of a call that returns
None, the arguments a ``torch.ops`` call that returns None declares it writes, the dict or dataclass a
compiled submodule's forward returns); ``record_output``
appends one output's record with every feature that may observe it (gradients, saving, finite flags).
The hot path inlines the common case, one tensor out.
"""

from __future__ import annotations

from weakref import ref as weakref

import torch

from ..record.layouts import shape_of
from ..tree import tensor_leaves
from .collectives import WRITTEN_ARGUMENT, written_tensors
from .compiled import CompiledCall
from .writes import schema_written, write_verdict

Tensor = torch.Tensor
_setitem = Tensor.__setitem__


def output_leaves(func, out, args, kwargs):
    """``(slot, tensor)`` for each tensor a call produced when its result is not one tensor, or None
    when it produced none (only tensor-producing calls are ops)."""
    if func is _setitem:  # returns None but writes its receiver
        return ((None, args[0]),)
    if type(func) is CompiledCall:  # what a compiled submodule's forward returns: dicts and dataclasses too
        return _compiled_leaves(out)
    if isinstance(out, (tuple, list)):
        return _tensor_leaves(out)
    if func in WRITTEN_ARGUMENT:  # a torch.distributed collective: its output is the tensor it wrote
        return written_tensors(func, args, kwargs)
    if out is None:
        return _written_without_result(func, args, kwargs)
    return None


def _written_without_result(func, args, kwargs):
    """The ``out=`` tensors of a call that returns None (``split_with_sizes_copy`` writes a list of them), or
    the arguments its schema says it writes (a custom op with ``mutates_args`` that returns nothing): what
    it produced.  None for any other call."""
    written = kwargs.get("out") if kwargs else None
    if written is None:
        verdict = write_verdict(func)
        if type(verdict) is tuple:
            written = schema_written(verdict, args, kwargs)
    if isinstance(written, Tensor):
        return ((None, written),)
    if isinstance(written, (tuple, list)):
        return _tensor_leaves(written) or None
    return None


def record_output(st, call_index: int, slot, t, func, module_call: int) -> None:
    """The record of one output tensor, with every feature that may observe it."""
    records = st.records
    index = len(records)
    requires_grad = t.requires_grad
    try:  # (a subclass, such as a jagged nested tensor, has its shape read by shape_of)
        shape = t.shape if type(t) is Tensor else shape_of(t)
    except RuntimeError:  # a nested tensor has no single shape
        shape = shape_of(t)
    grad_fn, node_type = grad_node(t) if requires_grad else (None, None)  # the node kept to the watch below
    records.append((call_index, slot, shape, t.dtype, t.device, requires_grad, node_type))
    try:
        version = t._version
    except RuntimeError:  # made under torch.inference_mode(): no version counter
        version = st.version(t)
    st.producers[id(t)] = (weakref(t), index, version)
    if func in WRITTEN_ARGUMENT:  # a collective's write moves no version counter: the base of a view must learn
        st.note_unversioned_write(t, index)
    if node_type is not None and st.grads is not None:  # tl.trace(..., grads=...): capture/grads.py
        st.grads.watch(index, t, func, module_call)
    save_mode = st.save_mode
    if save_mode and (save_mode == 1 or st.wants(func, module_call)):
        st.save(index, t, requires_grad)
    if st.finite_flags is not None:
        st.record_finite(index, t)


def grad_node(t) -> tuple:
    """``(t.grad_fn, its type)`` for a tensor that requires grad, read once: torch makes a new node object
    per read.  ``(None, None)`` where torch refuses the node: a view made under ``no_grad`` whose base was
    then written in place (``w[0].clamp_()`` in a ``no_grad`` block) raises on ``grad_fn``, and no backward
    can pass through it, so it is recorded without a node and not watched for gradients."""
    try:
        grad_fn = t.grad_fn
    except RuntimeError:
        return None, None
    return grad_fn, type(grad_fn)


def made_since(producers, t, first_record: int) -> bool:
    entry = producers.get(id(t))
    return entry is not None and entry[1] >= first_record and (entry[0] is t or entry[0]() is t)


def _compiled_leaves(out):
    """``(slot, tensor)`` for each tensor inside a compiled call's result, at any depth: slots as
    ``_tensor_leaves`` (and the compiled handler) give them inside tuples and lists, an index at the top."""
    leaves = [(path[0] if len(path) == 1 and type(path[0]) is int else path, t) for path, t in tensor_leaves(out)]
    return leaves or None


def _tensor_leaves(out, prefix=()):
    """(slot path, tensor) for each tensor inside a (possibly nested) tuple/list result."""
    leaves = []
    for i, item in enumerate(out):
        if isinstance(item, Tensor):
            leaves.append((prefix + (i,) if prefix else i, item))
        elif isinstance(item, (tuple, list)):
            leaves.extend(_tensor_leaves(item, (prefix + (i,)) if prefix else (i,)))
    return leaves
