"""``Param`` and ``Buffer``: the model's tensors that ops read, as records (never graph nodes for params)."""

from __future__ import annotations

from .columns import Kind


class Param:
    """One parameter of the traced model and the ops that used it."""

    __slots__ = ("address", "shape", "dtype", "requires_grad", "_trace", "_users")

    def __init__(self, trace, address, shape, dtype, requires_grad):
        self._trace = trace
        self.address = address
        self.shape = tuple(shape)
        self.dtype = dtype
        self.requires_grad = requires_grad
        self._users = []

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def module_address(self) -> str:
        return self.address.rpartition(".")[0] or "self"

    @property
    def grad(self):
        """The parameter's own ``.grad`` after a backward (what the optimizer would read)."""
        from .grads import param_grad

        return param_grad(self._trace, self.address)

    @property
    def ops(self) -> list:
        """The ops that used this parameter (``Op`` objects), in execution order."""
        ops = self._trace.ops
        return [ops[i] for i in self._users]

    @property
    def op_labels(self) -> list:
        """Labels of the ops that used this parameter, in execution order."""
        return [self._trace._labels[i] for i in self._users]

    def __repr__(self) -> str:
        return f"<Param {self.address} {tuple(self.shape)}, used by {len(self._users)} ops>"


class Buffer:
    """One buffer of the traced model: the nodes where it was read."""

    __slots__ = ("address", "_trace", "_nodes")

    def __init__(self, trace, address):
        self._trace = trace
        self.address = address
        self._nodes = []

    @property
    def ops(self) -> list:
        """The buffer's nodes (``Op`` objects of kind ``"buffer"``), in order of first use."""
        ops = self._trace.ops
        return [ops[i] for i in self._nodes]

    @property
    def op_labels(self) -> list:
        """Labels of the buffer's nodes (``buffer_k:1``), in order of first use."""
        return [self._trace._labels[i] for i in self._nodes]

    @property
    def readers(self) -> list:
        children = self._trace._children()
        return [self._trace._labels[c] for i in self._nodes for c in children[i]]

    def __repr__(self) -> str:
        return f"<Buffer {self.address}, read by {len(self.readers)} ops>"


def build_params(trace, model_params) -> list:
    """Param records from the model's ``(address, parameter)`` list (None for a loaded trace)."""
    if model_params is None:
        return []
    records = {address: Param(trace, address, p.shape, p.dtype, p.requires_grad) for address, p in model_params}
    for op_index, addresses in trace._param_addresses.items():
        for address in addresses:
            if address in records:
                records[address]._users.append(op_index)
    return list(records.values())


def build_buffers(trace) -> list:
    records: dict = {}
    for i, kind in enumerate(trace._kind):
        if kind == Kind.BUFFER:
            address = trace._io[i]
            records.setdefault(address, Buffer(trace, address))._nodes.append(i)
    return list(records.values())
