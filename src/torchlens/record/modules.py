"""``ModuleCall`` (one forward call of one module) and ``Module`` (one module object).

Both are views made on demand, like ``Op``: the trace holds each call's and each module's data as a row
(``CallRow``, ``ModuleRow``), and a view is a (trace, index) pair over one row.  No record the trace holds
points back at the trace, so a trace nobody refers to any more is freed at once by reference counting,
with its activations, its output and the autograd graph that output holds, instead of waiting for the
cycle collector.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from .view import View, row_field
from ..errors import counted


_UNREGISTERED = "<unregistered "


def unregistered_address(class_name: str, number: int) -> str:
    """The address a trace gives the ``number``-th module it met that is not in the model (made inside a
    forward, as T5 makes its loss, or held outside the model)."""
    return f"{_UNREGISTERED}{class_name} #{number}>"


def enclosing_calls(m: int, parent_of, stop=()) -> list:
    """Module call ``m`` and each call around it, innermost first (empty for -1, the root forward): the one
    walk up the module-call tree.  ``parent_of(k)`` is call ``k``'s enclosing call (-1 at the root): the
    ``module_call_parents`` column's ``__getitem__`` (bind the column once: each read builds it), or the rows'.
    The walk ends before the first call in ``stop`` (calls whose answer a caller has already built)."""
    chain = []
    while m >= 0 and m not in stop:
        chain.append(m)
        m = parent_of(m)
    return chain


def is_unregistered(address: str) -> bool:
    return address.startswith(_UNREGISTERED)


def shown_class(module) -> type:
    """The class a trace shows for ``module``: for a ``torch.compile`` wrapper, the class it wraps."""
    # ``in`` and indexing, not ``.get``: a TorchScript module's ``_modules`` is a mapping without it.
    children = module._modules
    return type(children["_orig_mod"] if "_orig_mod" in children else module)


class CallRow(NamedTuple):
    """One module call's data, as the trace holds it."""

    module: int  # index of the called module among the trace's modules
    number: int  # the call's number among that module's calls, from 1
    parent: int  # the enclosing module call's index, -1 in the root forward
    start_ns: int
    end_ns: int | None  # as the call ended: it returned, or an exception or a stop_after= stop left it
    inputs: tuple  # op indices of the tensors the caller passed (-1: of unknown origin)
    outputs: tuple  # op indices of the tensors the caller received


class ModuleRow:
    """One module's data, as the trace holds it."""

    __slots__ = ("address", "all_addresses", "class_name", "param_names", "calls", "ref")

    def __init__(self, address, all_addresses, class_name, param_names, ref=None):
        self.address = address
        self.all_addresses = all_addresses
        self.class_name = class_name
        self.param_names = param_names
        self.calls: list = []  # indices of its calls, in order
        self.ref = ref  # the live module (None for a loaded or cleaned-up trace)


