"""The ``save=`` policy: which activations a trace keeps.

``save`` accepts ``"all"`` (default), ``"none"``, a predicate ``f(op) -> bool``, or a list mixing op
labels (``linear_1_1:2``), layer labels (``linear_1_1``), module addresses (``features.0``: that
module's output op, every call), module call labels (``fc:2``: that call's output op) and op types
(``relu``).  Types and module addresses are decided during the forward (no other op is ever held: a selected
module's output is saved as its call returns, see ``SelectedModuleOutputs``); labels and predicates need final
labels, so every output is held by reference until the forward ends and the rest are released then.
"""

from __future__ import annotations

import difflib
import threading

import torch
import torch.compiler as _compiler

from ..checks import check_takes, is_a
from ..errors import AmbiguousKey, UnmatchedSelection, add_note, closest_hint, first_few, listed
from ..labels.naming import LABEL, folded, func_name_of, type_of_name
from ..record.columns import MODULE_CALL_MODULE, MODULE_CALL_PARENT, Kind
from ..record.lookup import (alias_note, called_classes, module_class_note, no_root_note, numbered_past_note,
                             record_name_hint, refuse_ambiguous)
from ..record.modules import calls_cut_short, is_unregistered
from ..record.model_index import (container_note, refuse_module_object, scripted_outer, tensor_address_note,
                                  traced_address)
from ..record.params import bypassed_call_hint
from ..record.dropped import WRITTEN_UNSEEN
from ..record.summary import UNSEEN_PLACES
from ..record.layouts import storage_key, version_of
from ..tree import tensor_leaves
from .bindings import is_bound
from .teardown import HookHandles

_IO_PATH = ("input.", "output.")  # an input's or output's path (input.attention_mask), as log[path] finds it


def is_io_path(name: str) -> bool:
    """Whether ``name`` is an input's or output's path (``input.attention_mask``, ``output.logits``, ``output`` for
    a lone output), as ``log[path]`` finds it."""
    return name.startswith(_IO_PATH) or name == "output"
_SAVE_ALL, _SAVE_NONE = ("all", True), ("none", None, False)
_NOTHING = frozenset()  # the selection of "all", "none" and predicates: shared, never added to


