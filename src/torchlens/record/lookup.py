"""Which record each string key of a trace names (``log[key]``), and the keys that name two things.

Keys are claimed in order of precedence: op and layer labels, then module call labels and module addresses
(a module named ``output`` or ``input`` is found by its name), then the inputs' and outputs' paths
(``input.x``, ``output``).  A module call that returned no tensor, or whose first tensor no op holds, is the
``ModuleCall`` itself, as a module none of whose calls did is the ``Module``.

A module may be named like a label (``self.linear_1_1 = nn.Linear(...)``, or a ``ModuleDict`` key): its
address or call label is then also an op or layer label.  When both readings name the same ops (the
module's output is that layer) the label's record answers; when they name different ops the key is
ambiguous and answers with ``AmbiguousKey``, naming both and where each is found, never one of them
quietly.
"""

from __future__ import annotations

from ..errors import AmbiguousKey, closest_hint, listed
from ..labels.naming import LABEL, folded
from .columns import Kind
from .model_index import container_note, traced_address
from .modules import Module, ModuleCall, is_unregistered
from .op import Layer, Op
from .params import bypassed_call_hint, listed_params


class Ambiguous:
    """A key two different records claim: ``(view class, key)`` of each, the label's first."""

    __slots__ = ("first", "second")

    def __init__(self, first, second):
        self.first, self.second = first, second


def build_lookup(trace) -> dict:
    """Key -> ``(view class, key of the view)`` or ``Ambiguous``: plain data, so that the lookup holds no view."""
    layers = trace._layer_index()
    lookup: dict = {label: (Layer, label) for label in layers}
    for i, label in enumerate(trace._labels):
        lookup[label] = (Op, i)
    rows, modules = trace._call_rows, trace._module_rows
    # A call returning several tensors is named by its first, as a forward hook's ``output[0]``: an attention
    # module's output before its weights, a decoder layer's hidden states before its attentions, nn.LSTM's output.
    # Where no op holds that first tensor (written through a view after the op that made it), the key is the call
    # itself: the op of its second tensor is not its output.
    first_output = [row.outputs[0] if row.outputs else -1 for row in rows]
    for k, row in enumerate(rows):
        out = first_output[k]
        target = (Op, out) if out >= 0 else (ModuleCall, k)
        _claim(lookup, f"{modules[row.module].address}:{row.number}", target, {out} - {-1}, layers)
    for m, module in enumerate(modules):
        target = (Module, m)
        if len(module.calls) == 1:
            out = first_output[module.calls[0]]
            target = (Op, out) if out >= 0 else target
        outputs = {first_output[c] for c in module.calls} - {-1}
        for address in module.all_addresses:
            _claim(lookup, address, target, outputs, layers)
    kind = trace._kind
    for i, path in trace._io.items():
        if kind[i] != Kind.BUFFER:
            lookup.setdefault(path, (Op, i))
    for path, i in trace._input_aliases.items():  # a tensor passed twice: one input, both names
        lookup.setdefault(path, (Op, i))
    return lookup


def _claim(lookup: dict, key: str, target: tuple, ops: set, layers: dict) -> None:
    """Give ``key`` to a module call's or module's ``target`` (whose output ops are ``ops``), unless a label
    holds it: both reading the same ops, the label keeps it; reading different ops, it is ambiguous."""
    held = lookup.get(key)
    if held is None:
        lookup[key] = target
    elif type(held) is not Ambiguous and held != target and _ops_of(held, layers) != ops:
        lookup[key] = Ambiguous(held, target)


def _ops_of(target: tuple, layers: dict) -> set:
    view, key = target
    if view is Op:
        return {key}
    if view is Layer:
        return set(layers[key])
    return set()  # a ModuleCall or Module that returned no tensor (a Module claiming first: never here)


def ambiguity(trace, key: str, found: Ambiguous) -> str:
    """What ``key`` names twice, and how to read each."""
    first, second = (_described(trace, key, target) for target in (found.first, found.second))
    return (f"{key!r} names two things in this trace: {first[0]} and {second[0]} (a module named like a label); "
            f"read them as {first[1]} and {second[1]}, or rename the module")


