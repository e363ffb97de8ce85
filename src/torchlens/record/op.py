"""``Op`` (one execution of one torch call output) and ``Layer`` (all passes of one op site).

Both are light views over the columns a ``Trace`` holds: creating one costs an object with two slots,
and every field is read from (or derived from) the trace's columns on demand.
"""

from __future__ import annotations

import torch

from .columns import Kind
from .layouts import numel_of, shape_text
from .model_index import is_packed_weight
from .modules import enclosing_calls
from .source import source_of
from ..tree import container_items
from .view import OfATrace, View
from ..errors import ActivationUnavailable, counted

# The kinds under their former names (record/columns.py declares them).
KIND_OP, KIND_INPUT, KIND_BUFFER, KIND_OUTPUT = Kind.OP, Kind.INPUT, Kind.BUFFER, Kind.OUTPUT


def _packed_arguments(values) -> set:
    """ids of the packed weights among ``values`` and the lists in them (a quantized LSTM takes a list)."""
    found = set()
    for value in values:
        items = () if is_packed_weight(value) else container_items(value, False) or ()
        found.update(id(v) for v in (value, *(v for _, v in items)) if is_packed_weight(v))
    return found


class Op(View):
    """One tensor produced by one torch call (or a model input, buffer or output).  Its fields are listed, with
    what each means, in docs/tracing.md ("What every op records")."""

    __slots__ = ()

    # ----- addressing ----------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """Its address, ``{type}_{typeIndex}_{layerIndex}:{pass}`` (``linear_1_1:2``; see docs/labels.md)."""
        return self._trace._labels[self.index]

    @property
    def layer_label(self) -> str:
        """The label of its layer, every pass of one op site (``linear_1_1``)."""
        return self._trace._layer_labels[self.index]

    @property
    def pass_index(self) -> int:
        """Which pass of its layer this op is, from 1."""
        return self._trace._pass[self.index]

    @property
    def num_passes(self) -> int:
        """How many passes its layer ran in the forward."""
        return self._trace._group_size[self._trace._group[self.index]]

    @property
    def layer(self) -> "Layer":
        """Its ``Layer``: every pass of its op site."""
        return Layer(self._trace, self._trace._layer_labels[self.index])

    @property
    def type(self) -> str:
        """The torch function's name, lowercased, underscores removed (``maxpool2d``, ``getitem``)."""
        return self._trace._types[self.index]

    @property
    def kind(self) -> str:
        """``"op"``, ``"input"``, ``"buffer"`` or ``"output"``."""
        return Kind(self._trace._kind[self.index]).label

    @property
    def is_input(self) -> bool:
        """Whether it is an input of the forward (``input_1``)."""
        return self._trace._kind[self.index] == Kind.INPUT

    @property
    def is_output(self) -> bool:
        """Whether it is an output of the forward (``output_1``)."""
        return self._trace._kind[self.index] == Kind.OUTPUT

    @property
    def is_buffer(self) -> bool:
        """Whether it is a buffer of the model as first read (``buffer_1``)."""
        return self._trace._kind[self.index] == Kind.BUFFER

    @property
    def io_path(self):
        """For inputs and outputs, where the tensor sat (``input.x``, ``output.logits``); for buffers, the
        buffer's address (``bn.running_mean``)."""
        return self._trace._io.get(self.index)

    # ----- the call ------------------------------------------------------------------------------
    @property
    def call(self):
        """The torch call that produced this tensor, as recorded (a ``record.columns.Call``: ``.func``,
        ``.parents``, ``.module_call`` ...), or None for inputs, buffers and outputs."""
        c = self._trace._call[self.index]
        return self._trace.calls[c] if c >= 0 else None

    _call = call.fget  # the internal spelling

    @property
    def func(self):
        """The torch function called, or None for an input, buffer or output."""
        call = self._call()
        return call.func if call is not None else None

    @property
    def func_name(self) -> str:
        """The torch function's raw name, as the model wrote it (``relu_``, ``__getitem__``)."""
        return self._trace._func_names[self.index]

    @property
    def args(self):
        """Non-tensor positional arguments, with ``None`` where a tensor was passed."""
        call = self._call()
        return call.args if call is not None else None

    @property
    def kwargs(self):
        """Non-tensor keyword arguments, with ``None`` where a tensor was passed."""
        call = self._call()
        return call.kwargs if call is not None else None

    @property
    def parents(self) -> list:
        """Labels of the ops whose outputs this op consumed, in argument order."""
        labels = self._trace._labels
        return [labels[p] for _, p in self._trace._parents[self.index] if p >= 0]

    @property
    def parent_arg_positions(self) -> dict:
        """``{position: parent label}``; a position is an int (positional argument), a keyword name, or
        a tuple: that int or name followed by the path inside the argument (``("tensors", 1)``)."""
        labels = self._trace._labels
        return {pos: labels[p] for pos, p in self._trace._parents[self.index] if p >= 0}

    @property
    def children(self) -> list:
        """Labels of the ops that consumed this op's output, in execution order."""
        labels = self._trace._labels
        return [labels[c] for c in self._trace._children()[self.index]]

    @property
    def params(self) -> tuple:
        """Addresses of the parameters this op used (``fc.weight``)."""
        return self._trace._param_addresses.get(self.index, ())

    @property
    def packed_params(self) -> tuple:
        """Addresses of the packed weights this op read (``0._packed_params._packed_params``): a quantized
        module's weight and bias, packed into one object that is not a tensor, so ``params`` cannot list them
        (``model.get_submodule("0").weight()`` unpacks one).  Found in the module call the op ran in, so
        empty on a trace read by ``tl.load``, which holds no modules; a cleaned-up trace answers what ``cleanup``
        found before it released them."""
        if self._trace._cleaned:
            return self._trace._packed_col.get(self.index, ())
        packed = _packed_arguments((*(self.args or ()), *(self.kwargs or {}).values()))
        call = self.module_call
        module = call.module._ref if call is not None else self._trace.model
        if not packed or not isinstance(module, torch.nn.Module):
            return ()
        prefix = f"{call.address}." if call is not None and call.address != "self" else ""
        return tuple(f"{prefix}{name}.{attr}" if name else f"{prefix}{attr}"
                     for name, sub in module.named_modules() for attr, value in vars(sub).items()
                     if id(value) in packed)

    @property
    def multi_output_index(self):
        """Position of this tensor in a call that returned several (``None`` for single outputs)."""
        return self._trace._slot[self.index]

    @property
    def is_inplace(self) -> bool:
        """Whether this tensor is an argument the call wrote: the receiver of ``add_`` or ``x[i] = v``, an
        ``out=`` tensor, each tensor of an in-place list call (``torch._foreach_add_``) or of ``out=(v, i)``."""
        return self._trace._inplace[self.index]

    @property
    def unattributed_args(self) -> int:
        """How many tensor arguments came from nowhere capture saw (a tensor made outside the trace)."""
        return sum(1 for _, p in self._trace._parents[self.index] if p < 0)

    # ----- the tensor ----------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        """The output tensor's shape, as a tuple."""
        return tuple(self._trace._meta[self.index].shape)

    @property
    def dtype(self):
        """The output tensor's dtype."""
        return self._trace._meta[self.index].dtype

    @property
    def device(self):
        """The output tensor's device."""
        return self._trace._meta[self.index].device

    @property
    def requires_grad(self) -> bool:
        """Whether the output tensor required grad."""
        return self._trace._meta[self.index].requires_grad

    @property
    def grad_fn(self):
        """Name of the autograd node that produced the tensor (``AddmmBackward0``), or None."""
        cls = self._trace._meta[self.index].grad_fn_class
        # A leaf that requires grad (a parameter an op returns as it is: ``w.float()``) is recorded with None's type,
        # which capture reads as "watch its gradient" (a refused node is None): it has no node.
        return cls.__name__ if cls is not None and cls.__name__ != "NoneType" else None

    @property
    def numel(self) -> int:
        """The number of elements of the output tensor."""
        return numel_of(self._trace._meta[self.index].shape)

    @property
    def nbytes(self) -> int:
        """The bytes of the output tensor (``numel`` times the dtype's size)."""
        dtype = self.dtype
        size = dtype.itemsize if hasattr(dtype, "itemsize") else 0
        return self.numel * size

    @property
    def has_activation(self) -> bool:
        """Whether the trace holds this op's output (``save=`` chose it, and it was not dropped since)."""
        trace = self._trace
        trace.drop_written((self.index,))
        return self.index in trace._activations

    @property
    def dropped_reason(self):
        """Why the value saved for this op was dropped (changed or freed behind capture's back, during the
        trace or since), or None."""
        trace = self._trace
        trace.drop_written((self.index,))
        return trace._dropped.get(self.index)

    @property
    def activation(self):
        """The saved output tensor (detached), or None when it was not saved (``save=`` left it out, or
        ``max_saved_bytes`` was spent); one dropped since, or any after ``cleanup()``, raises
        ``ActivationUnavailable`` saying why."""
        trace = self._trace
        if trace._cleaned:
            raise ActivationUnavailable(f"{self.label}: the trace was cleaned up; its activations are gone")
        reason = self.dropped_reason
        if reason is not None:
            raise ActivationUnavailable(f"{self.label}: the saved activation was dropped: {reason}")
        return trace._activations.get(self.index)

    @property
    def intervention(self):
        """What an intervention applied here (``.site``, ``.action``), or None; ``activation`` is then the
        value downstream ops saw and ``original`` the value the op made."""
        return self._trace._applied_at(self.index)

    @property
    def original(self):
        """The value this op made before an intervention changed it (when saved), else None.  A loaded trace
        whose folder could not hold it (a dtype no file format encodes, ``activations=False``) says why."""
        trace = self._trace
        if trace._cleaned:
            raise ActivationUnavailable(f"{self.label}: the trace was cleaned up; its activations are gone")
        why = trace._originals_unsaved.get(self.index)
        if why is not None:
            raise ActivationUnavailable(f"{self.label}: the value before the intervention was dropped: {why}")
        return trace._originals.get(self.index)

    @property
    def grad(self):
        """d loss / d (this op's output), accumulated over the backwards seen (``grads=True``); None before
        a backward reached it or when ``grads=[...]`` did not select it.  An op that can have none (made under
        ``torch.no_grad()``, an integer result, a trace taken without ``grads=``) raises ``GradientUnavailable``
        saying why.  See docs/gradients.md."""
        from .grads import grad_of

        return grad_of(self._trace, self.index)

    @property
    def has_grad(self) -> bool:
        """Whether a gradient reached this op's output (``grads=``; see docs/gradients.md)."""
        from .grads import has_grad

        return has_grad(self._trace, self.index)

    @property
    def saved_for_backward_bytes(self) -> int:
        """Bytes of the distinct storages autograd packed for backward while running this op."""
        from .grads import op_saved_for_backward_bytes

        return op_saved_for_backward_bytes(self._trace, self.index)

    @property
    def finite(self):
        """``(has_nan, has_inf)`` recorded during capture (``record_finite=True``), else None."""
        return self._trace._finite.get(self.index)

    # ----- where and when ------------------------------------------------------------------------
    @property
    def module_call(self):
        """The innermost ``ModuleCall`` this op ran in (None in the root forward)."""
        m = self._trace._module_call[self.index]
        return self._trace.module_calls[m] if m >= 0 else None

    @property
    def module_address(self):
        """Address of the innermost module this op ran in (``features.2``), or None in the root forward."""
        trace = self._trace
        m = trace._module_call[self.index]
        return trace._module_rows[trace._call_rows[m].module].address if m >= 0 else None

    @property
    def module(self):
        """The innermost module call's label (``features.2:1``), or None in the root forward: the former
        spelling of ``op.module_call.label``, kept for one release (docs/labels.md)."""
        call = self.module_call  # that call alone: ``modules`` would name every call around it
        return call.label if call is not None else None

    @property
    def modules(self) -> tuple:
        """Module call labels containing this op, outer to inner."""
        trace = self._trace
        rows, modules = trace._call_rows, trace._module_rows
        chain = enclosing_calls(trace._module_call[self.index], lambda k: rows[k].parent)
        return tuple(f"{modules[rows[k].module].address}:{rows[k].number}" for k in reversed(chain))

    @property
    def source(self):
        """The user's call site (``.file``, ``.line``, ``.function``, ``.code``), or None."""
        call = self._call()
        return source_of(call.code, call.line) if call is not None else None

    @property
    def duration(self):
        """Host wall time of the torch call in seconds (instrumented: for ranking, not quoting)."""
        call = self._call()
        return (call.t1_ns - call.t0_ns) / 1e9 if call is not None else None

    @property
    def start_ns(self):
        """Host clock (``perf_counter_ns``) at the start of the torch call, or None for an input, buffer or output."""
        call = self._call()
        return call.t0_ns if call is not None else None

    def __repr__(self) -> str:
        shape = shape_text(self.shape)
        call = self.module_call
        where = f" in {call.label}" if call is not None else ""
        dtype = str(self.dtype).replace('torch.', '')
        if self.call is None:  # an input, buffer or output: no function made it here, its place names it
            return f"<Op {self.label} {self.io_path or self.kind} ({shape}, {dtype}){where}>"
        return f"<Op {self.label} {self.func_name}({shape}, {dtype}){where}>"


