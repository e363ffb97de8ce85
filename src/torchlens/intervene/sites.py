"""Where interventions apply: turning ``intervene={site: action}`` keys into positions in the forward.

Module sites (``enc.layers.3`` every call, ``enc.layers.3:1`` one call) are matched by module object
and call number while the model runs, so they need nothing beforehand.  Op and layer labels, and
predicates over op metadata, only mean something against a whole forward: they are resolved against a
reference trace of the same inputs (a first metadata-only pass, or one the caller passes) into the
position of each op in execution order (tensor-producing call number and output slot).  The
intervened run checks that the op met at each position has the same function, module call stack and line,
and is the same call of that function from that line in its module call (``number_occurrences``), so a
forward that took another path fails loudly instead of editing the wrong op.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..checks import check_takes
from ..errors import InterventionError, add_note, closest_hint, first_few
from ..record.columns import CALL_CODE, CALL_LINE, CALL_MODULE_CALL, Kind
from ..record.lookup import module_class_note, record_name_hint
from ..record.model_index import (WRAPPED, container_note, refuse_module_object, scripted_outer, tensor_address_note,
                                  traced_address)
from ..record.modules import Module, enclosing_calls, is_unregistered
from ..record.op import Layer, Op
from ..capture.compiled import compiled_in_place, optimized_module_type
from ..capture.saving import is_io_path
from ..record.source import line_of, source_of
from ..labels.naming import LABEL, folded, func_name_of
from .actions import as_action

_IN_PLACE = "_compiled_call_impl"  # the instance attribute module.compile() sets


class LabelSite:
    """One op of the reference trace an action applies to."""

    __slots__ = ("key", "action", "op", "call", "slot", "func_name", "chain", "file", "line", "stop", "occurrence",
                 "_code", "_offset")

    def __init__(self, key, action, op, stop: bool, columns: ReferenceColumns | None = None):
        columns = ReferenceColumns(op._trace) if columns is None else columns
        i = op.index
        self.key, self.action, self.op, self.stop = key, action, op, stop
        self.call, self.slot, self.func_name = columns.call_indices[i], columns.slots[i], columns.func_names[i]
        self.chain = module_chain(columns.trace, columns.module_calls[i], columns.chains)
        # The line that made the call: a loop that ran fewer times reaches the same position with the same
        # function in the same module call from another line.  Kept as file and line, which a loaded
        # trace also holds (None where no user frame was found: not compared); ``place`` is built when read.
        call = columns.calls[self.call]
        code = self._code = call[CALL_CODE]
        self._offset = call[CALL_LINE]
        self.file = None if code is None else code.co_filename
        self.line = call_line(call)
        self.occurrence = None  # which call of its function from its line in its module call (number_occurrences)

    @property
    def place(self):
        """Where the reference made the call (a ``SourceLocation``), or None where no user frame was found."""
        return source_of(self._code, self._offset)

    def same_line(self, code, line) -> bool:
        """Whether a call made from ``code`` at source line ``line`` can be this site's call in the reference."""
        if self.file is None or code is None:
            return True
        return line == self.line and code.co_filename == self.file


class ModuleSite:
    """A module object and, optionally, one call number of it."""

    __slots__ = ("key", "action", "address", "module", "call_number", "stop")

    def __init__(self, key, action, address, module, call_number, stop: bool):
        self.key, self.action, self.address, self.module = key, action, address, module
        self.call_number, self.stop = call_number, stop


class ModuleCallInfo:
    """What an action at a module site receives as ``op``: the call and which of its output tensors."""

    kind = "module"

    def __init__(self, address, call_index, module, output_index, output_path):
        self.address = address
        self.call_index = call_index
        self.module_object = module
        self.output_index = output_index  # position among the call's output tensors, objects' attributes included
        self.output_path = output_path  # where that tensor sits in the returned value

    @property
    def label(self) -> str:
        return f"{self.address}:{self.call_index}"

    @property
    def module(self) -> str:
        """The call's label, as ``Op.module`` names the module call an op ran in."""
        return self.label

    def __repr__(self) -> str:
        return f"<module call {self.label} output {self.output_index}>"