class ModuleCall(View):
    """One call of a module's forward: ``features.2:1`` is the first call of ``features.2``."""

    __slots__ = ()

    @property
    def _row(self) -> CallRow:
        return self._trace._call_rows[self.index]

    @property
    def module(self) -> "Module":
        """The ``Module`` this is a call of."""
        return Module(self._trace, self._row.module)

    call_index = row_field("number", "Which call of its module this is, from 1 (``fc:2`` has call_index 2).")

    @property
    def parent(self):
        """The enclosing ``ModuleCall``, or None for a call made from the root forward."""
        parent = self._row.parent
        return ModuleCall(self._trace, parent) if parent >= 0 else None

    @property
    def children(self) -> list:
        """The calls made directly inside this one, in order."""
        return [ModuleCall(self._trace, c) for c in self._trace._call_children()[self.index]]

    start_ns = row_field("start_ns", "``perf_counter_ns()`` as the call began.")
    end_ns = row_field("end_ns", "``perf_counter_ns()`` as the call ended: as it returned, or as an exception (the "
                       "forward caught) or a ``stop_after=`` stop left it.")
    _input_nodes = row_field("inputs")
    _output_nodes = row_field("outputs")

    @property
    def _op_nodes(self) -> list:
        """Indices of every op run inside this call, nested calls included, in execution order."""
        return self._trace._call_ops()[self.index]

    @property
    def _num_ops(self) -> int:
        """How many ops ran inside this call, nested calls included (``len(_op_nodes)``, without building it)."""
        return call_op_counts(self._trace)[self.index]

    @property
    def address(self) -> str:
        """Its module's address (``features.2``)."""
        return self._trace._module_rows[self._row.module].address

    @property
    def label(self) -> str:
        """``{address}:{call_index}`` (``features.2:1``), its key in the trace."""
        row = self._row
        return f"{self._trace._module_rows[row.module].address}:{row.number}"

    @property
    def depth(self) -> int:
        """How deep the call is nested: 0 for a call the model's forward made."""
        return call_depths(self._trace)[self.index]

    @property
    def duration(self):
        """Host wall time of the whole call in seconds: until it returned, or until an exception or a ``stop_after=``
        stop left it (``Trace.caveats`` names the calls an exception left)."""
        row = self._row
        return (row.end_ns - row.start_ns) / 1e9 if row.end_ns is not None else None

    @property
    def input_ops(self) -> list:
        """Labels of the ops whose tensors the call was given."""
        labels = self._trace._labels
        return [labels[i] for i in self._row.inputs if i >= 0]

    @property
    def output_ops(self) -> list:
        """Labels of the ops holding the tensors the call returned, its first output first."""
        labels = self._trace._labels
        return [labels[i] for i in self._row.outputs if i >= 0]

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
        from .op import Op

        trace = self._trace
        return [Op(trace, i) for i in self._op_nodes]

    @property
    def op_labels(self) -> list:
        """Labels of every op run inside this call, nested calls included, in execution order."""
        labels = self._trace._labels
        return [labels[i] for i in self._op_nodes]

    def __getattr__(self, name):
        # Only reached for names a ModuleCall lacks: ``log['fc:1']`` is the call itself when it has no output op.
        from .op import Op

        if not name.startswith("_") and hasattr(Op, name):
            raise op_field_refusal(self, name, "the ModuleCall")
        raise AttributeError(f"'ModuleCall' object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"<ModuleCall {self.label} ({self.module.class_name}, {counted(self._num_ops, 'op')})>"


class Module(View):
    """One module object: its address(es), class, and every call made to it."""

    __slots__ = ()

    @property
    def _row(self) -> ModuleRow:
        return self._trace._module_rows[self.index]

    address = row_field("address", "The module's address (``encoder.layers.0``); its first, when it has several.")
    all_addresses = row_field("all_addresses", "Every address the module is registered under, first name first.")
    class_name = row_field("class_name", "The module's class name (``Linear``).")
    param_names = row_field("param_names", "The names of the module's own parameters (``weight``, ``bias``).")

    _ref = row_field("ref")  # the live module, while the trace holds it

    @property
    def calls(self) -> list:
        """Every call of this module (``ModuleCall`` objects), in order."""
        trace = self._trace
        return [ModuleCall(trace, c) for c in self._row.calls]

    @property
    def num_calls(self) -> int:
        """How many times the forward called this module."""
        return len(self._row.calls)

    @property
    def call_labels(self) -> list:
        """The labels of its calls (``fc:1``, ``fc:2``)."""
        address, rows = self._row.address, self._trace._call_rows
        return [f"{address}:{rows[c].number}" for c in self._row.calls]

    def __getattr__(self, name):
        # Only reached for names the Module lacks: ``log['fc']`` on a module called several times.
        from .op import Op

        if not name.startswith("_") and hasattr(Op, name) and self.num_calls == 1:
            raise op_field_refusal(self.calls[0], name, "the Module", self.address)
        if not name.startswith("_") and hasattr(Op, name):
            calls = ", ".join(f"log[{label!r}]" for label in self.call_labels[:3])
            raise AttributeError(f"{name!r} belongs to one op, but {self.address} ran {self.num_calls} times, so "
                                 f"log[{self.address!r}] is the Module: read it from one call's output op: {calls}")
        raise AttributeError(f"'Module' object has no attribute {name!r}{self._not_the_module_note(name)}", name=name,
                             obj=self)

    def _not_the_module_note(self, name: str) -> str:
        """For a name the traced ``nn.Module`` has (``log['fc'].weight``): that this is the trace's record of it, and
        where the module is; the bare refusal read as if the model's module lacked it."""
        module = self._ref
        if name.startswith("_") or module is None or not hasattr(module, name):
            return ""
        record = f": this is the trace's record of the {self.class_name} (its calls, address and class), not the module"
        if is_unregistered(self.address):
            return f"{record}, which is no submodule of the model (made inside the forward, or held outside the model)"
        return f"{record}; the module is model.get_submodule({'' if self.address == 'self' else self.address!r})"

    def __repr__(self) -> str:
        return f"<Module {self.address} ({self.class_name}, {counted(self.num_calls, 'call')})>"


def op_field_refusal(call: ModuleCall, name: str, record: str, key: str | None = None) -> AttributeError:
    """The error for an op's field ``name`` read from the Module or ModuleCall (``record``) of ``call``, reached as
    ``log[key]``: where that value is, its output op, or why the call has none (a ``stop_after=`` stop ended the
    forward inside it, or it returned no op's value)."""
    label = call.label
    outputs = call.output_ops
    if outputs:
        return AttributeError(f"{name!r} belongs to one op, and this is {record} of {label}: read it from the call's "
                              f"output op, log[{label!r}] ({outputs[0]})")
    return AttributeError(f"{name!r} belongs to one op, but {label} {no_output_reason(call)}, so "
                          f"log[{key or label!r}] is {record}: read it from an op inside the call or one reading its "
                          "output")


def no_output_reason(call: ModuleCall) -> str:
    """Why ``call`` has no output op: a ``stop_after=`` stop ended the forward inside it, or it returned no op's
    value."""
    trace = call._trace
    if trace.stopped_after is not None and call.label in calls_cut_short(trace):
        return f"never returned: the forward stopped after {trace.stopped_after} inside it (stop_after=)"
    return ("returned no op's value (no tensor, tensors no op of the trace made, or tensors written through a view or "
            "their base after the op that made them)")


def calls_cut_short(trace) -> set:
    """The labels of the module calls a ``stop_after=`` stop ended inside, in a stopped trace: open as its last op
    was made, they never returned, so they have no output."""
    if not trace.ops:
        return set()
    around_stop = set(trace.ops[-1].modules)
    return {mc.label for mc in trace.module_calls if mc.label in around_stop and not mc._output_nodes}


def call_children(rows) -> list:
    """Each module call's direct children (call indices, in order), from the parents of ``rows``."""
    children: list = [[] for _ in rows]
    for k, row in enumerate(rows):
        if row.parent >= 0:
            children[row.parent].append(k)
    return children


def call_depths(trace) -> list:
    """Each module call's depth (0: called from the root forward), derived once per trace in one pass: a
    call's parent is recorded before it.  Walking each call's chain up cost the depth per call, the depth
    squared over a deep nest of modules."""
    if trace._call_depths_col is None:
        depths: list = []
        for row in trace._call_rows:
            depths.append(depths[row.parent] + 1 if row.parent >= 0 else 0)
        trace._call_depths_col = depths
    return trace._call_depths_col


def rolled_up(own: list, parents: list) -> list:
    """Each module call's ``own`` value summed over itself and every call inside it (``parents``: each call's
    enclosing call, -1 at the root), in one pass from the last call back, as a call's parent is recorded
    before it: adding each op's value into every call around it cost the depth per op."""
    totals = list(own)
    for k in range(len(totals) - 1, -1, -1):
        if parents[k] >= 0:
            totals[parents[k]] += totals[k]
    return totals


def inclusive_totals(trace, values) -> list:
    """Each module call's sum of ``values`` (one per op, by op index) over the ops it ran, nested calls
    included: each op's value added to its innermost call, then rolled up the calls (``rolled_up``)."""
    own = [0] * len(trace._call_rows)
    for m, value in zip(trace._module_call, values):
        if m >= 0:
            own[m] += value
    return rolled_up(own, trace.module_call_parents)


def call_op_counts(trace) -> list:
    """How many ops each module call ran, nested calls included, derived once per trace (``inclusive_totals``),
    where the length of each call's list of ops (``call_ops``) put every op in every call around it."""
    if trace._call_op_counts_col is None:
        trace._call_op_counts_col = inclusive_totals(trace, itertools.repeat(1))
    return trace._call_op_counts_col


def call_ops(rows, op_module_calls) -> list:
    """Each module call's op indices, nested calls included, in execution order: one pass over the ops."""
    ops: list = [[] for _ in rows]
    parent_of = [row.parent for row in rows].__getitem__
    for i, m in enumerate(op_module_calls):
        for k in enclosing_calls(m, parent_of):
            ops[k].append(i)
    return ops


_SCRIPT_CLASSES = frozenset(["RecursiveScriptModule", "TopLevelTracedModule", "TracedModule"])


def script_modules(trace) -> dict:
    """``{address: module call indices}`` of the TorchScript modules the forward called, outermost only: they run
    their ops in TorchScript's interpreter, which capture cannot see, so no op of theirs is counted, nor known
    to be missing.  Told by the module (or, once a trace no longer holds it, by torch's class names for them)."""
    scripted = [m for m in trace.modules if isinstance(m._ref, torch.jit.ScriptModule)
                or m._ref is None and m.class_name in _SCRIPT_CLASSES]
    addresses = [m.address for m in scripted]
    return {m.address: m._row.calls for m in scripted
            if not any(m.address.startswith(f"{outer}.") for outer in addresses)}