class SavePolicy:
    def __init__(self, save, model, index=None, option: str = "save"):
        if isinstance(save, LayerSelection):
            option = "layers"  # tl.extract's layers=: its refusals name the option the caller wrote
        self.predicate, self.option = None, option
        self.budget_spent_holding = False  # max_saved_bytes was spent on ops held but not selected (see ``apply``)
        self.labels = self.types = self.module_ids = self.addresses = self.call_labels = _NOTHING
        self.type_entries: dict = {}  # normalized op type -> the entry as written
        self.selected_modules: dict = {}  # id(module) -> module, for each module a selection names
        self.shadowed_types: dict = {}  # module address entry -> the op type it also reads as (save=["relu"])
        self.containers: dict = {}  # module address entry -> why it never runs (a ModuleList has no forward)
        self.written_unseen: list = []  # ops a selected call returned, written unseen before it was saved
        if isinstance(save, str) and save in _SAVE_ALL or save is True:
            self.mode = 1
        elif save is None or save is False or (isinstance(save, str) and save in _SAVE_NONE):
            self.mode = 0
        elif callable(save):
            if isinstance(save, (type, torch.nn.Module)):  # callable, but no predicate: refused, naming addresses
                refuse_module_object(save, _modules_by_address(model, index), f"{option}=")
            # Called with each op only after the forward: one that cannot take an op would fail there.
            check_takes(save, 1, f"{option}= as a predicate is called as {option}(op), with each op of the trace",
                        "give a function of an op returning whether to keep it (lambda op: op.type == 'relu')")
            self.mode, self.predicate = 1, save
        elif isinstance(save, (list, tuple, set, frozenset, str)):  # a string: one label, address or op type
            self._parse_selection(save if isinstance(save, LayerSelection) else
                                  [save] if isinstance(save, str) else list(save), model, index)
        else:
            raise TypeError(
                f"{option}={save!r:.60} {is_a(save)}, which is not understood: use 'all', 'none', a label / module "
                "address / op type or a list of them, or a predicate taking an Op")
        # Whether what is kept is only settled after the forward (see ``apply``); read once per trace.
        self.filters_after = self.predicate is not None or bool(self.labels or self.types or self.addresses
                                                                 or self.call_labels)

    def _parse_selection(self, items, model, index=None):
        modules = _modules_by_address(model, index)
        types_too = not isinstance(items, LayerSelection)  # tl.extract's layers= name no op types
        self.labels, self.types, self.module_ids, self.addresses, self.call_labels = set(), set(), set(), set(), set()
        for item in items:
            if not isinstance(item, str):
                refuse_module_object(item, modules, f"a {self.option}= entry")
                raise ValueError(f"{self.option}= entries must be strings, got {item!r}{record_name_hint(item)}")
            if not item:  # the root module's address: the model itself, whose output is the trace's output
                advice = "op labels or module addresses" if not types_too else \
                    f"op labels, module addresses or op types, or {self.option}='none' for none"
                raise ValueError(f"{self.option}= entry '' names the model itself, whose output is log.output, and "
                                 f"no op; give {advice}")
            address, _, call = item.rpartition(":")
            if item in modules:
                _refuse_scripted(item, item, modules, self.option)
                self.addresses.add(item)
                self.module_ids.add(id(modules[item]))
                self.selected_modules[id(modules[item])] = modules[item]
                note = container_note(item, modules[item])
                if note:
                    self.containers[item] = note
                if types_too and "." not in item:
                    self.shadowed_types[item] = folded(item)
            elif address in modules and call.isdigit():  # a module call label: that call's output op
                _refuse_scripted(item, address, modules, self.option)
                self.call_labels.add(item)
                note = container_note(address, modules[address])
                if note:
                    self.containers[address] = note
                self.module_ids.add(id(modules[address]))
                self.selected_modules[id(modules[address])] = modules[address]
            elif LABEL.match(item) or item.startswith(("input_", "output_", "buffer_")) or item.startswith(_IO_PATH):
                self.labels.add(item)
            else:
                self.types.add(folded(item))
                self.type_entries[folded(item)] = item
        # Labels are only known after the forward: hold everything until then.  So for the output type: an
        # output node shows its producer's tensor, which a test of each op's own type would never hold.
        self.mode = 1 if self.labels or "output" in self.types else 2

    def capture_selector(self, state, modules: bool = True):
        """The during-forward test for mode 2: op type selected, or (``modules``) inside a selected module.  A
        ``save=`` selection passes ``modules=False``: its modules' outputs are saved as their calls return
        (``SelectedModuleOutputs``), so that no op inside them is held, nor copied before a write, meanwhile."""
        types, calls = self.types, state.module_calls
        module_ids = self.module_ids if modules else _NOTHING
        type_cache: dict = {}

        def wants(func, module_call):
            t = type_cache.get(func)
            if t is None:
                t = type_cache[func] = type_of_name(func_name_of(func))
            if t in types:
                return True
            while module_call >= 0:
                record = calls[module_call]
                if id(record[MODULE_CALL_MODULE]) in module_ids:
                    return True
                module_call = record[MODULE_CALL_PARENT]
            return False

        return wants

    def keep(self, trace, op) -> bool:
        if self.predicate is not None:
            try:
                return bool(self.predicate(op))
            except BaseException as exc:  # the user's own error, with the op it was given: it shows no op itself
                add_note(exc, f"torchlens: raised by the {self.option}= predicate, called after the forward with op "
                              f"{op.label}; no trace is returned")
                raise
        if op.label in self.labels or op.layer_label in self.labels or op.type in self.types:
            return True
        if op.index in self._io_ops(trace):
            return True
        return op.index in self._selected_outputs(trace)

    def held_note(self) -> str:
        """Why a budget ran out before the selected op it names, though that op alone might fit: what was held."""
        if not self.budget_spent_holding:
            return ""
        return (f" ({self.option}= holds every op it may keep until the forward ends, and what it holds counts against "
                "the budget)")

    def _first_selected_from(self, trace, stop: int):
        """The first op from ``stop`` on that the selection asks for, or None.  Until the forward ends every op a
        label or predicate selection may keep is held, and counts against ``max_saved_bytes``: the op the budget
        ran out at may be one the selection then lets go, which the user never asked to save."""
        return next((i for i in range(stop, len(trace.ops)) if self.keep(trace, trace.ops[i])), None)

    def _io_ops(self, trace) -> set:
        """The indices of the input and output ops the entries name by path (``input.mask``; a tensor passed twice
        is one input, which either of its paths names), looked up as ``log[path]`` does."""
        if not hasattr(self, "_io_cache"):
            paths = [entry for entry in self.labels if entry.startswith(_IO_PATH)]
            self._io_cache = {trace[path].index for path in paths if path in trace}
        return self._io_cache

    def _selected_outputs(self, trace) -> set:
        """The output ops of the selected module calls, found once: ``keep`` asks for every op, and a search of
        the selected calls per op made a selection of n modules n * n work."""
        if not hasattr(self, "_outputs_cache"):
            self._outputs_cache = {i for mc in trace.module_calls
                                   if self.addresses.intersection(mc.module.all_addresses)
                                   or mc.label in self.call_labels for i in mc._output_nodes}
        return self._outputs_cache

    def check_matched(self, trace, option: str | None = None, stopped_after=None) -> None:
        """Refuse a selection entry that picked nothing: a typo must not silently save less.  A forward
        stopped early (``stopped_after``, the stop site) is named: what comes after the stop never ran.
        ``option``: the option named (None: the one this selection was given as, ``save`` or ``layers``)."""
        option = option or self.option
        if not (self.labels or self.types or self.addresses or self.call_labels):
            return  # "all", "none" or a predicate: nothing to match
        for entry in sorted(self.addresses | self.call_labels):
            if LABEL.match(entry):  # a module named like a label: refused where the label names other ops
                refuse_ambiguous(trace, entry, f"{option}= entry ")
        for entry, op_type in self.shadowed_types.items():
            _refuse_a_module_read_as_a_type(trace, entry, op_type, option)
        known = {op.label for op in trace.ops} | {op.layer_label for op in trace.ops}
        known |= {entry for entry in self.labels if entry.startswith(_IO_PATH) and entry in trace}
        types = {op.type for op in trace.ops}
        called = {a for mc in trace.module_calls for a in mc.module.all_addresses}
        calls = {mc.label for mc in trace.module_calls}
        missing = sorted(self.labels - known) + sorted(self.type_entries[t] for t in self.types if t not in types)
        missing += sorted(self.addresses - called) + sorted(self.call_labels - calls)
        if not missing:
            chosen = self._calls_by_entry(trace)
            self._refuse_outputs_no_op_made(chosen, option)
            self._refuse_calls_cut_short(trace, chosen, option, stopped_after)
        if missing:
            entry = missing[0]
            if entry in known:  # a module named like a label that never ran: the label is in the trace
                raise AmbiguousKey(f"{option}= entry {entry!r} names the module {entry.rpartition(':')[0] or entry} "
                                   f"(or one of its calls), which never ran in this forward, and the "
                                   f"{'op' if ':' in entry else 'layer'} {entry} of this trace; {option}= took the "
                                   f"module: select the label with a predicate ({option}=lambda op: "
                                   f"op.{'label' if ':' in entry else 'layer_label'} == {entry!r})")
            paths = {path for path in trace.io_paths.values() if path.startswith(_IO_PATH)}
            names = sorted(known | types | called | calls | paths)
            _refuse_made_in_forward(entry, calls, option)
            hint = alias_note(trace, entry) or tensor_address_note(trace.model, entry, f"{option}=") or \
                numbered_past_note(trace, entry) or closest_hint(entry, names) + no_root_note(trace, entry)
            hint += module_class_note(entry, called_classes(trace), "a selection takes") + \
                _whole_option_hint(entry, option)
            ran = ""
            # a module of the model that made no call, named by its address or by a call label ("spare:1")
            address = entry if entry in self.addresses else entry.rpartition(":")[0] if entry in self.call_labels \
                else None
            if address is not None and address not in called:
                ran = (f" ({address!r} {self.containers[address]})" if address in self.containers else "") or \
                    bypassed_call_hint(trace, address) or _compiled_holder_hint(trace, address) or \
                    _other_thread_hint(trace, address) or " (that module exists but never ran in this forward)"
            if stopped_after is not None:
                ran += f" (the forward stopped after {stopped_after}, as stop_after= asked: what follows never ran)"
            more = f" ({len(missing)} entries matched nothing: {', '.join(missing[:6])})" if len(missing) > 1 else ""
            raise UnmatchedSelection(f"no op, layer, module call or module named {entry!r} in this trace, and no "
                                     f"op of that type: {option}= matched nothing for it{ran}{hint}{more}")

    def _calls_by_entry(self, trace) -> dict:
        """Each module entry (an address or a call label) -> the calls it selected, in one pass over the calls."""
        chosen: dict = {}
        for mc in trace.module_calls:
            keys = [a for a in mc.module.all_addresses if a in self.addresses]
            keys += [mc.label] if mc.label in self.call_labels else []
            for key in keys:
                chosen.setdefault(key, []).append(mc)
        return chosen

    @staticmethod
    def _refuse_calls_cut_short(trace, chosen: dict, option: str, stopped_after) -> None:
        """Refuse a module entry whose every call a stop ended inside (``stop_after=`` at a submodule or an op of
        it): those calls never returned, so they have no output to save or watch."""
        if stopped_after is None:
            return
        unreturned = calls_cut_short(trace)
        for entry, calls in sorted(chosen.items()):
            if all(mc.label in unreturned for mc in calls):
                raise UnmatchedSelection(
                    f"{option}= entry {entry!r} matched nothing: the forward stopped after {stopped_after}, as "
                    f"stop_after= asked, inside {calls[0].label}, which never returned, so it has no output; select "
                    "the ops inside it by label, or stop after it")

    @staticmethod
    def _refuse_outputs_no_op_made(chosen: dict, option: str) -> None:
        """Refuse a module entry whose every call returned only tensors no op of the trace made (a Python module
        whose output its TorchScript child computed, a module returning its own parameter): it ran, but it selects
        nothing to save or watch."""
        for entry, calls in sorted(chosen.items()):
            if all(_only_unseen(mc._output_nodes) for mc in calls):
                raise UnmatchedSelection(
                    f"{option}= entry {entry!r} matched nothing: {first_few(mc.label for mc in calls)} returned "
                    f"only tensors no op of the trace made (a parameter or buffer returned as it is, or one "
                    f"{UNSEEN_PLACES}), or written through a view or its base after the op that made them (no op's "
                    "activation is then the value returned); select the ops that read them instead")

    def apply(self, trace, held_at_exhaustion=()) -> None:
        """Release the activations the selection did not ask for.  ``held_at_exhaustion``: the records saved as
        ``max_saved_bytes`` ran out, whose bytes spent it."""
        if not self.filters_after:
            return
        stop = trace.budget_exhausted_at
        if stop is not None:
            trace.budget_exhausted_at = self._first_selected_from(trace, stop)
            # Held for the selection and let go: the budget ran out on them, though it stopped at a selected op.
            self.budget_spent_holding = trace.budget_exhausted_at != stop or any(
                not self.keep(trace, trace.ops[i]) for i in held_at_exhaustion)
        if not trace.saved_activations:
            return
        kept = {i for i in trace.saved_activations if trace.kinds[i] != Kind.OUTPUT and self.keep(trace, trace.ops[i])}
        # An output node shows its producer's tensor: kept when the producer is (or when asked for).
        for i in trace.saved_activations:
            if trace.kinds[i] == Kind.OUTPUT and (trace.output_producer(i) in kept or self.keep(trace, trace.ops[i])):
                kept.add(i)
        trace.keep_activations(kept)


