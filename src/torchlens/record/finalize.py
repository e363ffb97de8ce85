"""Turn the raw lists one forward filled into a ``Trace``.

``finalize`` reads, when the forward ends, only what can change afterwards: which op produced each
returned tensor (weak references and version counters) and its metadata, what was saved, the class of
each called module (a parametrization swaps it later), the parameters' versions for replay and their
addresses.  Every column (kinds, parents, module records, pass groups, labels) is derived from the raw
lists on first read, a group at a time, by ``RawRecord`` (see ``record.derived``): a trace nobody
reads pays for none of it, and one that is read pays once, in flat linear passes.  The raw lists it
reads are final once the forward returned: calls and records are tuples, arguments are held by value
(``tree.strip``), parameters and modules by reference until ``Trace.cleanup`` derives every column.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain, compress
from operator import itemgetter
from typing import TYPE_CHECKING

import torch

from ..labels.naming import func_name_of, op_label, type_of_name, with_passes
from ..labels.passes import group_ops
from ..tree import path_text
from ..tree import tensor_leaves
from .columns import (CALL_FIRST_RECORD, CALL_FUNC, CALL_KWARGS, CALL_MODULE_CALL, CALL_NUM_OUTPUTS, CALL_PARAMS,
                      CALL_PARENTS, CALL_WROTE_ARGUMENTS, INPUT, MODULE_CALL_INPUTS, MODULE_CALL_MODULE,
                      MODULE_CALL_OUTPUTS, MODULE_CALL_PARENT, MODULE_CALL_T0_NS, MODULE_CALL_T1_NS, RECORD_CALL,
                      RECORD_SLOT, Kind, OpMeta, writes_first_argument)
from .finite import drained_flags
from .layouts import param_layouts, param_versions, requires_grad_flags, shape_of
from .model_index import ModelIndex, fsdp_params, offloaded_address
from .module_table import params_by_module
from .modules import CallRow, ModuleRow, shown_class, unregistered_address
from .replay_context import UNSEEN_WRITE, ByParam, ReplayContext
from .trace import Trace

if TYPE_CHECKING:
    from ..capture.state import CaptureState

# Field readers for the raw tuples (C-level, for map and compress).
_RECORD_CALL, _RECORD_SLOT = itemgetter(RECORD_CALL), itemgetter(RECORD_SLOT)
_RECORD_META = itemgetter(slice(RECORD_SLOT + 1, None))  # a Record without its call and slot: an OpMeta's fields
_CALL_FUNC, _CALL_PARENTS = itemgetter(CALL_FUNC), itemgetter(CALL_PARENTS)
_CALL_MODULE_CALL = itemgetter(CALL_MODULE_CALL)
_CALL_PARAMS, _CALL_WROTE = itemgetter(CALL_PARAMS), itemgetter(CALL_WROTE_ARGUMENTS)
_MODULE = itemgetter(MODULE_CALL_MODULE)
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_NO_PARAMS = ByParam([], [])  # the versions, flags and layouts of a model without parameters (never changed)
# A named tuple made from its fields in C (``_made(OpMeta, fields)``): its own ``__new__`` is a Python call.
_made = tuple.__new__


def io_tensor_leaves(obj, path: str) -> list:
    """``(path text, tensor)`` for each tensor in a model input or output: ``tree.tensor_leaves`` with its
    paths written under ``path`` (``output.0.logits``), plain objects' attributes included (a key/value
    cache passed in or returned holds its tensors in attributes: ``output.past_key_values.layers.0.keys``).
    A module call's arguments are walked without attributes, on the hot path (capture/modules.py)."""
    return [(path_text(path, p), t) for p, t in tensor_leaves(obj, attrs=True)]


