"""Turn the raw lists one forward filled into a ``Trace``: one linear pass, no rich objects per op."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..labels.naming import func_name_of, op_label, type_of_name, with_pass
from ..labels.passes import group_ops
from ..tree import path_text
from ..tree import tensor_leaves as leaves_with_paths
from .columns import (CALL_FUNC, CALL_KWARGS, CALL_MODULE_CALL, CALL_PARAMS, CALL_PARENTS, CALL_WROTE_ARGUMENTS, INPUT,
                      Kind, OpMeta, writes_first_argument)
from .layouts import shape_of
from .model_index import ModelIndex
from .modules import Module, ModuleCall
from .trace import Trace

if TYPE_CHECKING:
    from ..capture.state import CaptureState


def tensor_leaves(obj, path: str, out: list) -> list:
    """``(path text, tensor)`` for each tensor in a nested value: ``tree.tensor_leaves`` with its paths
    written under ``path`` (``output.0.logits``).  The spelling capture/session.py imports; new code
    calls ``tree.tensor_leaves`` and ``tree.path_text`` itself."""
    out.extend((path_text(path, p), t) for p, t in leaves_with_paths(obj))
    return out


def finalize(state: CaptureState, model, output, model_name: str, timings: dict, index=None) -> Trace:
    index = index if index is not None else ModelIndex(model)
    calls, records = state.calls, state.records  # raw tuples: Trace.calls names them on first read
    # Producers of the returned tensors first: this may still add a buffer source (a returned buffer).
    returned = [(path_text("output", p), state.producer_of(t), t) for p, t in leaves_with_paths(output)]

    raw_calls = [r[0] for r in records]
    call_col = [c if c >= 0 else -1 for c in raw_calls]
    op, source, buffer = Kind.OP, Kind.INPUT, Kind.BUFFER
    kind = [op if c >= 0 else (source if c == INPUT else buffer) for c in raw_calls]
    slot_col = [r[1] if r[0] >= 0 else None for r in records]
    parents_col = [calls[c][CALL_PARENTS] if c >= 0 else () for c in call_col]
    module_col = [calls[c][CALL_MODULE_CALL] if c >= 0 else -1 for c in call_col]
    writes_receiver = _receiver_writes()
    inplace = [c >= 0 and calls[c][CALL_WROTE_ARGUMENTS] and s is None and writes_receiver(calls[c])
               for c, s in zip(call_col, slot_col)]
    io = {i: r[1] for i, r in enumerate(records) if r[0] < 0}
    # Most ops share a handful of (shape, dtype, device, ...) rows: keep one tuple of each.
    distinct: dict = {}
    meta = [distinct.get(m) or distinct.setdefault(m, OpMeta._make(m)) for m in (r[2:] for r in records)]
    activations = dict(state.saved)
    for path, producer, t in returned:
        i = len(kind)
        kind.append(Kind.OUTPUT)
        io[i] = path
        call_col.append(-1)
        slot_col.append(None)
        parents_col.append(((0, producer),))
        module_col.append(-1)
        inplace.append(False)
        meta.append(OpMeta(shape_of(t), t.dtype, t.device, t.requires_grad, None))
        if producer in activations:
            activations[i] = activations[producer]

    module_calls, modules = _build_modules(state, index)
    module_counts = {id(m._ref): m.num_calls for m in modules}
    nodes_module_obj = [mc.module._ref for mc in module_calls]
    group = group_ops(call_col, slot_col, module_col, parents_col, meta, calls, nodes_module_obj,
                      module_counts)
    func_names, types = _names(kind, call_col, calls)
    labels, layer_labels, pass_col, group_size = _label(kind, types, group)

    trace = Trace(
        model_name=model_name,
        calls=calls,
        kind=kind,
        call=call_col,
        slot=slot_col,
        meta=meta,
        parents=parents_col,
        module_call=module_col,
        inplace=inplace,
        io=io,
        labels=labels,
        layer_labels=layer_labels,
        pass_col=pass_col,
        group=group,
        group_size=group_size,
        types=types,
        func_names=func_names,
        activations=activations,
        dropped=dict(state.clobbered),
        finite=state.drained_finite_flags(),
        param_addresses=_param_addresses(calls, call_col, index),
        module_calls=module_calls,
        modules=modules,
        output=output,
        model=model,
        unattributed=state.unattributed,
        timings=timings,
        budget_exhausted_at=state.budget_exhausted_at,
        alias_reads=state.alias_reads,
        index=index,
    )
    from ..capture.state import ReplayContext  # the capture driver's type; imported late, one way

    trace._replay = ReplayContext(state.context, state.contexts, state.param_writes,
                                  {id(p): p._version for _, p in index.params},
                                  {id(p): p.requires_grad for _, p in index.params})
    return trace


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


def _names(kind, call_col, calls):
    cache: dict = {}
    func_names, types = [], []
    pseudo = {Kind.INPUT: "input", Kind.BUFFER: "buffer", Kind.OUTPUT: "output"}
    for k, c in zip(kind, call_col):
        if k == Kind.OP:
            func = calls[c][CALL_FUNC]
            named = cache.get(func)
            if named is None:
                name = func_name_of(func)
                named = cache[func] = (name, type_of_name(name))
            func_names.append(named[0])
            types.append(named[1])
        else:
            func_names.append("none")
            types.append(pseudo[k])
    return func_names, types


def _label(kind, types, group):
    """Assign ``{type}_{typeIdx}_{layerIdx}:{pass}``; inputs, buffers and outputs have own counters."""
    type_counts: dict = {}
    source_counts = {Kind.INPUT: 0, Kind.BUFFER: 0, Kind.OUTPUT: 0}
    layer_count = 0
    layer_of_group: dict = {}
    passes_of_group: dict = {}
    labels, layer_labels, pass_col = [], [], []
    for k, t, g in zip(kind, types, group):
        layer = layer_of_group.get(g)
        if layer is None:
            if k == Kind.OP:
                layer_count += 1
                type_counts[t] = type_counts.get(t, 0) + 1
                layer = op_label(t, type_counts[t], layer_count)
            else:
                if k == Kind.OUTPUT:
                    layer_count += 1  # outputs consume a layer number without printing it
                source_counts[k] += 1
                layer = f"{t}_{source_counts[k]}"
            layer_of_group[g] = layer
        p = passes_of_group[g] = passes_of_group.get(g, 0) + 1
        layer_labels.append(layer)
        labels.append(with_pass(layer, p))
        pass_col.append(p)
    return labels, layer_labels, pass_col, passes_of_group


def _build_modules(state: CaptureState, model_index: ModelIndex):
    addresses = model_index.module_addresses
    modules_by_id: dict = {}
    module_calls = []
    unregistered = 0
    for index, (module, parent, t0, t1, inputs, outputs) in enumerate(state.module_calls):
        record = modules_by_id.get(id(module))
        if record is None:
            names = addresses.get(id(module))
            if names is None:
                unregistered += 1
                names = [f"<unregistered {type(module).__name__} #{unregistered}>"]
            # Copies: the index is shared by every trace of an unchanged model.
            shown = getattr(module, "_orig_mod", module)  # a torch.compile'd submodule: the class it wraps
            record = modules_by_id[id(module)] = Module(names[0], list(names), type(shown).__name__,
                                                        model_index.param_names_of(module), module)
        parent_call = module_calls[parent] if parent >= 0 else None
        call = ModuleCall(None, index, record, len(record.calls) + 1, parent_call, t0, t1, inputs, outputs)
        record.calls.append(call)
        if parent_call is not None:
            parent_call.children.append(call)
        module_calls.append(call)
    return module_calls, list(modules_by_id.values())


def _param_addresses(calls, call_col, index: ModelIndex) -> dict:
    names = index.param_addresses
    out = {}
    by_call: dict = {}  # the outputs of one call share its addresses
    for i, c in enumerate(call_col):
        if c >= 0 and calls[c][CALL_PARAMS]:
            addresses = by_call.get(c)
            if addresses is None:
                addresses = by_call[c] = tuple([names.get(id(p)) or _unregistered(p) for _, p in calls[c][CALL_PARAMS]])
            out[i] = addresses
    return out


def _unregistered(p) -> str:
    return f"<unregistered parameter {tuple(p.shape)}>"