def _only_unseen(outputs: tuple) -> bool:
    """Whether a call returned tensors, all of them made by no op of the trace (their indices are negative)."""
    return bool(outputs) and max(outputs) < 0


class SelectedModuleOutputs(HookHandles):
    """Forward hooks on the modules a ``save=`` or ``grads=`` selection names, for one trace: each hook saves
    (``save=``), or watches the gradient of (``grads=``), as the call returns, the output tensors whose producer it
    did not yet; only the selected modules get one, so a trace without a module selection costs nothing.

    A ``save=`` selection holds nothing inside a selected call meanwhile: which op the call returns is known only
    as it returns, and the tensor it returns is then that op's value, unless written since (no op's then).  So
    a selection of every layer of a transformer holds the layers' outputs alone, as an untraced forward would
    have them, and an output an op outside the call made (``nn.Identity`` returns its input, a module may return
    a tensor it was given or one it kept) is kept alike.  A ``grads=`` selection watches the ops inside its
    modules as they run (capture/grads.py); the hook watches those an op outside them made."""

    def __init__(self, state, policy, grads, root):
        super().__init__()
        self.state, self.grads, self.policy = state, grads, policy
        saved = policy.selected_modules if policy.mode == 2 else {}
        watched = grads.policy.selected_modules if grads is not None and grads.policy is not None and \
            grads.policy.mode == 2 else {}
        self.saved_ids, self.watched_ids = set(saved), set(watched)
        # A TorchScript module takes no hooks, and no op of the trace makes its outputs (its ops run unseen).
        self.modules = [m for m in {**saved, **watched}.values()
                        if m is not root and not isinstance(m, torch.jit.ScriptModule)]

    def install(self) -> None:
        st, owner, grads = self.state, threading.get_ident(), self.grads
        saved_ids, watched_ids = self.saved_ids, self.watched_ids

        def post_hook(module, args, output):
            # Aside while Dynamo compiles a torch.cond body calling the module: that call is unseen, in one op.
            # Nor calls an intervention's action makes, which are none of the forward's.
            if _compiler._is_compiling_flag or st.acting or threading.get_ident() != owner:
                return None
            saving, watching = id(module) in saved_ids, id(module) in watched_ids
            with torch._C.DisableTorchFunction():  # reading tensors' properties must not re-enter capture
                for _, t in tensor_leaves(output, attrs=True):
                    entry = st.producers.get(id(t))
                    if entry is None or not is_bound(entry, t):
                        continue
                    if entry[2] != version_of(t):  # written since (through a view): no longer that op's value
                        if saving and entry[1] not in st.saved and _written_unseen(st, t):
                            self._lost_to_unseen_write(entry[1])
                        continue
                    # Past max_saved_bytes no op from the one it stopped at on is saved, as its warning says.
                    stop = st.budget_exhausted_at
                    if saving and (stop is None or entry[1] < stop) and entry[1] not in st.saved:
                        st.save(entry[1], t, t.requires_grad)
                        if st.budget_exhausted_at == entry[1]:  # it did not fit
                            self._unsave_after(entry[1])
                    if watching and entry[1] not in grads.handles and t.requires_grad:
                        grads.add_hook(entry[1], t)
            return None

        for module in self.modules:
            self.hook(module, post_hook, pre=False)

    def _unsave_after(self, stop: int) -> None:
        """Let go of the ops after ``stop`` saved already, where the budget ran out at ``stop`` (an op made before
        them, kept aside and returned only now), so that nothing from ``stop`` on is saved, as its warning says."""
        for record in [i for i in self.state.saved if i > stop]:
            self.state.release(record)

    def _lost_to_unseen_write(self, record: int) -> None:
        """An op a selected call returns, unsaved until then, whose value a write capture could not see changed
        meanwhile: that write is why it is not saved (as a held one is dropped at the end, and named)."""
        if record not in self.state.clobbered:  # (returned by two calls: named once)
            self.state.clobbered[record] = WRITTEN_UNSEEN
            self.policy.written_unseen.append(record)


