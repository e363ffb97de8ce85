"""``Param`` and ``Buffer``: the model's tensors that ops read, as records (never graph nodes for params).

Like every record, each is a view made on demand over a row the trace holds (see record/modules.py)."""

from __future__ import annotations

import functools
from typing import NamedTuple

from .columns import Kind
from .layouts import version_of
from .view import View, row_field
from ..errors import counted, first_few
from ..tree import shape_or_none


def listed_params(trace):
    """``trace.params``; none for a trace loaded from a file that predates the parameter table (io/params.py), whose
    ``log.params`` refuses rather than list none."""
    return trace.params if trace._params_listed else ()


class ParamRow:
    """One parameter's data, as the trace holds it."""

    __slots__ = ("address", "shape", "dtype", "requires_grad", "users")

    def __init__(self, address, shape, dtype, requires_grad):
        self.address = address
        self.shape = tuple(shape) if shape is not None else None  # None: uninitialized (lazy)
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.users: list = []  # indices of the ops that used it, in execution order


class ParamState(NamedTuple):
    """What a ``Param`` record reads from a parameter: as the forward saw it, or as a file saved it."""

    shape: tuple | None  # None for a lazy module's parameter not yet initialized: it has no shape
    dtype: object
    requires_grad: bool


def param_states(model_params, replay) -> list:
    """``[(address, ParamState)]`` for a trace's ``(address, Parameter)`` list, as the forward ran: each one's
    ``requires_grad``, shape and dtype as read when it ended (``replay``'s ``ByParam``s), so a parameter frozen,
    cast (``model.half()``) or resized in place since keeps what its ops saw; read now where ``replay`` is None.
    A lazy module's parameter its forward never initialized (``nn.LazyLinear`` never called) has shape None."""
    if replay is None:
        return [(address, ParamState(shape_or_none(p), p.dtype, p.requires_grad)) for address, p in model_params]
    flags, layouts = replay.param_requires_grad.get, replay.param_layouts.get
    return [(address, ParamState(shape, dtype, flags(id(p), p.requires_grad)))
            for address, p in model_params for shape, dtype in (layouts(id(p)) or (shape_or_none(p), p.dtype),)]


def changed_since_trace(trace) -> list:
    """Addresses of the traced model's parameters changed since the forward ended: written in place (an optimizer
    step: their version counters moved), or given other data of another shape or dtype (``model.half()``,
    ``resize_token_embeddings``).  Empty for a trace that holds no live model, or no versions."""
    replay = trace._replay
    if replay is None or trace._model_params is None:
        return []
    return [address for address, p in trace._model_params if changed_since(replay, p)]


def changed_since(replay, p) -> bool:
    """Whether parameter ``p`` changed since the forward ``replay`` belongs to ended: its version counter moved,
    or its shape or dtype is not the one the forward read (no counter moves for data replaced by ``p.data =``)."""
    now = version_of(p)  # None for an inference tensor: no counter, so no write can be seen
    layout = replay.param_layouts.get(id(p))
    return replay.param_versions.get(id(p), now) != now or (
        layout is not None and (layout[0] != p.shape or layout[1] != p.dtype))


class BufferRow:
    """One buffer's data, as the trace holds it."""

    __slots__ = ("address", "nodes")

    def __init__(self, address):
        self.address = address
        self.nodes: list = []  # indices of its buffer ops, in order of first use


