"""``ModuleCall`` (one forward call of one module) and ``Module`` (one module object)."""

from __future__ import annotations


class ModuleCall:
    """One call of a module's forward: ``features.2:1`` is the first call of ``features.2``."""

    __slots__ = ("_trace", "index", "module", "call_index", "parent", "children", "start_ns", "end_ns",
                 "_input_nodes", "_output_nodes", "_op_list")

    def __init__(self, trace, index, module, call_index, parent, start_ns, end_ns, inputs, outputs):
        self._trace = trace
        self.index = index
        self.module = module
        self.call_index = call_index
        self.parent = parent
        self.children = []
        self.start_ns = start_ns
        self.end_ns = end_ns
        self._input_nodes = inputs
        self._output_nodes = outputs
        self._op_list = None  # filled for every call of the trace on first use (Trace._fill_module_ops)

    @property
    def _op_nodes(self) -> list:
        """Indices of every op run inside this call, nested calls included, in execution order."""
        if self._op_list is None:
            self._trace._fill_module_ops()
        return self._op_list

    @_op_nodes.setter
    def _op_nodes(self, nodes: list) -> None:
        self._op_list = nodes

    @property
    def address(self) -> str:
        return self.module.address

    @property
    def label(self) -> str:
        return f"{self.module.address}:{self.call_index}"

    @property
    def depth(self) -> int:
        depth, call = 0, self.parent
        while call is not None:
            depth, call = depth + 1, call.parent
        return depth

    @property
    def duration(self):
        """Host wall time of the whole call in seconds (None if the call never returned)."""
        return (self.end_ns - self.start_ns) / 1e9 if self.end_ns is not None else None

    @property
    def input_ops(self) -> list:
        labels = self._trace._labels
        return [labels[i] for i in self._input_nodes if i >= 0]

    @property
    def output_ops(self) -> list:
        labels = self._trace._labels
        return [labels[i] for i in self._output_nodes if i >= 0]

    @property
    def grad(self):
        """d loss / d (this call's output): a tensor, or a tuple for a call with several outputs."""
        from .grads import module_call_grad

        return module_call_grad(self)

    @property
    def saved_for_backward_bytes(self) -> int:
        """Bytes autograd packed for backward inside this call, nested calls included (distinct storages)."""
        from .grads import saved_for_backward_bytes

        return saved_for_backward_bytes(self._trace, self._op_nodes)

    @property
    def ops(self) -> list:
        """Every op run inside this call (``Op`` objects), nested calls included, in execution order."""
        ops = self._trace.ops
        return [ops[i] for i in self._op_nodes]

    @property
    def op_labels(self) -> list:
        """Labels of every op run inside this call, nested calls included, in execution order."""
        labels = self._trace._labels
        return [labels[i] for i in self._op_nodes]

    def __repr__(self) -> str:
        return f"<ModuleCall {self.label} ({self.module.class_name}, {len(self._op_nodes)} ops)>"


class Module:
    """One module object: its address(es), class, and every call made to it."""

    __slots__ = ("address", "all_addresses", "class_name", "calls", "param_names", "_ref")

    def __init__(self, address, all_addresses, class_name, param_names, module=None):
        self.address = address
        self.all_addresses = all_addresses
        self.class_name = class_name
        self.calls = []
        self.param_names = param_names
        self._ref = module

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    @property
    def call_labels(self) -> list:
        return [c.label for c in self.calls]

    def __getattr__(self, name):
        # Only reached for names the Module lacks: ``log['fc']`` on a module called several times.
        from .op import Op

        if not name.startswith("_") and hasattr(Op, name):
            calls = ", ".join(f"log[{label!r}]" for label in self.call_labels[:3])
            raise AttributeError(f"{name!r} belongs to one op, but {self.address} ran {self.num_calls} times, so "
                                 f"log[{self.address!r}] is the Module: read it from one call's output op: {calls}")
        raise AttributeError(f"'Module' object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"<Module {self.address} ({self.class_name}, {self.num_calls} call" \
               f"{'s' if self.num_calls != 1 else ''})>"