def _written_unseen(st, t) -> bool:
    """Whether ``t``'s memory was last written by a call capture did not see: its version is not the one the
    last write capture noted there left (``CaptureState.writers``)."""
    writes = st.writers.get(storage_key(t))
    return not writes or writes[-1][1] != version_of(t)


class LayerSelection(list):
    """A ``save=`` list whose entries are labels and module addresses only, never op types (``tl.extract``'s
    ``layers=``): a module named like an op type (``relu``) is the module, with no second reading."""


def _refuse_a_module_read_as_a_type(trace, entry: str, op_type: str, option: str) -> None:
    """An entry naming a module and an op type (``self.relu = nn.ReLU()`` beside other ``relu`` ops) is selected
    as the module; refused when the type's ops are not exactly the module's outputs, which would be kept alone."""
    kinds = trace.kinds
    typed = [i for i, t in enumerate(trace.op_types) if t == op_type and kinds[i] == Kind.OP]
    if not typed:
        return
    outputs = {i for mc in trace.module_calls if entry in mc.module.all_addresses for i in mc._output_nodes if i >= 0}
    if set(typed) == outputs:
        return
    labels = trace.labels
    shown = listed((labels[i] for i in typed), 4, ", ...")
    raise AmbiguousKey(f"{option}= entry {entry!r} names two things in this trace: the module {entry} (its output "
                       f"ops) and the op type {op_type} ({len(typed)} ops: {shown}); select the module by its call "
                       f"labels ({entry}:1, ...) or the type with a predicate ({option}=lambda op: op.type == "
                       f"{op_type!r})")