class ChainLink(NamedTuple):
    """One module call open around an op of the reference trace."""

    call: int  # the call's index among the trace's module calls
    module: object  # the module object, or None (gone from cleaned-up and loaded traces)
    address: str
    class_name: str  # what identifies an unregistered module, which each forward may make anew


class ReferenceColumns:
    """The reference's columns its label sites read, bound once per resolution rather than once per site, and
    the module-call chains built so far (sites at many ops share them)."""

    def __init__(self, trace):
        self.trace = trace
        self.calls, self.call_indices, self.slots = trace.calls, trace.call_indices, trace.slots
        self.func_names, self.module_calls, self.kinds = trace.func_names, trace.module_call_indices, trace.kinds
        self.chains: dict = {}  # module call -> its chain (``module_chain``)


def module_chain(trace, module_call: int, chains: dict) -> tuple:
    """The ``ChainLink``s open around one op of ``trace`` (made in ``module_call``, -1 for the root forward),
    outer to inner.  ``chains``: those already built for this trace, by module call, so that sites at many ops
    build each call's link once (the ops of one call, and the calls of one parent, share a chain)."""
    chain = chains.get(module_call)
    if chain is not None:  # the common case: another op of the same call
        return chain
    rows = trace._call_rows
    # Up to the first call built, not the whole chain: each call's own links are made once.
    unbuilt = enclosing_calls(module_call, lambda k: rows[k].parent, chains)
    chain = chains.get(rows[unbuilt[-1]].parent, ()) if unbuilt else ()
    for k in reversed(unbuilt):
        module = Module(trace, rows[k].module)
        chain = chains[k] = chain + (ChainLink(k, module._ref, module.address, module.class_name),)
    chains[module_call] = chain  # the root forward's, (), too
    return chain


def split_sites(model, intervene: dict, stop_after, compiled: str = "run", index=None):
    """``(module sites, pending label sites)``: what needs no reference, and ``(key, action, stop)`` to
    resolve against one.  Unknown module-like names, TorchScript modules and modules inside a
    torch.compile'd submodule that runs compiled raise here, before anything runs.  ``index``: the model's
    ``ModelIndex``, whose addresses stand for a walk of the model when it holds no compiled module."""
    modules, compiled_in = _site_modules(model, index)
    if compiled == "eager":
        modules = _wrapped_when_eager(modules)
    modules.pop("", None)  # the root's output is the trace's output: change it after the trace
    module_sites, pending = [], []
    first_names: dict = {}  # id(module) -> its first address, for the numbered sites' alias check
    for name, module in modules.items():
        first_names.setdefault(id(module), name)
    items = [(key, as_action(action), False) for key, action in intervene.items()]
    if stop_after is not None:
        items.append((stop_after, None, True))
    for key, action, stop in items:
        refuse_module_object(key, modules, "stop_after=" if stop else "an intervention site")
        kind = site_kind(stop)
        if callable(key) and not isinstance(key, str):
            # Called with each op of the reference, after its forward: one that cannot take an op would fail there.
            check_takes(key, 1, f"a predicate {kind} is called as site(op), with each op of the reference trace",
                        "give a function of an op returning whether it is a site (lambda op: op.type == 'relu')")
            pending.append((key, action, stop))
            continue
        if not isinstance(key, str):
            raise TypeError(f"{'stop_after=' if stop else 'an intervention site'} must be a label, a module address "
                            f"or a predicate over ops, got {key!r}{record_name_hint(key)}")
        address, _, number = key.rpartition(":")
        named = address if address in modules else key
        _refuse_scripted(key, named, modules)
        _refuse_container(key, named, modules, stop)
        if compiled == "run":
            _refuse_inside_compiled(key, named, compiled_in)
        if key in modules:
            module_sites.append(ModuleSite(key, action, key, modules[key], None, stop))
        elif address in modules and number.isdigit() and number != str(int(number)):
            # A trace names a call fc:1, never fc:01 (nor with other digits): log["fc:01"] and save= refuse it too.
            raise KeyError(f"{kind} {key!r}: no op, layer, module call or module named {key!r} in this trace"
                           f"{closest_hint(key, [address, f'{address}:{int(number)}'])}")
        elif address in modules and number.isdigit():
            if int(number) < 1:
                raise KeyError(f"module call {key!r}: calls are numbered from 1")
            _refuse_alias_call(key, address, modules, first_names)
            module_sites.append(ModuleSite(key, action, address, modules[address], int(number), stop))
        elif LABEL.match(key) or is_io_path(key):  # an input's or output's path is refused against the reference,
            pending.append((key, action, stop))   # naming the ops that read it or the op that makes it
        elif address == "self" and number.isdigit() and isinstance(model, torch.nn.Module):
            raise KeyError(f"{kind} {key!r} is a call of the root module itself (a callable's call of "
                           "its root=, or a root's call of itself in a recursion): those calls are not intervention "
                           "sites; intervene on the op labels inside them or on the root's submodules")
        elif isinstance(model, torch.nn.Module) and is_unregistered(address or key):
            raise KeyError(_unregistered_note(key, kind, model))
        elif not isinstance(model, torch.nn.Module) and _op_type_note(key, stop):  # no root= would make it a site
            raise KeyError(f"{kind} {key!r} is neither an op or layer label nor a module address"
                           f"{_op_type_note(key, stop)}")
        elif not isinstance(model, torch.nn.Module):
            raise KeyError(f"{kind} {key!r} is neither an op or layer label nor a module address: the "
                           f"traced callable {getattr(model, '__name__', type(model).__name__)!r} is no module and "
                           "was given no root=, so it has no module addresses; pass root= the module it runs to "
                           "intervene at that module's addresses and calls")
        else:
            # A container is never called: its first call is no name to suggest.
            called = [name for name, module in modules.items() if not container_note(name, module)]
            names = list(modules) + [f"{name}:1" for name in called]
            # A type's name may also be a slip for a module's (norm for model.norm): both are said.
            option = "stop_after=" if stop else "intervene="
            hint = tensor_address_note(model, key, option) or _op_type_note(key, stop) + closest_hint(key, names) + \
                module_class_note(key, ((name, type(module).__name__) for name, module in modules.items() if name),
                                  f"{option} takes")
            raise KeyError(f"{kind} {key!r} is neither an op or layer label nor a module address or "
                           f"module call of {type(model).__name__}{hint}")
    return module_sites, pending