class Param(View):
    """One parameter of the traced model and the ops that used it (a view over the trace's row)."""

    __slots__ = ()

    @property
    def _row(self) -> ParamRow:
        return self._trace._param_rows[self.index]

    address = row_field("address", "The parameter's address in the model (``fc.weight``).")
    shape = row_field("shape", "Its shape as the forward ended (a resize in place since does not change it); None "
                               "for a lazy module's parameter its forward never initialized (``nn.LazyLinear`` "
                               "never called), which has none yet.")
    dtype = row_field("dtype", "Its dtype as the forward ended (``model.half()`` since does not change it).")
    requires_grad = row_field("requires_grad", "Whether it required grad when the forward ran.")

    @property
    def numel(self) -> int | None:
        """The number of elements of the parameter; None for an uninitialized one (its shape is None)."""
        if self._row.shape is None:
            return None
        n = 1
        for d in self._row.shape:
            n *= d
        return n

    @property
    def module_address(self) -> str:
        """The address of the module holding it (``self`` for the model's own)."""
        return self._row.address.rpartition(".")[0] or "self"

    @property
    def grad(self):
        """The parameter's own ``.grad`` after a backward (what the optimizer would read); refused once the model
        was cast or resized (``model.half()``), which gives the ``.grad`` another dtype or shape than the traced one."""
        from .grads import param_grad

        row = self._row
        layout = None if row.shape is None else (row.shape, row.dtype)
        return param_grad(self._trace, row.address, self.index, layout)

    @property
    def ops(self) -> list:
        """The ops that used this parameter (``Op`` objects), in execution order."""
        from .op import Op

        return [Op(self._trace, i) for i in self._row.users]

    @property
    def op_labels(self) -> list:
        """Labels of the ops that used this parameter, in execution order."""
        labels = self._trace._labels
        return [labels[i] for i in self._row.users]

    def __repr__(self) -> str:
        shape = "uninitialized" if self.shape is None else tuple(self.shape)
        return f"<Param {self.address} {shape}, used by {counted(len(self._row.users), 'op')}>"


class Buffer(View):
    """One buffer of the traced model: the nodes where it was read (a view over the trace's row)."""

    __slots__ = ()

    @property
    def _row(self) -> BufferRow:
        return self._trace._buffer_rows[self.index]

    address = row_field("address", "The buffer's address in the model (``bn.running_mean``).")

    @property
    def ops(self) -> list:
        """The buffer's nodes (``Op`` objects of kind ``"buffer"``), in order of first use."""
        from .op import Op

        return [Op(self._trace, i) for i in self._row.nodes]

    @property
    def op_labels(self) -> list:
        """Labels of the buffer's nodes (``buffer_k:1``), in order of first use."""
        labels = self._trace._labels
        return [labels[i] for i in self._row.nodes]

    @property
    def readers(self) -> list:
        """Labels of the ops that read the buffer."""
        trace = self._trace
        children, labels = trace._children(), trace._labels
        return [labels[c] for i in self._row.nodes for c in children[i]]

    def __repr__(self) -> str:
        return f"<Buffer {self.address}, read by {counted(len(self.readers), 'op')}>"


def build_params(trace, states) -> list:
    """Param rows from ``[(address, ParamState)]`` (None for a loaded trace without the table)."""
    if states is None:
        return []
    rows = {address: ParamRow(address, p.shape, p.dtype, p.requires_grad) for address, p in states}
    for op_index, addresses in trace._param_addresses.items():
        for address in dict.fromkeys(addresses):  # an op passing one parameter twice uses it once
            if address in rows:
                rows[address].users.append(op_index)
    return list(rows.values())


def build_buffers(trace) -> list:
    rows: dict = {}
    for i, kind in enumerate(trace._kind):
        if kind == Kind.BUFFER:
            address = trace._io[i]
            rows.setdefault(address, BufferRow(address)).nodes.append(i)
    return list(rows.values())


def bypassed_call_hint(trace, address: str) -> str:
    """For a module address that made no module call: the ops that used its parameters, when there are any
    (its forward was called as ``module.forward(...)``, or by a ``__call__`` its class overrides, which bypasses
    nn.Module's ``__call__``), or ''."""
    prefix = address + "."
    users = [op for op in trace.ops if any(p.startswith(prefix) for p in op.params)]
    if not users:
        return ""
    shown = first_few((op.label for op in users), 4)
    whole_operators = _whole_operator_names()
    if any(op.func_name in whole_operators for op in users):
        return (f" (module {address!r} made no module call, but ops used its parameters: {shown}; a module called "
                "inside a body of torch.cond, while_loop, map or scan runs inside that one op, whose interior is "
                "unseen, so it has no module call or module site: name that op by its label)")
    return (f" (module {address!r} made no module call, but ops used its parameters: {shown}; a forward called "
            "as module.forward(...) directly, or by a __call__ its class overrides, bypasses nn.Module's __call__, so "
            "it has no module call, hooks or module site: name those ops by their labels)")


@functools.cache
def _whole_operator_names() -> frozenset:
    """The function names of the higher-order ops recorded as one op each (``cond``, ``while_loop``, ...)."""
    from ..capture.fastpath import OPERATORS_WHOLE

    return frozenset(operator.name() for operator in OPERATORS_WHOLE)