def refuse_ambiguous(trace, key: str, role: str = "") -> None:
    """Raise ``AmbiguousKey`` when ``key`` (a ``save=`` entry, an intervention site: ``role``) names two
    different things in ``trace``."""
    found = trace._keys().get(key)
    if type(found) is Ambiguous:
        raise AmbiguousKey(f"{role}{ambiguity(trace, key, found)}{_PREDICATE}")


_PREDICATE = "; to select by something else, pass a predicate over ops (lambda op: ...)"


def _described(trace, key: str, target: tuple) -> tuple:
    view, index = target
    if view is Layer:
        return f"the layer {index}", f"log.layers_by_label[{index!r}]"
    if view is ModuleCall:
        return f"the module call {key} (no op holds its output)", f"log.module_calls[{index}]"
    if view is Module:
        return f"the module {trace._module_rows[index].address}", f"log.modules[{index}]"
    label = trace._labels[index]
    if label == key:
        return f"the op {label}", f"log.ops[{index}]"
    return f"the output op of {key} ({label})", f"log[{label!r}]"


class LayersByLabel(dict):
    """``Trace.layers_by_label``: layer label -> ``Layer``, whose miss says what was meant (a plain dict's
    ``KeyError('linear_1_2')`` repeats the key alone)."""

    def __missing__(self, key):
        if isinstance(key, str) and ":" in key and key.rsplit(":", 1)[0] in self:
            layer = key.rsplit(":", 1)[0]
            passes = f"log['{layer}:1']" + (f" to log['{layer}:{self[layer].num_passes}']"
                                            if self[layer].num_passes > 1 else "")
            raise KeyError(f"a layer's label has no pass number: layers_by_label[{layer!r}] is the layer, and "
                           f"its passes are {passes}")
        raise KeyError(f"no layer labelled {key!r} in this trace{closest_hint(str(key), self)}")


def missing_key_note(trace, key: str) -> str:
    """The tail of the KeyError for a key naming nothing in the trace: what the key is instead (another name
    of a module, a parameter or buffer, a module the forward never ran, a container), else the closest keys."""
    return root_call_note(trace, key) or alias_note(trace, key) or record_address_note(trace, key) or \
        numbered_past_note(trace, key) or unrun_module_note(trace, key) + closest_hint(key, trace._lookup) + \
        no_root_note(trace, key) + module_class_note(key, called_classes(trace), "a trace is keyed by")


def record_name_hint(key) -> str:
    """For a record given where a string names it (``log[op]``, ``save=[op]``, ``intervene={op: ...}``, a record of
    another trace among them): the string that names it, which answers in any trace of the same model."""
    if isinstance(key, Op):
        return f"; give its label, {key.label!r}"
    if isinstance(key, Layer):
        return f"; give its layer label, {key.layer_label!r}"
    if isinstance(key, ModuleCall):
        return f"; give its call label, {key.label!r}"
    if isinstance(key, Module):
        return f"; give its address, {key.address!r}"
    return ""


def module_object_hint(trace, key) -> str:
    """For a module object given where a string names it (``log[model.layers[0]]``): its address in the traced
    model, as ``save=`` and ``intervene=`` answer the same slip, or that it has none there."""
    named = getattr(trace._model, "named_modules", None)  # None in a loaded or cleaned-up trace, and for a callable
    if named is None or not callable(getattr(key, "named_modules", None)):
        return ""
    addresses = [repr(name) for name, module in named(remove_duplicate=False) if module is key and name]
    if addresses:
        return f"; give its address, {listed(addresses, 3)}"
    if key is trace._model:
        return "; the traced model's own call is the whole trace: its output is log.output, its inputs log.inputs"
    return "; this module is no submodule of the traced model, so it names nothing in the trace"