def finalize(state: CaptureState, model, output, model_name: str, timings: dict, index=None) -> Trace:
    index = index if index is not None else ModelIndex(model)
    calls = state.calls  # raw tuples: Trace.calls names them on first read
    # The producers of the returned tensors first: this may still add a buffer source (a returned buffer).
    if type(output) is torch.Tensor:  # the common case: the one leaf is the output itself, no loop
        producer = state.producer_of(output)
        outputs = [("output", producer, _made(OpMeta, (shape_of(output), output.dtype, output.device,
                                                        output.requires_grad, None)))]
        activations = dict(state.saved)
        _show_output(state, len(state.records), producer, output, activations)
    else:
        outputs, activations = _outputs(state, output)
    if state.parameter_inputs:
        _link_parameter_inputs(calls, state.parameter_inputs, index.param_addresses)
    raw = RawRecord(calls, state.records, outputs, state.module_calls, index, state.root)
    # Derived on first read (from the index the record keeps) unless a parameter outside the index is
    # named by its shape, read now (a later ``.data`` assignment could change it).
    param_addresses = None if _all_indexed(calls, index) else _param_addresses(calls, index, state.module_calls)
    finite = drained_flags(state.finite_flags) if state.finite_flags else {}
    # By position, in Trace's order: model_name, calls, activations, dropped, finite, param_addresses,
    # output, model, unattributed, timings, budget_exhausted_at, alias_reads, index, raw.
    trace = Trace(model_name, calls, activations, dict(state.clobbered), finite, param_addresses, output, model,
                  state.unattributed, timings, state.budget_exhausted_at, state.alias_reads, index, raw)
    if state.held_by_compiled:
        trace._held_by_compiled = state.held_by_compiled  # validate: whether replay reads what those ops read
    trace._saved_versions = state.saved_versions  # Trace.drop_written: a later write shows as a dropped value
    # and a later training forward, for BatchNorm statistics (its kernel moves no version)
    trace._batch_counted = state.batch_counted
    # Each module's parameters as the forward ran it (a module given parameters after the trace must not
    # count them in a table whose total is the forward's), listed once per model structure.
    if index.params_by_module is None:
        index.params_by_module = params_by_module(index)
    trace._params_by_module = index.params_by_module
    if state.own_outputs:
        trace._own_outputs = frozenset(state.own_outputs)
    if state.per_example_calls:
        trace._per_example_calls = frozenset(state.per_example_calls)
    if state.outside:  # tensors read from outside the trace: those a module holds as plain attributes, named
        alive = [t for t in (ref() for ref in state.outside.values()) if t is not None]
        trace._outside_attributes = tuple(index.attributes_holding(alive))
    # Replay checks that no parameter changed since: their versions now, by C-level passes.
    params, ids = index.param_objects
    versions = param_versions(params) if params else None
    if params:
        note_unseen_param_writes(state, params, versions)
        # Shared by the traces of unchanged parameters: a new list only where one changed since the last trace.
        index.param_layouts = param_layouts(params, index.param_layouts)
    trace._replay = _made(ReplayContext, (state.context, state.contexts, state.param_writes,
                                          ByParam(ids, versions) if params else _NO_PARAMS,
                                          ByParam(ids, requires_grad_flags(params)) if params else _NO_PARAMS,
                                          ByParam(ids, index.param_layouts) if params else _NO_PARAMS))
    return trace


def _outputs(state: CaptureState, output) -> tuple:
    """``(path, producer record, OpMeta)`` per tensor in ``output``, and the activations with theirs."""
    returned = [(path, state.producer_of(t), t) for path, t in io_tensor_leaves(output, "output")]
    first_output = len(state.records)  # the output pseudo ops follow the records
    outputs = []
    activations = dict(state.saved)
    for k, (path, producer, t) in enumerate(returned):
        outputs.append((path, producer, OpMeta(shape_of(t), t.dtype, t.device, t.requires_grad, None)))
        _show_output(state, first_output + k, producer, t, activations)
    return outputs, activations