def _site_modules(model, index=None) -> tuple:
    """``({address: module}, {address: (compiled module's address, compiled in place)})``: every address,
    aliases included (one module registered under two names answers to both), and for a module inside a
    torch.compile'd submodule also the address a trace gives it (``block.fc``, not ``block._orig_mod.fc``).
    The second map names, for each module that runs inside compiled code, the compiled module holding it:
    an ``OptimizedModule`` wrapper (``torch.compile(module)``: the wrapper itself is outside), or a module
    compiled in place (``module.compile()``: itself inside, its compiled code running its hooks)."""
    if not isinstance(model, torch.nn.Module):
        return {}, {}
    if index is not None and index.root is model and not _holds_compiled(index):
        # Every address of every module is in the cached index (walked again when the tree changes): no walk of
        # the model per trace, which costs some 3 us per module.  Nothing runs compiled, so nothing is inside.
        return index.modules_and_aliases(), {}
    modules, compiled = {}, {}
    in_place = []  # (address prefix, address) of the modules compiled in place, outermost first
    for name, module in model.named_modules(remove_duplicate=False):
        modules[name] = module
        parts = name.split(".")
        holder = next(((address, True) for prefix, address in in_place if name.startswith(prefix)), None)
        if holder is None and WRAPPED in parts:
            holder = (".".join(parts[:parts.index(WRAPPED)]), False)
        if holder is None and vars(module).get(_IN_PLACE) is not None:
            holder = (name, True)
            in_place.append((f"{name}." if name else "", name))
        traced = traced_address(name)
        modules.setdefault(traced, module)  # a wrapper keeps its own address
        if holder is not None:
            address, in_place_here = holder
            if in_place_here or name != address:  # a wrapper itself is outside what it compiles
                compiled[name] = holder
            if in_place_here or traced != address:
                compiled.setdefault(traced, holder)
    return modules, compiled


def _holds_compiled(index) -> bool:
    """Whether a module of the indexed model is a torch.compile wrapper or compiled in place (an instance
    attribute, set without changing the tree: looked at per call once Dynamo is imported)."""
    return index.wrappers or (optimized_module_type() is not None and bool(compiled_in_place(index.all_modules())))


