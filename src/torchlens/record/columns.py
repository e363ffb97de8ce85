"""The record model, declared in one place: every raw field capture writes and every column a ``Trace`` holds.

Capture (``capture/mode.py``) appends plain tuples on the hot path, since building a named tuple there
would cost a Python call per op.  ``record.finalize`` converts each raw call to a ``Call`` once, after
the forward; from then on every reader uses the field names below (a named-tuple attribute read costs
what an index read costs).  The field order is the raw tuple's order, so positional code keeps working.

Nothing here imports from the rest of torchlens: capture, record and every bridge import these names.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

import torch

# ``Record.call`` for a tensor no torch call made: a model input or a module buffer.
INPUT = -1
BUFFER = -2


class Kind(IntEnum):
    """What one op of a trace is (the ``Trace`` kind column; compares equal to its int)."""

    OP = 0  # an output of one torch call
    INPUT = 1  # a tensor handed to the model
    BUFFER = 2  # a module buffer the forward read
    OUTPUT = 3  # a tensor the model returned (a pseudo op whose one parent produced it)

    @property
    def label(self) -> str:
        """``"op"``, ``"input"``, ``"buffer"`` or ``"output"`` (``Op.kind``, the visualisation classes)."""
        return self.name.lower()


class Call(NamedTuple):
    """One tensor-producing torch call, as ``capture/mode.py`` recorded it (``trace.calls[c]``)."""

    func: Any  # the torch function or method called (None in a trace read by ``tl.load``)
    args: Any  # positional arguments with every tensor replaced by None (``tree.strip``)
    kwargs: Any  # keyword arguments, stripped the same way (None: none were passed)
    parents: tuple  # ((argument position, record index), ...): which record fed each tensor argument
    params: tuple  # ((argument position, Parameter), ...): parameters are metadata, not graph nodes
    module_call: int  # index of the innermost module call it ran in (-1: the root forward)
    code: Any  # code object of the user frame that made the call (None when none was found)
    line: Any  # instruction offset in ``code`` (``record.source.line_of`` turns it into a line)
    t0_ns: int  # perf_counter_ns() before the call
    t1_ns: int  # perf_counter_ns() after the call
    first_record: int  # index of the first record (op) it produced; its outputs are consecutive
    num_outputs: int  # how many tensors it produced
    wrote_arguments: bool  # whether it wrote a tensor argument (in place, ``out=``, a fused kernel)
    site: Any  # the nearest calling frame, with the user lines that called it (``capture/source.py``'s
    # ``user_site``), used to tell op sites apart


def is_first_output(trace, index: int) -> bool:
    """Whether op ``index`` is the first output of the torch call that made it (False for inputs, buffers and
    outputs, which no call made).  A call that returned several tensors ran once: what belongs to the call (its
    duration, FLOPs, the bytes autograd saved, a replay, a collective's row) is counted on this output alone, so
    that ``hot_path``, ``summary``, ``to_pandas`` and the viewer's nodes all count it once, on the same op."""
    c = trace.call_indices[index]
    return c >= 0 and trace.calls[c].first_record == index


def per_example_ops(trace) -> frozenset:
    """The ops that ran inside ``torch.vmap`` on its batched tensors, whose recorded shapes are one example's (the
    kernels ran on the whole batch): each call capture saw read such a tensor from outside the trace (vmap makes
    them below ``__torch_function__``), and every op reading one of theirs.  vmap's results reach the forward as
    new tensors of unknown origin too, so nothing after the transform descends from an op inside it."""
    calls, found = trace._per_example_calls, set()
    if not calls:
        return frozenset()
    for index, parents in enumerate(trace.op_parents):  # parents come before the ops that read them
        c = trace.call_indices[index]
        if (c in calls and any(p < 0 for _, p in parents)) or any(p in found for _, p in parents):
            found.add(index)
    return frozenset(found)


# Index of each ``Call`` field, for code that still reads the raw tuple before finalize.
(CALL_FUNC, CALL_ARGS, CALL_KWARGS, CALL_PARENTS, CALL_PARAMS, CALL_MODULE_CALL, CALL_CODE, CALL_LINE, CALL_T0_NS,
 CALL_T1_NS, CALL_FIRST_RECORD, CALL_NUM_OUTPUTS, CALL_WROTE_ARGUMENTS, CALL_SITE) = range(len(Call._fields))


class Record(NamedTuple):
    """One tensor capture saw: produced by a call, or a source (``CaptureState.records[r]``, raw)."""

    call: int  # the producing call's index, or INPUT / BUFFER for a source tensor
    slot: Any  # None for a call's output; the input path (``input.x``) or the buffer address for sources
    shape: Any  # torch.Size
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    requires_grad: bool
    grad_fn_class: Any  # type(t.grad_fn) or None


RECORD_CALL, RECORD_SLOT = 0, 1


class OpMeta(NamedTuple):
    """The tensor metadata of one op (``Trace`` meta column: ``Record`` without its first two fields).

    Most ops of a trace share a handful of these; finalize keeps one object of each."""

    shape: Any  # torch.Size
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    requires_grad: bool
    grad_fn_class: Any  # type(t.grad_fn) or None (read by ``tl.load``: a stand-in holding only its ``__name__``)


class ModuleCallRaw(NamedTuple):
    """The layout of one raw module call (``CaptureState.module_calls[m]``).

    Capture keeps these as lists it fills in as the call runs (its outputs are known last), so they are
    read by the ``MODULE_CALL_*`` indexes below; ``record.finalize`` turns each into a ``ModuleCall``."""

    module: Any  # the nn.Module called
    parent_call: int  # index of the enclosing module call (-1: called from the root forward)
    t0_ns: int  # perf_counter_ns() on entry
    t1_ns: int  # perf_counter_ns() on exit
    input_records: list  # record index of each tensor passed in (-1: one capture never saw made)
    output_records: list  # record index of each tensor returned


(MODULE_CALL_MODULE, MODULE_CALL_PARENT, MODULE_CALL_T0_NS, MODULE_CALL_T1_NS, MODULE_CALL_INPUTS,
 MODULE_CALL_OUTPUTS) = range(len(ModuleCallRaw._fields))

_INPLACE_DUNDERS = frozenset(
    ["__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
     "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"]
)


# Ops whose output is uninitialized memory: its contents are undefined, so neither replay (validate/) nor
# a comparison across ranks (distributed/compare.py) may read anything into them.
UNINITIALIZED_FUNCS = frozenset(["empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                                 "new_empty_strided", "empty_quantized", "_empty_affine_quantized",
                                 "_empty_per_channel_affine_quantized"])
# Ops that only select, reshape or copy values: what they read from uninitialized memory stays undefined.
_MOVES = frozenset(["__getitem__", "view", "reshape", "transpose", "permute", "t", "unsqueeze",
                    "squeeze", "flatten", "unflatten", "movedim", "narrow", "select", "split", "chunk", "unbind",
                    "expand", "as_strided", "contiguous", "clone", "detach"])
# Ops that carry their first argument's values into another dtype, device or shape: undefined bits stay undefined.
# Only that argument counts: ``x.type_as(buf)``, ``x.to(buf)`` or ``x.view_as(buf)`` reads no more of ``buf`` than
# its dtype, device or shape.
_CONVERSIONS = frozenset(["to", "type", "type_as", "float", "half", "double", "bfloat16", "cpu", "cuda",
                          "view_as", "reshape_as", "expand_as"])

# torch.distributed collective name -> (position, keyword) of the argument it writes: what capture records as
# the call's output (capture/collectives.py), and what a whole write below overwrites.
COLLECTIVE_WRITES = {
    "broadcast": (0, "tensor"), "all_reduce": (0, "tensor"), "all_reduce_coalesced": (0, "tensors"),
    "reduce": (0, "tensor"), "recv": (0, "tensor"), "irecv": (0, "tensor"), "all_gather": (0, "tensor_list"),
    "all_gather_single": (0, "output_tensor"), "all_gather_into_tensor": (0, "output_tensor"),
    "all_gather_coalesced": (0, "output_tensor_lists"), "gather": (1, "gather_list"), "scatter": (0, "tensor"),
    "reduce_scatter": (0, "output"), "reduce_scatter_single": (0, "output"), "reduce_scatter_tensor": (0, "output"),
    "all_to_all_single": (0, "output"), "all_to_all": (0, "output_tensor_list"),
}

# In-place calls that write every element of the argument they write, by the (position, keyword) of that
# argument: what they leave in a whole allocation of uninitialized memory is defined when what they read is
# (dist.all_gather into a list of empty_like buffers, a copy_ into torch.empty).  Every collective but reduce and
# gather, which write the result on their destination rank alone; those that also read it: _READ_AND_WRITTEN.
_WHOLE_WRITES = {"copy_": (0, "self"), "fill_": (0, "self"), "zero_": (0, "self"),
                 **{name: where for name, where in COLLECTIVE_WRITES.items() if name not in ("reduce", "gather")}}
_OUT = (None, "out")  # a call given out=: see _whole_write_target
# Collectives among those that also read the tensor they write: all_reduce sums what every rank's holds,
# broadcast sends its source rank's (there it reads the tensor; elsewhere it writes it whole, unread).
_READ_AND_WRITTEN = frozenset(["all_reduce", "all_reduce_coalesced", "broadcast"])


def makes_uninitialized(op) -> bool:
    """Whether ``op`` returns uninitialized memory: ``torch.empty`` and kin, and the legacy ``Tensor.new`` given
    sizes (``x.new(2, 3)``, ``x.new(torch.Size([2, 3]))``: Reformer's LSH attention), which allocates as
    ``new_empty`` does; given data (``x.new([1., 2.])``) it copies them, so it is defined."""
    if op.func_name in UNINITIALIZED_FUNCS:
        return True
    if op.func_name != "new" or not op.args or len(op.args) < 2:
        return False
    sizes = op.args[1:]
    return isinstance(sizes[0], torch.Size) or all(type(n) is int for n in sizes)


def uninitialized_ops(trace, through_writes: bool) -> set:
    """Indices of the records whose values are uninitialized memory: an op of ``torch.empty`` and kin, a view or
    copy of such a value (``x.new_empty(n, m).t()``), and an output record returning one.  ``through_writes``:
    also an in-place op writing into one, which may fill it only in part (DeepSeek-V3 writes two slices of a
    ``new_empty``); a reader that must not leave out a value a ``fill_`` or ``copy_`` made whole passes False."""
    undefined = set()
    kinds, parents = trace.kinds, trace.op_parents
    for i in range(len(kinds)):
        if kinds[i] == Kind.OUTPUT:
            if any(p in undefined for _, p in parents[i]):
                undefined.add(i)
            continue
        if kinds[i] != Kind.OP:
            continue
        op = trace.ops[i]
        if makes_uninitialized(op) or _converts_undefined(op, parents[i], undefined) or \
                (op.func_name in _MOVES or through_writes and op.is_inplace) \
                and any(p in undefined for _, p in parents[i]) and not _fills_whole(trace, op, undefined):
            undefined.add(i)
    return undefined


def _converts_undefined(op, parents, undefined: set) -> bool:
    """Whether ``op`` converts uninitialized memory to another dtype or device (``torch.empty(n).float()``)."""
    return op.func_name in _CONVERSIONS and any(position == 0 and p in undefined for position, p in parents)


def _fills_whole(trace, op, undefined: set) -> bool:
    """Whether in-place ``op`` wrote every element of the uninitialized memory it read, from defined values: all
    it read that is undefined is an allocation it overwrote whole (``overwritten_allocations``)."""
    if _whole_write_target(trace, op) is None:
        return False
    overwritten = overwritten_allocations(trace, op)
    return all(p in overwritten for _, p in trace.op_parents[op.index] if p in undefined)


def overwritten_allocations(trace, op) -> set:
    """Indices of the allocations of uninitialized memory (``torch.empty`` and kin) that in-place ``op`` writes
    whole, every element (``_whole_write_target``), and reads nowhere else: their old bits are not read.  A view
    of one is only part of its base (a later read of the base names ``op``), so it is not among them."""
    written = _whole_write_target(trace, op)
    if written is None:
        return set()
    found, read = set(), set()
    for position, p in trace.op_parents[op.index]:
        if _head(position) not in written:
            read.add(p)  # torch.add(buf, 1, out=buf) reads the bits it then overwrites
        elif p >= 0 and trace.kinds[p] == Kind.OP and makes_uninitialized(trace.ops[p]):
            found.add(p)
    return found - read


def _head(position):
    """The argument a parent position names: an int or a keyword, before any path into a list or dict."""
    return position[0] if isinstance(position, tuple) else position


def _whole_write_target(trace, op):
    """The ``(position, keyword)`` of the argument in-place ``op`` writes every element of, or None: those of
    ``_WHOLE_WRITES``, and ``out=``, into which torch's out= variants write their whole result (resizing it first
    when its shape differs) without reading what it held."""
    if not op.is_inplace:
        return None
    written = _WHOLE_WRITES.get(op.func_name)
    if written is not None and op.func_name in _READ_AND_WRITTEN and _reads_its_target(trace, op):
        return None  # it read what it overwrote: an undefined tensor stays undefined (all_reduce(torch.empty(n)))
    if written is None and any(_head(position) == "out" for position, _ in trace.op_parents[op.index]):
        return _OUT
    return written


def _reads_its_target(trace, op) -> bool:
    """Whether a collective of ``_READ_AND_WRITTEN`` read the tensor it wrote on this rank: always, but for a
    broadcast whose source (``src``, a world rank, or ``group_src``, a rank of ``group``) is another rank.  A
    source that cannot be told is taken as this rank's: what the broadcast left is then not counted as defined."""
    if op.func_name != "broadcast":
        return True
    args, kwargs = op.args or (), op.kwargs or {}
    src = kwargs.get("src") if "src" in kwargs else args[1] if len(args) > 1 else None
    if src is None and type(kwargs.get("group_src")) is int:
        src = _world_rank(kwargs.get("group"), kwargs["group_src"])
    return type(src) is not int or src == trace.rank


def _world_rank(group, rank: int):
    """The world rank of ``group``'s rank ``rank`` (the default group's when ``group`` is None), or None when the
    group can no longer tell (destroyed since the trace)."""
    if group is None:
        return rank
    import torch.distributed as dist

    try:
        return dist.get_global_rank(group, rank)
    except (RuntimeError, ValueError):
        return None


def writes_first_argument(func) -> bool:
    """Whether ``func`` writes its first argument by name (``add_``, ``__iadd__``, ``__setitem__``, and the
    overloads of such an operator called directly: ``torch.ops.aten.add_.Tensor`` is named ``add_.Tensor``)."""
    name = getattr(func, "__name__", "").partition(".")[0]
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))