def _link_parameter_inputs(calls: list, inputs: dict, model_params: dict) -> None:
    """Make a Parameter passed to the model as an input a parent of the calls that read it: the argument
    scan files every Parameter as parameter metadata, which would leave the input with no reader.  One that is
    also a parameter of the model (``model(x, model.fc.weight)``) stays among the call's parameters too, so that
    ``op.params`` still names every parameter of the model the op read (``fc.weight``)."""
    for c, call in enumerate(calls):
        params = call[CALL_PARAMS]
        if not params or not any(id(p) in inputs for _, p in params):
            continue
        read = tuple((position, inputs[id(p)]) for position, p in params if id(p) in inputs)
        kept = tuple((position, p) for position, p in params if id(p) not in inputs or id(p) in model_params)
        parents = tuple(sorted(tuple(call[CALL_PARENTS]) + read, key=_argument_order))
        calls[c] = (*call[:CALL_PARENTS], parents, kept, *call[CALL_PARAMS + 1:])


def _argument_order(edge) -> tuple:
    """Sort key of a ``(argument position, record)`` edge: positional arguments in order, then keywords."""
    position = edge[0]
    return (0, position, "") if isinstance(position, int) else (1, 0, str(position))


def _show_output(state: CaptureState, index: int, producer: int, t, activations: dict) -> None:
    """Give output node ``index`` the tensor it shows when its producer's is saved: the producer's, or ``t``
    itself when ``t`` was last written through a view or its base (``a.t().sub_(3); return a``): its
    producer, the writer, then made that alias, a tensor of another shape or layout.  A tensor no op made
    (a parameter returned as it is) shows itself when every tensor is saved.  When the producer's saved
    value was dropped, the output node reads as dropped, for the same reason."""
    if producer < 0:
        if state.save_mode == 1:
            _save_shown(state, index, t, activations)
        return
    dropped = state.clobbered.get(producer)
    if dropped is not None:
        state.clobbered[index] = dropped
    if producer not in activations and state.grads is None:
        return  # nothing shown, no gradient: whether it was written through a view does not matter
    aliased = state.written_through_alias(t)
    if aliased:  # its gradient, too, is its own (record/grads.py)
        if state.own_outputs is None:
            state.own_outputs = set()
        state.own_outputs.add(index)
    if producer not in activations:
        return
    if aliased:
        _save_shown(state, index, t, activations)
    else:
        activations[index] = activations[producer]
        state.saved_versions[index] = state.saved_versions.get(producer)


def _save_shown(state: CaptureState, index: int, t, activations: dict) -> None:
    """Save ``t`` itself as what output node ``index`` shows."""
    state.save(index, t, t.requires_grad)
    if index in state.saved:  # not over a max_saved_bytes budget
        activations[index] = state.saved[index]


def note_unseen_param_writes(state: "CaptureState", params: list, versions: list) -> None:
    """A parameter whose version moved during the forward with no write capture saw was written by a call
    torch hands no ``__torch_function__`` (``Tensor.set_``, which assigning a parametrized tensor makes on its
    original): its value at each op that read it is unknown, which replay must say rather than compare the
    value it holds now.  ``versions``: the parameters' versions as the forward ended."""
    before = state.param_versions_at_start
    if before is None or before == versions:  # (a C-level comparison: the common case)
        return
    for p, start, end in zip(params, before, versions):
        if start != end and id(p) not in state.param_writes:
            state.param_writes[id(p)] = [(UNSEEN_WRITE, None)]