def _wrapped_when_eager(modules: dict) -> dict:
    """Under ``compiled="eager"`` the module tracker records no call of a torch.compile wrapper: the call the trace
    gives the wrapper's address (``block:1``) is that of the module it wraps, whose hooks run inside it.  So a site
    naming the wrapper hooks the wrapped module, whose call the edit is recorded in."""
    optimized = optimized_module_type()
    if optimized is None:
        return modules
    return {name: module._modules[WRAPPED] if type(module) is optimized and WRAPPED in module._modules else module
            for name, module in modules.items()}


def _refuse_alias_call(key: str, address: str, modules: dict, first_names: dict) -> None:
    """A call number after a module's second name under another parent (one module object shared by two
    parents) would count the object's calls from wherever they were made, not those made under that name:
    ``p2.shared:1`` would edit the call made from ``p1``.  Refused, saying how calls are named."""
    module = modules[address]
    first, named = traced_address(first_names[id(module)]), traced_address(address)
    # Two names under one parent (self.b = self.a) count the same calls: only another parent is refused.
    if first.rpartition(".")[0] != named.rpartition(".")[0]:
        raise InterventionError(
            f"intervention site {key!r}: {address} is another name of the module {first}, whose calls are numbered "
            f"per module object, wherever they were made from, and labelled {first}:1, {first}:2, ...; name the "
            f"call as {first}:N (a trace's module_calls show which call ran where), or give the address "
            f"{address!r} alone to change every call")


def _refuse_scripted(key: str, address: str, modules: dict) -> None:
    """A TorchScript module, or one inside it, is no site: its ops run in TorchScript's interpreter, so no
    op of the trace made its output (it enters with no parent), and nothing inside it is seen."""
    outer = scripted_outer(address, modules)
    if outer is not None:
        where = "is a TorchScript module" if outer == address else f"is inside {outer!r}, a TorchScript module"
        raise InterventionError(
            f"intervention site {key!r} {where} (torch.jit.script or torch.jit.trace), whose ops run in "
            "TorchScript's interpreter where capture cannot see them: no op of the trace holds its output "
            "to change. Trace the module as it was before scripting to intervene there")


def _refuse_container(key: str, address: str, modules: dict, stop: bool) -> None:
    """A module with no forward of its own (``nn.ModuleList``, ``nn.ModuleDict``) is never called: its output
    is no value, so the site would only be found unmet after a whole forward, for a reason that error cannot
    name.  Refused before anything runs, naming the modules it holds."""
    note = container_note(address, modules.get(address))
    if note:
        raise InterventionError(f"{site_kind(stop)} {key!r} {note}")


def _refuse_inside_compiled(key: str, address: str, compiled: dict) -> None:
    """Under ``compiled="run"`` a module that runs inside compiled code is no site: its interior is never
    called where a hook could change it, and a module compiled in place would run the hook a second time."""
    holder = compiled.get(address)
    if holder is None:
        return
    wrapper, in_place = holder
    kind = "a module compiled in place (module.compile())" if in_place else "a torch.compile'd submodule"
    instead = f"the label of its compiled op (the output op of {wrapper}:1 in a plain trace)" if in_place \
        else repr(wrapper)
    subject = f"is {kind}, which" if address == wrapper else f"is inside {wrapper!r}, {kind}, which"
    raise InterventionError(
        f"intervention site {key!r} {subject} runs compiled as one op, so no module hook can change it or anything "
        f"inside it: intervene at {instead}, or trace with compiled='eager' to run it eagerly (op by op) and "
        "intervene there")


def resolve_labels(reference, pending, deep: bool = False) -> list:
    """``LabelSite`` per op each pending key names in ``reference``, for a trace with ``deep=`` (which a reference
    traced otherwise numbers ops unlike)."""
    sites, columns = [], ReferenceColumns(reference)
    for key, action, stop in pending:
        if isinstance(key, str):
            try:
                found = reference[key]
            except KeyError as exc:
                deep_note = deep_mismatch_note(reference, deep)
                raise KeyError(f"{site_kind(stop)} {key!r}: {exc.args[0]}{_stopped_note(reference)}"
                               f"{f'. {deep_note}' if deep_note else ''}") from None
            if isinstance(found, Layer):
                ops = found.ops
            elif isinstance(found, Op):
                ops = [found]
            else:
                raise KeyError(f"{site_kind(stop)} {key!r} does not name an op in the reference trace")
        else:
            ops = accepted_ops(reference, key, stop)
        for op in ops:
            if columns.kinds[op.index] != Kind.OP:
                raise KeyError(_not_an_op(key, op, stop, reference))
            sites.append(LabelSite(key, action, op, stop, columns))
            if stop:
                break  # stop after the first op the site names
    number_occurrences(reference, sites)
    return sites