def root_call_note(trace, key: str) -> str:
    """For ``""``, ``"self"`` or ``"self:1"`` in a trace of a module: the root's own call is the whole trace (only a
    callable's calls of its ``root=`` are module calls named ``self``), so its output and inputs are the trace's."""
    if key.partition(":")[0] not in ("", "self") or trace._rootless \
            or any(row.address == "self" for row in trace._module_rows):
        return ""
    outputs = ", ".join(repr(op.label) for op in trace.outputs[:3]) or "none: the trace stopped before it returned"
    return (f" (the traced module's own call is the whole trace, not a module call: it returned log.output (output "
            f"ops {outputs}) from log.inputs; log.modules lists its submodules by their addresses)")


def numbered_past_note(trace, key: str) -> str:
    """For a pass or call number past the last one (``linear_1_1:3`` of a layer run twice, ``fc:4`` of a module
    called three times): how many there were, rather than the closest keys, which leave that to be counted; for
    number 0, that they are numbered from 1; for a negative one (Python's ``:-1``), which is the last."""
    name, colon, number = key.rpartition(":")
    digits = number[1:] if number.startswith("-") else number
    if not colon or not digits.isascii() or not digits.isdigit() or number != str(int(number)):
        return ""  # no number, or one written otherwise than a trace writes it (fc:01): the closest keys show how
    found = trace._keys().get(name)
    if isinstance(found, tuple) and found[0] is Layer:
        count, what = trace[name].num_passes, ("ran", "pass", "passes")
    else:
        count = next((len(m.calls) for m in trace._module_rows if name in m.all_addresses), 0)
        what = ("made", "call", "calls")
    if not count or 0 < int(number) <= count:
        return ""
    last = f" to {name}:{count}" if count > 1 else ""
    if int(number) < 0:  # no counting from the end: a key names one pass or call, whatever the forward ran after
        tail = f"{name}:1{last}, the last being {name}:{count}" if count > 1 else f"{name}:1 is the only {what[1]}"
        return f" ({what[2]} are numbered from 1, not from the end: {tail})"
    if int(number) == 0:
        return f" ({what[2]} are numbered from 1: {name}:1{last})"
    return f" ({name} {what[0]} {count} {what[1] if count == 1 else what[2]} in this forward: {name}:1{last})"


def called_classes(trace):
    """``(address, class name)`` of each module the forward called: what ``module_class_note`` searches in a trace."""
    return ((row.address, row.class_name) for row in trace._module_rows if row.calls)


def module_class_note(key: str, modules, takes: str) -> str:
    """Where ``key`` names a module class (``T5LayerNorm``, or part of one: ``layernorm``), the addresses of its
    modules, from ``modules`` (``(address, class name)`` pairs): what ``takes`` (``"a selection takes"``) are
    addresses, not classes."""
    wanted = folded(key)
    if len(wanted) < 3:  # "l" or "fc" is part of many class names, and no class's name
        return ""
    addresses: dict = {}
    for address, class_name in modules:
        if wanted in folded(class_name):
            addresses.setdefault(class_name, []).append(address)
    if not addresses:
        return ""
    shown = "; ".join(f"{name} modules are at {listed(found, 3, ', ...')}" for name, found in sorted(addresses.items()))
    return f"; {takes} module addresses, not module classes: {shown}"


def no_root_note(trace, key: str) -> str:
    """For a module-like key of a trace of a callable given no ``root=`` (``lambda x: model(x)``): its modules have
    no addresses, only ``<unregistered Linear #1>`` names, so no address of the model can name one."""
    if not trace._rootless or LABEL.match(key):  # a mistyped label: the closest labels say it all
        return ""
    unnamed = next((row.address for row in trace._module_rows if is_unregistered(row.address)), None)
    if unnamed is None:  # the callable ran no module: there is nothing root= would name
        return ""
    return (f" (the traced callable is no module and was given no root=, so its modules have no addresses, only names "
            f"such as {unnamed}: pass root= the module it runs to name them by their addresses)")