class RawRecord:
    """The raw lists of one trace and what was read from live objects when it ended; ``Trace`` derives
    its columns from them on first read, one group at a time (``columns``, ``modules``, ``labels``:
    each returns ``{attribute: value}``)."""

    __slots__ = ("calls", "records", "outputs", "module_calls", "module_classes", "module_params", "index", "root")

    def __init__(self, calls: list, records: list, outputs: list, module_calls: list, index: ModelIndex,
                 root=None):
        self.calls = calls
        self.records = records
        self.outputs = outputs  # (path, producer record, OpMeta) per returned tensor
        self.module_calls = module_calls
        self.root = root  # the module traced: its call 1 is the trace itself, so its module calls count from 2
        # Each call's module class, as shown (a torch.compile wrapper: the class it wraps), read now: a
        # parametrization (torch.nn.utils.parametrize) swaps a module's class after the trace.
        if not module_calls:  # a model whose root calls no module: nothing to read
            self.module_classes, self.module_params, self.index = ([], []), {}, index
            return
        modules = list(map(_MODULE, module_calls))
        classes = list(map(type, modules))
        # Parameter names come from the index's walk; those of a module it has none for (the root, a module
        # outside the model) are read now.
        unwalked = index.unwalked(modules)
        if index.wrappers:  # the index's walk met a torch.compile wrapper: look at every module
            shown = list(map(shown_class, modules))
        elif unwalked:  # only a module the walk did not see can be one
            shown = [shown_class(m) if id(m) in unwalked else c for m, c in zip(modules, classes)]
        else:
            shown = classes
        self.module_classes = (classes, shown)
        self.module_params = {id(m): index.param_names_of(m) for m in modules if id(m) in unwalked} if unwalked else {}
        self.index = index

    def columns(self, trace) -> dict:
        """Each op's kind, call, slot, metadata, parents, module call, in-place flag; the io paths."""
        calls, records = self.calls, self.records
        n = len(records)
        call_col = list(map(_RECORD_CALL, records))
        slot_col = list(map(_RECORD_SLOT, records))
        kind = [Kind.OP] * n
        io = {}
        sources = [i for i, c in enumerate(call_col) if c < 0]  # model inputs and buffers: a few
        for i in sources:
            kind[i] = Kind.INPUT if call_col[i] == INPUT else Kind.BUFFER
            io[i] = slot_col[i]
            call_col[i], slot_col[i] = -1, None
        if calls:
            op_calls = list(map(calls.__getitem__, call_col))  # a source (call -1) reads the last call ...
            parents_col = list(map(_CALL_PARENTS, op_calls))
            module_col = list(map(_CALL_MODULE_CALL, op_calls))
            for i in sources:  # ... replaced here
                parents_col[i], module_col[i] = (), -1
        else:
            parents_col, module_col = [()] * n, [-1] * n
        inplace = [False] * n
        writes = None
        for call in compress(calls, map(_CALL_WROTE, calls)):  # the calls that wrote an argument: a few
            writes = writes or _receiver_writes()
            if writes(call):
                # Each output of such a call is an argument it wrote: its receiver, each tensor of an in-place
                # list call (``_foreach_add_``), each ``out=`` tensor (``torch.max(x, 1, out=(v, i))``).
                first = call[CALL_FIRST_RECORD]
                inplace[first:first + call[CALL_NUM_OUTPUTS]] = [True] * call[CALL_NUM_OUTPUTS]
        # Most ops share a handful of (shape, dtype, device, ...) rows: one OpMeta for each.
        named: dict = {}
        make = OpMeta._make
        meta = [named.get(row) or named.setdefault(row, make(row)) for row in map(_RECORD_META, records)]
        for path, producer, output_meta in self.outputs:
            io[len(kind)] = path
            kind.append(Kind.OUTPUT)
            call_col.append(-1)
            slot_col.append(None)
            parents_col.append(((0, producer),))
            module_col.append(-1)
            inplace.append(False)
            meta.append(output_meta)
        self.records = self.outputs = None  # read once
        return {"_kind": kind, "_call": call_col, "_slot": slot_col, "_meta": meta, "_parents": parents_col,
                "_module_call": module_col, "_inplace": inplace, "_io": io}

    def params(self, trace) -> dict:
        """Each op's parameter addresses, from the index (``finalize`` found every parameter used in it)."""
        return {"_param_addresses": _param_addresses(self.calls, self.index, self.module_calls)}

    def modules(self, trace) -> dict:
        """The module call and module rows (``record.modules``), from the module calls and the model index."""
        addresses, param_names_of, read_now = self.index.module_addresses, self.index.param_names_of, self.module_params
        classes, shown = self.module_classes
        by_id: dict = {}  # id(module) -> its index among the module rows
        module_rows, call_rows = [], []
        unregistered = 0
        for k, raw in enumerate(self.module_calls):
            module = raw[MODULE_CALL_MODULE]
            m = by_id.get(id(module))
            if m is None:
                names = addresses.get(id(module))
                if names is None:
                    unregistered += 1
                    names = [unregistered_address(classes[k].__name__, unregistered)]
                params = read_now.get(id(module))
                if params is None:
                    params = param_names_of(module)  # a copy, like list(names): the index is shared by traces
                m = by_id[id(module)] = len(module_rows)
                module_rows.append(ModuleRow(names[0], list(names), shown[k].__name__, params, module))
            calls = module_rows[m].calls
            calls.append(k)
            number = len(calls) + 1 if module is self.root else len(calls)
            call_rows.append(CallRow(m, number, raw[MODULE_CALL_PARENT], raw[MODULE_CALL_T0_NS],
                                     raw[MODULE_CALL_T1_NS], tuple(raw[MODULE_CALL_INPUTS]),
                                     tuple(raw[MODULE_CALL_OUTPUTS])))
        return {"_call_rows": call_rows, "_module_rows": module_rows}

    def labels(self, trace) -> dict:
        """Pass groups (``labels/passes.py``), types, function names and labels."""
        modules = list(map(_MODULE, self.module_calls))
        kind, call_col = trace._kind, trace._call
        counts = Counter(map(id, modules)) if modules else {}
        # A root that called itself: the ops of its call 1 (the trace, no module call) pair with its later calls'.
        recursed = self.root if self.root is not None and id(self.root) in counts else None
        group = group_ops(call_col, trace._slot, trace._module_call, trace._parents, trace._meta, self.calls,
                          modules, counts, recursed)
        func_names, types = _names(kind, call_col, self.calls, trace._io)
        labels, layer_labels, pass_col, group_size = _label(kind, types, group)
        return {"_labels": labels, "_layer_labels": layer_labels, "_pass": pass_col, "_group": group,
                "_group_size": group_size, "_types": types, "_func_names": func_names}