def accepted_ops(reference, predicate, stop: bool = False) -> list:
    """The ops of ``reference`` a predicate site accepts, in order; a predicate accepting none is refused (it would
    do nothing), and one that raises has its exception noted with the op it was given."""
    kinds = reference.kinds
    ops = [op for op in reference.ops if kinds[op.index] == Kind.OP and _accepts(predicate, op, stop)]
    if not ops:
        raise KeyError(_matched_nothing(stop))
    return ops


def _accepts(predicate, op: Op, stop: bool) -> bool:
    """``predicate(op)``, its exception noted with the op it was given: a test written for the ops inside modules
    (``"attn" in op.module``) meets the ops of the root's own forward too, whose ``module`` is None, and its
    bare ``TypeError`` would name no op and read as torchlens failing.  A test of the values
    (``op.activation.abs().max() > 5``) meets ``None`` in the default reference, which saves none: said so when
    the exception is about a None."""
    try:
        return predicate(op)
    except Exception as exc:
        unsaved = "" if op.has_activation or "NoneType" not in str(exc) else (
            f"; op.activation is None there, as the reference saved no activation for {op.label} (the one made for "
            "label sites saves none): to test values, pass reference= a trace that saved them (tl.trace(model, x))")
        outside = ", made outside every submodule" if op.module is None else ""
        add_note(exc, f"torchlens: raised by the {site_kind(stop)} predicate given the op {op.label} (type "
                      f"{op.type!r}, module {op.module!r}{outside}), "
                      f"before the intervened run; a predicate is called on every op of the reference trace{unsaved}")
        raise


def _stopped_note(reference) -> str:
    """Why a label may be missing from the reference: it stopped early, and names no op after its stop."""
    stopped = getattr(reference, "stopped_after", None)
    return (f" (the reference trace stopped after {stopped} (stop_after=), so it names no op after that: pass "
            "reference= a trace of the whole forward, or none)") if stopped else ""


def _matched_nothing(stop: bool) -> str:
    """The refusal of a predicate site that accepts no op of the reference trace: it would do nothing."""
    kind, effect = ("a stop_after", "never stop the forward") if stop else ("an intervention", "change nothing")
    return (f"{kind} predicate matched no op of the reference trace, so it would {effect}; check what it tests "
            "against the ops the forward runs (print(tl.trace(model, x)) lists their labels and types)")


def _op_type_note(key: str, stop: bool) -> str:
    """What to give when a site names an op type (``relu``), as ``save=`` takes one: a type is no site, since
    intervening at every op of a type, or stopping at its first, is a choice a predicate states."""
    if folded(key) not in _torch_op_types():
        return ""
    predicate = f"lambda op: op.type == {folded(key)!r}"
    if stop:
        return f"; {key!r} is an op type, which names no site: stop_after={predicate} stops after its first op"
    return f"; {key!r} is an op type, which names no site: a predicate site, {predicate}, names every op of it"


@functools.cache
def _torch_op_types() -> frozenset:
    """The op types torch's public functions and tensor methods are recorded as (``layer_norm`` as ``layernorm``)."""
    names = set(dir(torch)) | set(dir(torch.Tensor)) | set(dir(torch.nn.functional))
    return frozenset(folded(name) for name in names if not name.startswith("_"))


def _unregistered_note(key: str, kind: str, model) -> str:
    """The refusal of a site a trace names ``<unregistered SiLU #1>`` (or one of its calls): a module the model's
    tree does not hold (``ACT2FN["silu"](x)`` makes one in the forward), which a trace names by its class
    and a count.  Module sites are found among the model's modules, so no hook can be put on it; the op
    it returned is a label site."""
    return (f"{kind} {key!r} names a module that is not in {type(model).__name__} (one the forward made itself, "
            "or held outside the model), which a trace names by its class and count: module sites are the "
            "model's own modules, so it is no module site; intervene at the label of the op it returned (in a "
            f"plain trace, log[{key!r}] is that op, and the call's output_ops list each output's)")