def unrun_module_note(trace, key: str) -> str:
    """For a missing module address or call label (``head``, ``head:1``) of one of the model's modules that made
    no module call: a container, which has no forward to call, a module whose forward ran without its __call__, or a
    module this forward never ran."""
    address, colon, number = key.rpartition(":")
    address = address if colon and number.isdigit() else key  # a bare "7" is an address, not the root's call 7
    model = trace._model  # None once cleaned up, and for a loaded trace: no module to name then
    if not address or not hasattr(model, "named_modules") or \
            any(address in row.all_addresses for row in trace._module_rows):  # '': the model itself, which ran
        return ""
    modules = dict(model.named_modules(remove_duplicate=False))
    module = modules.get(address)
    # The eager addresses of modules inside a compiled one (b.0 for b._orig_mod.0), as compiled="eager" names them.
    eager = {traced_address(name) for name in modules}
    compiled = compiled_note(trace, address) if module is not None or address in eager else ""
    if module is None and not compiled:
        return ""
    what = (module is not None and container_note(address, module)) or compiled
    if what:
        return f" ({address!r} {what})"
    # A module whose forward ran around its __call__ (module.forward(...), a __call__ of its own) made no call.
    return bypassed_call_hint(trace, address) or f" ({address!r} is a module of the model that never ran in this " \
        "forward)"


def compiled_note(trace, address: str) -> str:
    """For a module inside a ``torch.compile``'d submodule: it ran, inside that submodule's ``compiled`` ops,
    whose interior a trace records only with ``compiled="eager"`` (as a selection naming it is told)."""
    parts = address.split(".")
    enclosing = {".".join(parts[:n]) for n in range(1, len(parts))}
    ops = [op.label for op in trace.ops if op.func_name == "compiled" and op.module_address in enclosing]
    if not ops:
        return ""
    owner, eager = trace[ops[0]].module_address, traced_address(address)
    return (f"ran inside {owner!r}, a torch.compile'd module whose calls are each one compiled op, "
            f"{listed(ops, 3, ', ...')}: index {owner!r}, or trace with compiled='eager' to record it as {eager}")


# The records kept by address beside the ops: what each is called, and the list that holds them.
_BY_ADDRESS = {"Param": ("parameter", "params"), "Buffer": ("buffer", "buffers")}


def record_address_note(trace, key: str) -> str:
    """For a missing key that is a parameter's or a buffer's address: where its ``Param`` or ``Buffer`` record is
    (parameters and buffers are no ops, and their addresses name none)."""
    for view, (kind, records) in _BY_ADDRESS.items():
        held = listed_params(trace) if records == "params" else trace.buffers
        if any(record.address == key for record in held):
            return f"; {key} is a {kind}, whose record is in log.{records}: {find_by_address(view, key)}"
    return ""


def find_by_address(view: str, address: str) -> str:
    """How to find a parameter's or a buffer's record (``view``: ``"Param"`` or ``"Buffer"``) by its address:
    ``log.params`` and ``log.buffers`` are lists."""
    records = _BY_ADDRESS[view][1]
    return f"find it by address with next({records[0]} for {records[0]} in log.{records} if {records[0]}.address == " \
           f"{address!r})"


def alias_note(trace, key: str) -> str:
    """For a missing ``address:n`` whose address is a module's second name (one module object registered
    under two names, or shared by two parents): how its calls are numbered and labelled instead."""
    address, _, number = key.rpartition(":")
    if not number.isdigit():
        return ""
    rows, calls = trace._module_rows, trace._call_rows
    for row in rows:
        if address in row.all_addresses[1:]:
            labels = [f"{row.address}:{calls[c].number}" for c in row.calls]
            parent = address.rpartition(".")[0]
            under = [f"{row.address}:{calls[c].number}" for c in row.calls
                     if calls[c].parent >= 0 and parent in rows[calls[calls[c].parent].module].all_addresses]
            where = f"; the calls made from {parent}: {', '.join(under)}" if under and parent else ""
            return (f"; {address} is another name of the module {row.address}, whose calls are numbered per module "
                    f"object and labelled by its first name: {listed(labels, 6, ', ...')}{where}")
    return ""


def raise_ambiguous(trace, key: str, found: Ambiguous):
    raise AmbiguousKey(ambiguity(trace, key, found))