def _receiver_writes():
    """``writes(call)``: whether an op wrote its first argument (``add_``, ``x[i] = v``, ``out=x``, or a
    collective that fills its argument), judged by name once per function."""
    from ..capture.collectives import WRITTEN_ARGUMENT  # a leaf module; imported late, one way

    verdicts = dict.fromkeys(WRITTEN_ARGUMENT, True)

    def writes(call: tuple) -> bool:
        func, kwargs = call[CALL_FUNC], call[CALL_KWARGS] or {}
        verdict = verdicts.get(func)
        if verdict is None:
            verdict = verdicts[func] = writes_first_argument(func)
        return verdict or bool(kwargs.get("inplace")) or "out" in kwargs

    return writes


def _names(kind, call_col, calls, io) -> tuple:
    """Each op's function name and type: named once per distinct function, then read per op by C-level
    passes; the few inputs, buffers and outputs (the ``io`` indices) are named by their kind."""
    funcs = list(map(_CALL_FUNC, calls))
    named = {}
    for func in dict.fromkeys(funcs):
        name = func_name_of(func)
        named[func] = (name, type_of_name(name))
    per_call = list(map(named.__getitem__, funcs))
    call_names = list(map(_FIRST, per_call))
    call_types = list(map(_SECOND, per_call))
    call_names.append("none")  # index -1: no call
    call_types.append(None)
    func_names = list(map(call_names.__getitem__, call_col))
    types = list(map(call_types.__getitem__, call_col))
    for i in io:
        types[i] = _PSEUDO_TYPES[kind[i]]
    return func_names, types


_PSEUDO_TYPES = {Kind.INPUT: "input", Kind.BUFFER: "buffer", Kind.OUTPUT: "output"}