def _refuse_scripted(entry: str, address: str, modules: dict, option: str) -> None:
    """A TorchScript module, or one inside it, makes its outputs where capture cannot see them: no op of the
    trace holds them, so a selection naming it would keep nothing.  Refused before the forward runs."""
    outer = scripted_outer(address, modules)
    if outer is None:
        return
    where = "is a TorchScript module" if outer == address else f"is inside {outer!r}, a TorchScript module"
    raise ValueError(f"{option}= entry {entry!r} {where} (torch.jit.script or torch.jit.trace), whose ops run in "
                     "TorchScript's interpreter where capture cannot see them: no op of the trace makes its output, "
                     f"so nothing would be {'watched' if option == 'grads' else 'kept'}. Trace the module as it was "
                     "before scripting, or select the op that reads its output")


def _compiled_holder_hint(trace, address: str) -> str:
    """For a module that made no module call: the compiled op of a torch.compile'd module holding it, which
    ran its interior as one op (``compiled="run"``), or ''."""
    for op in trace.ops:
        if op.type == "compiled" and op.module_address and address.startswith(f"{op.module_address}."):
            return (f" (it ran inside {op.module_address!r}, a torch.compile'd module whose calls are each one "
                    f"compiled op, {op.label}: select {op.module_address!r}, or trace with compiled='eager' to "
                    "record its interior op by op)")
    return ""