def site_kind(stop: bool) -> str:
    """What a site is called in an error: ``stop_after=``'s, or one of ``intervene=``'s."""
    return "stop_after site" if stop else "intervention site"


def _not_an_op(key, op: Op, stop: bool, reference) -> str:
    """The refusal of a label site naming an input, a buffer or an output record, with what to name instead:
    an input or a buffer (a pruning mask, an observer's statistic) is made by no op of the forward, and an
    output is the value of the op that made it, when an op made it."""
    def ops_among(labels):  # the output records among an input's readers, the inputs among an output's makers
        return [label for label in labels if reference[label].kind == "op"]

    if op.kind == "output":
        makers = ops_among(op.parents)
        if makers:
            return (f"{site_kind(stop)} {key!r} is the model's output {op.label}: name the op that produces it "
                    f"({makers[0]})")
        held = f"its {reference[op.parents[0]].kind} {op.parents[0]} passed through unchanged" if op.parents else \
            "a tensor the forward returns as it is (a parameter, or one made outside the traced calls)"
        remedy = "trace the whole forward instead (no stop_after)" if stop else \
            "change that tensor before the trace, or the output after it"
        return (f"{site_kind(stop)} {key!r} is the model's output {op.label}, {held}, which no op of the forward "
                f"makes, so no site holds it: {remedy}")
    remedy = "pass a different input" if op.kind == "input" else "change the buffer before the trace"
    return (f"{site_kind(stop)} {key!r} is the model's {op.kind} {op.label}, which no op of the forward produces: "
            f"name the ops that read it ({first_few(ops_among(op.children)) or 'none'}), or {remedy}")


def occurrence_key(call, name, line) -> tuple:
    """What a call is counted by to tell the passes of one line apart: its module call, the function's name
    (``name``) and the source line that made it (``line``, ``call_line(call)``)."""
    return call[CALL_MODULE_CALL], name, line


def call_line(call):
    """The source line that made a recorded call, None where no user frame was found."""
    code = call[CALL_CODE]
    return None if code is None else line_of(code, call[CALL_LINE])


def number_occurrences(trace, sites) -> None:
    """Set each site's ``occurrence``: how many calls with its ``occurrence_key`` the reference made before it.
    A forward that made one call more or less from that line before the site meets, at the site's position,
    the same function from the same line in the same module call: only this count tells the two apart."""
    wanted: dict = {}
    for site in sites:
        wanted.setdefault(site.call, []).append(site)
    if not wanted:
        return
    calls, names, seen, named = trace.calls, trace.func_names, {}, {}
    for position in range(max(wanted) + 1):
        call = calls[position]
        # A loaded trace keeps no function objects, only the names its ops were given.
        func = call.func
        name = names[call.first_record] if func is None else named_once(named, func)
        key = occurrence_key(call, name, call_line(call))
        count = seen.get(key, 0)
        seen[key] = count + 1
        for site in wanted.get(position, ()):
            site.occurrence = count


def deep_mismatch_note(reference, deep: bool) -> str:
    """Why a reference of the same inputs can take another path, or lack a label: it was traced with another
    ``deep=``, which records the torch calls inside torch functions written in Python, so that the two number other
    ops ("" when both were traced alike, or the reference does not say: a trace loaded from a file)."""
    traced = reference._deep
    if traced is None or traced == deep:
        return ""
    return (f"The reference was traced with deep={traced} and this trace has deep={deep}, which records "
            f"{'more' if deep else 'fewer'} ops (the torch calls inside torch functions written in Python): "
            f"trace the reference with deep={deep}, or give no reference= (one is then made)")


def named_once(named: dict, func) -> str:
    """``func_name_of(func)``, kept in ``named`` (a callable that cannot be hashed is named each time)."""
    try:
        name = named.get(func)
    except TypeError:
        return func_name_of(func)
    if name is None:
        name = named[func] = func_name_of(func)
    return name