def _label(kind, types, group):
    """Assign ``{type}_{typeIdx}_{layerIdx}:{pass}``; inputs, buffers and outputs have own counters."""
    type_counts: dict = {}
    source_counts = {Kind.INPUT: 0, Kind.BUFFER: 0, Kind.OUTPUT: 0}
    layer_count = 0
    layer_of_group: dict = {}
    op, output = Kind.OP, Kind.OUTPUT
    layer_labels = []
    for k, t, g in zip(kind, types, group):
        layer = layer_of_group.get(g)
        if layer is None:  # the first pass of a layer
            if k == op:
                layer_count += 1
                type_counts[t] = type_counts.get(t, 0) + 1
                layer = op_label(t, type_counts[t], layer_count)
            else:
                if k == output:
                    layer_count += 1  # outputs consume a layer number without printing it
                source_counts[k] += 1
                layer = f"{t}_{source_counts[k]}"
            layer_of_group[g] = layer
        layer_labels.append(layer)
    if len(layer_of_group) == len(group):  # no layer ran twice: every pass is the first
        pass_col, passes_of_group = [1] * len(group), dict.fromkeys(group, 1)
    else:
        pass_col, passes_of_group = [], {}
        for g in group:
            p = passes_of_group[g] = passes_of_group.get(g, 0) + 1
            pass_col.append(p)
    return with_passes(layer_labels, pass_col), layer_labels, pass_col, passes_of_group


def _param_addresses(calls, index: ModelIndex, module_calls: list) -> dict:
    """Op index -> the addresses of the parameters its call used (read now: a parameter outside the
    index is named by its shape, which a later ``.data`` assignment could change)."""
    address_of = index.param_addresses.get
    unindexed = _UnindexedParams(index, module_calls)
    out = {}
    for call in compress(calls, map(_CALL_PARAMS, calls)):  # the calls that used parameters
        module_call = call[CALL_MODULE_CALL]
        addresses = tuple([address_of(id(p)) or unindexed.address(p, module_call) for _, p in call[CALL_PARAMS]])
        first, count = call[CALL_FIRST_RECORD], call[CALL_NUM_OUTPUTS]
        out[first] = addresses
        if count > 1:  # the outputs of one call share them
            for i in range(first + 1, first + count):
                out[i] = addresses
    return out


def _all_indexed(calls, index: ModelIndex) -> bool:
    """Whether every parameter the calls used has an address in the index (C-level passes)."""
    # (argument position, Parameter) pairs of the calls that used any (as ``_param_addresses`` reads them)
    used = map(_SECOND, chain.from_iterable(filter(None, map(_CALL_PARAMS, calls))))
    return all(map(index.param_addresses.__contains__, map(id, used)))


class _UnindexedParams:
    """Addresses of the parameters a forward used that the model index does not hold: FSDP2's unsharded
    parameters (``fully_shard``) and offloaded weights loaded for one call, which a module holds only during
    its forward, are named as the parameter each stands for; any other is named by its shape."""

    def __init__(self, index: ModelIndex, module_calls: list):
        self.index = index
        self.module_calls = module_calls
        self.unsharded = None  # id(unsharded parameter) -> address, found when first needed

    def address(self, p, module_call: int) -> str:
        if self.unsharded is None:
            self.unsharded = _unsharded_addresses(self.index)
        return (self.unsharded.get(id(p)) or self._loaded_for(p, module_call)
                or f"<unregistered parameter {tuple(p.shape)}>")

    def _loaded_for(self, p, module_call: int) -> str | None:
        """The address of the meta parameter ``p`` was loaded in place of, when the op ran in a module call
        (-1: in the root's forward, outside any)."""
        if module_call < 0:
            return None
        return offloaded_address(self.index, self.module_calls[module_call][MODULE_CALL_MODULE], p)


def _unsharded_addresses(index: ModelIndex) -> dict:
    """``id(unsharded parameter) -> address`` for the modules ``fully_shard`` sharded.  Between forwards such a
    module holds its sharded parameter (a DTensor, what the index walked); during its forward FSDP2 registers
    the unsharded parameter it gathered in its place, the one the module's ops read."""
    found = {}
    for param in fsdp_params(index.all_modules()):
        unsharded = getattr(param, "_unsharded_param", None)  # made by its first all-gather
        address = index.param_addresses.get(id(param.sharded_param))
        if unsharded is not None and address is not None:
            found[id(unsharded)] = address
    return found