def _other_thread_hint(trace, address: str) -> str:
    """For a module that made no module call: that it ran on another thread (log.caveats), or ''."""
    if address not in trace._ran_elsewhere:
        return ""
    return (" (it ran on another thread only, where a trace records no call and no op: make its calls on the thread "
            "that calls tl.trace to record them)")


def _modules_by_address(model, index) -> dict:
    """Address -> module for every address a trace answers to, a module's aliases included (one module
    registered under two names is ``log['a']`` and ``log['b']``, so either selects it).  The model's cached
    index knows them (no walk per trace); with a torch.compile wrapper the walk's own names are read, since
    they also name the wrapped module ("x._orig_mod"), and so is the address a trace gives a module inside
    it ("x.fc" for "x._orig_mod.fc"; the wrapper keeps "x")."""
    if index is None or index.wrappers:
        if not isinstance(model, torch.nn.Module):
            return {}
        modules = dict(model.named_modules(remove_duplicate=False))
        for name, module in list(modules.items()):
            modules.setdefault(traced_address(name), module)
        return modules
    return index.modules_and_aliases()


def _refuse_made_in_forward(entry: str, calls: set, option: str) -> None:
    """Refuse an entry naming a module the forward made itself (``<unregistered Linear #1>``, or one of its calls),
    which the trace names but a selection cannot: it is resolved against the model before the forward runs,
    when that module does not exist yet.  A predicate over the calls the trace names selects its ops."""
    made = sorted(c for c in calls if c == entry or c.rpartition(":")[0] == entry) if is_unregistered(entry) else []
    if not made:
        return
    # tl.extract's layers= takes no predicate: the call's output op, by its label, is what it can name.
    instead = f"give its output op's label instead (log[{made[0]!r}] of a tl.trace is that op)" \
        if option == "layers" else f"select its ops with a predicate: {option}=lambda op: {made[0]!r} in op.modules"
    raise UnmatchedSelection(f"{option}= entry {entry!r} names a module the forward made itself, which does not exist "
                             f"yet when {option}= is read, before the forward runs, so it matched nothing; {instead}")


def _whole_option_hint(entry: str, option: str) -> str:
    """For an entry spelling ``all`` or ``none`` (``"ALL"``, or ``["all"]``, a list of one) or mistyping one
    (``"al"``, which is no label and so has no closest label either): how those are given.  ``tl.extract``'s
    ``layers=`` takes neither: it names the layers whose values are stored."""
    if not difflib.get_close_matches(entry.lower(), ("all", "none"), n=1, cutoff=0.6):
        return ""
    if option == "layers":
        return "; layers= takes no 'all' or 'none': list the op labels or module addresses to extract (tl.trace the " \
            "model once and read log.layers and log.modules for them)"
    return f"; for every op or for none, give {option}='all' or {option}='none' itself (lower case, in no list)"