_PER_PASS = frozenset(["label", "pass_index", "activation", "parents", "children", "duration", "index",
                       "has_activation", "dropped_reason", "parent_arg_positions", "module_call", "module", "modules",
                       "start_ns", "finite", "args", "kwargs", "grad", "has_grad",
                       "saved_for_backward_bytes", "call", "intervention", "original"])
# Fields the passes of a layer usually share (they ran one line of code on tensors of one kind, in one module):
# a layer answers them when every pass agrees, and raises naming two passes that differ otherwise (a key/value
# cache that grows with each decoding step, a weight used on two lines, a root module's forward run again by
# a recursion, whose first pass is in no module call; a loop whose first pass reads a tensor from outside the
# trace and the others what the loop made).
_SHARED_WHEN_EQUAL = frozenset(["shape", "dtype", "device", "requires_grad", "grad_fn", "numel", "nbytes",
                                "source", "module_address", "unattributed_args"])


class Layer(OfATrace):
    """Every pass of one op site; a single-pass layer answers any ``Op`` field itself."""

    __slots__ = ("_trace", "layer_label", "_indices")

    def __init__(self, trace, layer_label: str):
        self._trace = trace
        self.layer_label = layer_label
        self._indices = trace._layer_index()[layer_label]

    @property
    def ops(self) -> list:
        """Every pass of this layer (``Op`` objects), in execution order."""
        trace = self._trace
        return [Op(trace, i) for i in self._indices]

    @property
    def op_labels(self) -> list:
        """The label of every pass, in pass order (as on every record that has ``.ops``)."""
        labels = self._trace._labels
        return [labels[i] for i in self._indices]

    @property
    def num_passes(self) -> int:
        """How many passes this layer ran in the forward."""
        return len(self._indices)

    @property
    def first(self) -> Op:
        """Its first pass (``Op``)."""
        return Op(self._trace, self._indices[0])

    @property
    def duration(self):
        """Host wall time of every pass, summed (instrumented, as ``Op.duration``); None for a layer whose ops
        made no torch call (an input, output or buffer), which has no time, not a time of zero."""
        times = [op.duration for op in self.ops if op.duration is not None]
        return sum(times) if times else None

    @property
    def grads(self) -> list:
        """The gradient of every pass, in pass order (see ``Op.grad``): None for a pass that can have none
        beside passes that can (see ``record.grads.passes_grads``)."""
        from .grads import passes_grads

        return passes_grads(self._trace, self._indices)

    def __getattr__(self, name):
        if name.startswith("_") or not hasattr(Op, name):  # named as the Layer's, not as its first pass's
            raise AttributeError(f"'Layer' object has no attribute {name!r}", name=name, obj=self)
        if len(self._indices) > 1:
            if name in _PER_PASS:
                raise AttributeError(
                    f"layer {self.layer_label} has {len(self._indices)} passes, so {name!r} differs per pass: "
                    f"use log['{self.layer_label}:1'].{name} or layer.ops[k].{name}"
                )
            if name in _SHARED_WHEN_EQUAL:
                return self._shared(name)
        return getattr(self.first, name)

    def __dir__(self):
        """What tab completion offers: the layer's own attributes and the ``Op`` fields it answers, every one for a
        single pass; for several, those ``__getattr__`` answers (none that differs per pass, and a field the passes
        share only when they agree on it), so that no name offered raises when read."""
        answered = {name for name in dir(Op) if not name.startswith("_")}
        if len(self._indices) > 1:
            answered -= _PER_PASS
            answered -= {name for name in _SHARED_WHEN_EQUAL if not self._agrees(name)}
        return sorted({*super().__dir__(), *answered})

    def _agrees(self, name) -> bool:
        """Whether every pass has the same ``name`` (``_shared`` answers it)."""
        try:
            self._shared(name)
        except AttributeError:
            return False
        return True

    def _shared(self, name):
        """``name`` of every pass when they all agree; an ``AttributeError`` naming two that differ."""
        ops = self.ops
        first = getattr(ops[0], name)
        for op in ops[1:]:
            value = getattr(op, name)
            if value != first:
                raise AttributeError(
                    f"layer {self.layer_label}: {name!r} differs between its passes ({ops[0].label}: {first}, "
                    f"{op.label}: {value}): use log['{op.label}'].{name} or layer.ops[k].{name}"
                )
        return first

    def __eq__(self, other):
        return type(other) is Layer and other._trace is self._trace and other.layer_label == self.layer_label

    def __hash__(self):
        return hash((id(self._trace), "layer", self.layer_label))

    def __repr__(self) -> str:
        first = self.first
        made_by = first.func_name if first.call is not None else (first.io_path or first.kind)
        return f"<Layer {self.layer_label} ({made_by}, {counted(self.num_passes, 'pass', 'passes')})>"
