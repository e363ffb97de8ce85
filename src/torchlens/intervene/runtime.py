"""Applying interventions while the forward runs, and recording what was applied.

Label sites are applied by ``Interventions.at_call``, which the capture handler calls at the calls whose
position is a site's (``site_calls``): those are recorded on the hot path as any other op, compiled or not, and
each op costs one set lookup (one attribute check in a trace without label sites).  It runs after
the call's outputs were recorded and fixes the record up: the op's record, saved activation and
producer binding then describe the value downstream ops see, and the value the op made is kept as
``op.original``.  Module sites are applied by a forward hook on each site module, registered after the
module's own hooks, that replaces the call's output the same way.  Action code never adds ops to the
trace: it runs with torch function handling off, or, on a tensor subclass with a ``__torch_function__`` of
its own, with that handling on and every mode (the capture's among them) off the stack meanwhile, so that
the subclass computes the new value and types it, as in a forward hook.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from operator import itemgetter
from weakref import ref as weakref

import torch

from ..errors import InterventionError, TorchlensError, add_note
from ..record.columns import CALL_CODE, CALL_FUNC, CALL_LINE
from ..record.columns import CALL_MODULE_CALL as CALL_MODULE
from ..record.columns import CALL_PARENTS, MODULE_CALL_MODULE, MODULE_CALL_PARENT, RECORD_CALL
from ..record.columns import CALL_WROTE_ARGUMENTS as CALL_WROTE
from ..record.layouts import same_elements, shape_of, storage_key, version_of
from ..record.model_index import READERS_LISTED
from ..record.modules import enclosing_calls
from ..record.source import source_of
from ..record.summary import UNSEEN_PLACES
from ..labels.naming import func_name_of
from ..capture.state import StopForward
from ..capture.writes import named_targets
from ..tree import made_in_transform, path_text, tensor_leaves
from .actions import Action, layout_name, same_shape
from .checkpointing import checkpoint_region
from .functions import refuse_inside_function
from .module_hooks import run_always_called_hooks
from .path import ReferencePath
from .path import site_where as _where
from .sites import ModuleCallInfo

# What a refused module site's message ends with: where the op labels to intervene at instead are found.
_OUTPUTS_HINT = ("Intervene at the op labels of the outputs to change instead: a plain trace's module_calls entry "
                 "labelled {!r} lists them in return order (output_ops)")

_POSITION = itemgetter(0)  # of a (position among the sites, site) pair


_DISABLED = torch._C._disabled_torch_function_impl  # a __torch_function__ that hands every call on unchanged
_modes_on_stack, _pop_mode = torch._C._len_torch_function_stack, torch._C._pop_torch_function_stack
_push_mode = torch._C._push_on_torch_function_stack


class Applied:
    """One intervention as applied to one op: the site as given, the action and the op's label."""

    __slots__ = ("site", "action", "label")

    def __init__(self, site, action, label=None):
        self.site, self.action, self.label = site, action, label

    @property
    def site_text(self) -> str:
        """The site(s) as given, a predicate written ``<predicate>``."""
        sites = self.site if isinstance(self.site, tuple) else (self.site,)
        return ", ".join(s if isinstance(s, str) else "<predicate>" for s in sites)

    def __repr__(self) -> str:
        return f"<Intervention {self.action!r} at {self.site_text} -> {self.label}>"


class Interventions(ReferencePath):
    """The runtime state of one intervened trace."""

    def __init__(self, label_sites: list, module_sites: list, index, keep_originals: bool):
        self.by_call: dict = {}
        self.stop_call = self.stop_key = self.stop_site = None
        for site in label_sites:
            if site.stop:
                self.stop_call, self.stop_key, self.stop_site = site.call, site.op.label, site
            if site.action is not None:
                self.by_call.setdefault(site.call, []).append(site)
        self.label_sites = [s for s in label_sites if s.action is not None]
        self.module_sites = module_sites
        # id(module) -> call number (None: every call) -> [(position among the sites, site)], so that each call
        # finds its own sites without reading those of the module's other calls (a site per call of a module
        # run n times would otherwise be n * n reads).
        self.by_module: dict = {}
        for position, site in enumerate(module_sites):
            self.by_module.setdefault(id(site.module), {}).setdefault(site.call_number, []).append((position, site))
        self.addresses = index.module_addresses
        self.tensor_named = index.tensor_named
        self.keep_originals = keep_originals
        self.applied: dict = {}  # record index -> Applied
        self.originals: dict = {}  # record index -> the value before the action
        self.hit: set = set()  # ids of sites applied at least once
        self.called_elsewhere: set = set()  # ids of site modules called on another thread while the trace ran
        self.stopped_at = None  # the site key the forward stopped after
        self.reference = None  # the trace label sites were resolved against, if any
        self._start_path()
        self.packing = None  # the PackLog of saved_for_backward=True, which learns where each action runs

    @property
    def watches_calls(self) -> bool:
        """Whether the capture handler must call ``at_call`` (label sites or a label stop site)."""
        return bool(self.by_call) or self.stop_call is not None

    @property
    def site_calls(self) -> frozenset:
        """The positions of the calls ``at_call`` acts at: only these are handed to it, the others cannot match."""
        return frozenset(self.by_call) | ({self.stop_call} if self.stop_call is not None else frozenset())

    # ----- label sites: called by the capture handler ------------------------------------------
    def at_call(self, st, call_position: int, first_op: int, out, leaves, func, args, kwargs):
        """Apply the actions positioned at this call; return what the call returns to the model."""
        sites = self.by_call.get(call_position)
        if sites is not None:
            self._check_path(st, sites, call_position, func)
            values = changed = None  # the call's output tensors, copied at the first action that changes one
            for site in sites:
                k = _leaf_index(leaves, site.slot)
                if k < 0:
                    raise InterventionError(f"intervention site {site.key!r}: the op at this position returned no "
                                            f"output {site.slot!r}; the forward took another path than the reference")
                value = leaves[k][1] if values is None else values[k]
                new = self._run_action(st, site.action, value, site.op, site.key, call_position)
                self.hit.add(id(site))
                self._note(first_op + k, site.key, site.action)
                if new is not None:
                    if values is None:
                        values, changed = [t for _, t in leaves], []
                    values[k] = self._replace(st, call_position, first_op + k, value, new, args, kwargs)
                    changed.append(k)
            if changed:
                out = _rebuild_output(out, [(leaves[k][0], values[k]) for k in dict.fromkeys(changed)])
        if call_position == self.stop_call:
            self._check_path(st, [self.stop_site], call_position, func)
            self.stopped_at = self.stop_key
            run_always_called_hooks(st)
            raise StopForward
        return out

    def _reader(self, st, call) -> str:
        """A torch call named for a refusal: its function, the module it ran in (a pooling head's ``transpose``
        in ``vision_tower.head``) and the line that made it, which says what read a value better than the function
        alone: a forward hook of the module runs inside its call, and only its line tells its read from the
        forward's."""
        module_call = call[CALL_MODULE]
        where = f" in {self._address(st.module_calls[module_call][MODULE_CALL_MODULE])}" if module_call >= 0 else ""
        place = source_of(call[CALL_CODE], call[CALL_LINE])
        return func_name_of(call[CALL_FUNC]) + where + (f" at {place.file}:{place.line}" if place is not None else "")

    def _run_action(self, st, action, value, op, key, call: int):
        """``action(value, op)`` at the site made by ``call``, checked: the new value, or None to keep it."""
        version = version_of(value)  # None under torch.inference_mode(): a write there cannot be told
        packing = self.packing
        if packing is not None:  # what the action makes autograd keep is counted at its site
            packing.action_at = call
        # The module calls the action makes are none of the forward's, as its ops are not: a model module it runs
        # (``model.fc(t)``) would take the number of the model's next call of it, and be the one a module site or
        # ``stop_after=`` of that number meets.  The recorders and the module hooks read the flag.
        acting, st.acting = st.acting, True
        try:
            new = self._call_action(action, value, op)
        except Exception as exc:
            # Else only the module call it ran in is noted, which reads as the model's own failure.
            if not isinstance(exc, TorchlensError):  # the helpers' refusals name the site themselves
                add_note(exc, f"torchlens: raised by the intervention action {_shown(action)} at {_where(key, op)}, "
                              f"given a {tuple(shape_of(value))} {value.dtype} value; the model itself did not fail")
            raise
        finally:
            st.acting = acting
            if packing is not None:
                packing.action_at = None
        if version is not None and value._version != version:
            raise InterventionError(
                f"the action at {_where(key, op)} wrote the tensor it was given in place, which would also change "
                "the values saved for the ops before it; return a new tensor instead (t = t.clone(); t[...] = v; "
                "return t)")
        if new is None:
            return None
        _check_new_value(st, new, value, key, op)
        # The recomputation leaves out only what the edit changed: a new value reading the same elements of the
        # same memory (t.view_as(t), attribution_patching's probe of an op handing back its input) changes none.
        if same_elements(new, value):
            return new
        region = checkpoint_region()
        if region is not None:
            raise InterventionError(
                f"intervention at {_where(key, op)}: the site is inside a {region} torch.utils.checkpoint region "
                "with gradients enabled, whose backward runs the region again without the edit, so gradients "
                "through it would be those of the unedited forward. Trace with gradient checkpointing off (for a "
                "transformers model, model.gradient_checkpointing_disable()), or under torch.no_grad() when no "
                "gradient is needed")
        refuse_inside_function(key, op, new, value)
        return new

    def _call_action(self, action, value, op):
        """``action(value, op)``; its own torch calls are not ops of the model.  A tensor subclass whose
        ``__torch_function__`` is its own (not disabled, as a Parameter's or a dispatch-level wrapper's) keeps
        it meanwhile, as in a forward hook: its arithmetic makes the new value, which downstream ops then
        see as that subclass."""
        if type(value) is torch.Tensor or type(value).__torch_function__ is _DISABLED:
            with torch._C.DisableTorchFunction():
                return action(value, op)
        modes = [_pop_mode() for _ in range(_modes_on_stack())]
        try:
            with torch._C._EnableTorchFunction():
                return action(value, op)
        finally:
            for mode in reversed(modes):
                _push_mode(mode)

    # ----- record fix-ups ------------------------------------------------------------------------
    def _replace(self, st, call_position, record, old, new, args, kwargs):
        """Make ``record`` describe ``new``; return the tensor the model gets."""
        call = st.calls[call_position]
        receiver = call[CALL_WROTE] and ((args and args[0] is old) or (kwargs and kwargs.get("out") is old)
                                         or any(t is old for t in named_targets(call[CALL_FUNC], args, kwargs)))
        if receiver:  # an in-place op (or a custom op's mutated argument): the model holds it, so write into it
            st.protect_saved(old)  # copy-on-write: the saved value of this op becomes the original
            original = st.saved.get(record)
            with torch._C.DisableTorchFunction():
                # A value sharing the receiver's memory (t.view_as(t)) is copied first: torch refuses to write a
                # tensor from memory it overlaps.
                old.copy_(new.clone() if new is not old and _aliases(new, old) else new)
            new = old
            writes = st.writers.get(storage_key(old))
            if writes:  # the write just made is now this record's
                writes[-1] = (record, version_of(old), writes[-1][2])
        else:
            passed = _argument_position(old, args, kwargs)  # an op returning an argument (x.contiguous() -> x)
            original = st.saved.get(record)
            if original is not None and (passed is not None or old._base is not None or _aliases(new, old)):
                # A view (its saved copy is detached, with no _base, when it requires grad: ask the output), a
                # tensor the model still holds, or one the action's value shares memory with (t.view_as(t)): a
                # later write to what it shares would change it.
                original = original.clone()
            self._unbind(st, call_position, old, passed)
        self._rebind(st, record, new)
        self._keep_original(record, original)
        return new

    def _unbind(self, st, call_position, old, passed) -> None:
        """``old`` is no longer what downstream reads: drop its binding, or, when the op returned its argument
        ``passed`` unchanged, give that tensor back to the op that made it."""
        if passed is not None:
            for pos, parent in st.calls[call_position][CALL_PARENTS]:
                if pos == passed and parent >= 0:
                    st.producers[id(old)] = (weakref(old), parent, version_of(old))
                    return
        st.producers.pop(id(old), None)

    def _rebind(self, st, record, new) -> None:
        rec = st.records[record]
        requires_grad = new.requires_grad
        st.records[record] = rec[:2] + (shape_of(new), new.dtype, new.device, requires_grad,
                                        type(new.grad_fn) if requires_grad else None)
        st.producers[id(new)] = (weakref(new), record, version_of(new))
        if st.grads is not None:  # grads=True: the op's gradient is that of the value downstream saw
            st.grads.rewatch(record, new, st.calls, rec)
        if record in st.saved:
            saved = st.release(record)  # the replacement is counted against max_saved_bytes instead
            same_storage = st.saved_by_storage.get(storage_key(saved))
            if same_storage and record in same_storage:
                same_storage.remove(record)
            st.save(record, new, requires_grad)
        if st.finite_flags is not None:
            st.record_finite(record, new)

    def _note(self, record, key, action) -> None:
        """Record that ``action`` ran at ``record``; several sites naming one op are kept in order."""
        applied = self.applied.get(record)
        if applied is None:
            self.applied[record] = Applied(key, action)
        else:
            applied.site = (applied.site if isinstance(applied.site, tuple) else (applied.site,)) + (key,)
            applied.action = (applied.action if isinstance(applied.action, tuple) else (applied.action,)) + (action,)

    def _keep_original(self, record, original) -> None:
        """The value the op made: the first one, when several actions changed it in turn."""
        if original is not None and self.keep_originals and record not in self.originals:
            self.originals[record] = original

    # ----- module sites: forward hooks on the sites' modules -------------------------------------------
    def module_hooks(self, st, root):
        from .module_hooks import ModuleHooks

        return ModuleHooks(self, st, root)

    def sites_of_call(self, module, call_number: int) -> list:
        """The module sites naming this call of ``module`` or every call of it, in the order they were given."""
        by_number = self.by_module[id(module)]
        every, this = by_number.get(None, ()), by_number.get(call_number, ())
        if every and this:
            return [site for _, site in sorted((*every, *this), key=_POSITION)]
        return [site for _, site in (this or every)]

    def at_module_output(self, st, module, module_call: int, call_number: int, output):
        """Apply the module sites matching this call to each tensor it returns; the new output or None."""
        sites = self.sites_of_call(module, call_number)
        # Every tensor the call returns, numbered as the call's record numbers its outputs (capture/modules.py's
        # bound_output: objects' attributes included), so that ``output_index`` names the same tensor in
        # every trace of the call (tl.patch_from reads the source trace's output number ``output_index``).
        leaves = tensor_leaves(output, attrs=True)
        for site in sites:
            # A call returning no tensor (a count, a flag) has nothing to edit: as for a call returning None, an
            # edit site whose every call did so is refused after the run, rather than returned as applied.
            if leaves or site.action is None:
                self.hit.add(id(site))
        sites = [s for s in sites if s.action is not None]
        if not sites or not leaves:
            return None
        address = self._address(module)  # the call's label uses the module's first address, not an alias
        # Only those in containers are edited.  Those in plain objects' attributes (a key/value cache, a state
        # object) are listed in the call's record but not edited here: a cache's tensors were read inside
        # the call, and an object cannot be rebuilt reliably.
        editable = {path for path, _ in tensor_leaves(output)}
        if leaves and not editable:
            raise InterventionError(
                f"module site {sites[0].key!r}: {address}:{call_number} returns its tensors inside a "
                f"{type(output).__name__} object's attributes, which a module site does not edit. "
                + _OUTPUTS_HINT.format(f"{address}:{call_number}"))
        leaves = [(k, path, t) for k, (path, t) in enumerate(leaves) if path in editable]
        replaced: dict = {}  # id(returned tensor) -> the tensor downstream gets
        done: set = set()
        for k, path, t in leaves:
            if id(t) in done:  # the same tensor returned twice is one value
                continue
            done.add(id(t))
            record = self._made_here(st, t, module_call, sites[0], call_number, path)
            info = ModuleCallInfo(address, call_number, module, k, path)
            original = st.saved.get(record)
            current = t
            for site in sites:
                new = self._run_action(st, site.action, current, info, site.key, st.records[record][RECORD_CALL])
                self._note(record, site.key, site.action)
                if new is not None:
                    current = new
            if current is not t:
                if original is not None and (t._base is not None or _aliases(current, t)):
                    original = original.clone()  # a view of a value later ops may write (the output knows)
                st.producers.pop(id(t), None)
                self._rebind(st, record, current)
                self._keep_original(record, original)
                replaced[id(t)] = current
        if not replaced:
            return None
        new_output = output
        for _, path, t in leaves:
            if id(t) in replaced:
                new_output = _replace_at(new_output, path, replaced[id(t)], sites[0].key)
        return new_output

    def _unrecorded(self, t, returned: str) -> InterventionError:
        """The refusal of a module site whose call ``returned`` ``t``, which no op of the trace made: the model's
        own parameter or buffer, returned as it is, or a tensor made where capture cannot see."""
        named = self.tensor_named(t)
        if named is not None:
            return InterventionError(
                f"{returned} the {named[0]} {named[1]} as it is, which no op of the forward makes, so no record holds "
                f"it to change. Intervene at the ops that read it, which {READERS_LISTED[named[0]]} lists")
        return InterventionError(
            f"{returned} a tensor no op of the trace made ({UNSEEN_PLACES}), so no record holds it to change. "
            "Intervene at the ops that read it, or trace the code that makes it as torch calls (a TorchScript "
            "module as it was before scripting)")

    def _made_here(self, st, t, module_call, site, call_number, path=()) -> int:
        """The record of an output tensor made inside this module call and read nowhere inside it; ``path`` is
        where the call's return value holds it, for the refusals."""
        label = f"{site.address}:{call_number}"
        record = st.bound_producer(t)
        made_in = -1
        if record >= 0 and st.records[record][RECORD_CALL] >= 0:
            made_in = st.calls[st.records[record][RECORD_CALL]][CALL_MODULE]
        if record < 0:  # (an input passed through has a record: its input's)
            raise self._unrecorded(t, f"module site {site.key!r}: {label} returns at {path_text('output', path)} "
                                      f"(of shape {tuple(t.shape)})")
        calls = st.module_calls
        if module_call not in enclosing_calls(made_in, lambda k: calls[k][MODULE_CALL_PARENT]):
            raise InterventionError(
                f"module site {site.key!r}: {label} returns at {path_text('output', path)} (of shape "
                f"{tuple(t.shape)}) a tensor it did not compute (an input passed through unchanged, as a T5 block "
                "returns the position bias it was given), so changing it would change it for its other readers. "
                + _OUTPUTS_HINT.format(label))
        producing_call = st.records[record][RECORD_CALL]
        if st.value_record(t) < 0:  # written in place since its op made it: no record holds what is returned
            raise InterventionError(
                f"module site {site.key!r}: {label} returns at {path_text('output', path)} (of shape {tuple(t.shape)}) "
                f"a tensor written in place inside the call after the op that made it "
                f"({func_name_of(st.calls[producing_call][CALL_FUNC])}), as itself or through a view "
                "(hidden[:, -2:].zero_()), so no op's record holds the value it returns, and the call's output_ops "
                "leave it out. Intervene inside the call instead: at the submodule or op that made it (the write "
                f"then applies to the changed value), or at the op that wrote it; a plain trace's log[{label!r}].ops "
                "lists them")
        for later in st.calls[producing_call + 1:]:
            if any(parent == record for _, parent in later[CALL_PARENTS]):
                raise InterventionError(
                    f"module site {site.key!r}: {label} read the tensor it returns at {path_text('output', path)} (of "
                    f"shape {tuple(t.shape)}, made by {func_name_of(st.calls[producing_call][CALL_FUNC])}) inside the "
                    f"call before returning it (read by {self._reader(st, later)}), so the trace could not say which "
                    "value those reads saw. Such calls: a forward hook of the module reading its output (an "
                    "activation cache's output.detach()); eager attention returns the weights its matmul read; a T5 "
                    "attention layer, and the blocks around it, return a position bias added to the scores; a "
                    "Q-Former's pooler reads the first token of the hidden states it returns. "
                    + _OUTPUTS_HINT.format(label)
                    + " (in transformers the first is the hidden states); an attention module returning its weights is "
                    "a module site again when it returns none (transformers' attn_implementation='sdpa', without "
                    "output_attentions)")
        return record

    # ----- after the forward ---------------------------------------------------------------------
    def unmet(self) -> list:
        """Sites that never applied (the forward never reached them)."""
        sites = [s for s in self.label_sites if id(s) not in self.hit]
        sites += [s for s in self.module_sites if id(s) not in self.hit]
        if self.stop_site is not None and self.stopped_at is None:
            sites.append(self.stop_site)
        return sites

    def attach(self, trace) -> None:
        # Each applied intervention is named by its op's label when read from the trace (Trace._applied_at):
        # deriving every label here would cost each intervened trace what a plain trace leaves until read.
        trace._interventions = dict(self.applied)
        # A value a torch.func transform made is its wrapper, unreadable once the transform returns: not kept,
        # as the trace's own activations are not (MADE_IN_TRANSFORM)
        trace._originals = {r: t for r, t in self.originals.items() if not made_in_transform(t)}


def _check_new_value(st, new, value, key, op) -> None:
    """Refuse what an action returned in place of ``value`` unless the ops after the site can read it as they read
    ``value``: a tensor of its shape, dtype, layout and device, and none the forward already holds."""
    if not isinstance(new, torch.Tensor):
        raise InterventionError(f"intervention at {_where(key, op)} returned {type(new).__name__}; an action "
                                "returns a tensor (the new value) or None (keep the value)")
    if not same_shape(new, value) or new.dtype != value.dtype:
        hint = " (a predicate site can keep to float values: lambda op: op.dtype.is_floating_point and ...)" \
            if callable(key) and not value.dtype.is_floating_point else ""
        raise InterventionError(f"intervention at {_where(key, op)} returned a {tuple(shape_of(new))} {new.dtype} "
                                f"tensor for a {tuple(shape_of(value))} {value.dtype} value; an action must keep "
                                "shape and dtype" + hint)
    if new.layout != value.layout or new.is_nested != value.is_nested:
        raise InterventionError(f"intervention at {_where(key, op)} returned a {layout_name(new)} tensor for a "
                                f"{layout_name(value)} value; an action must keep the layout, which decides the "
                                "kernels the ops after it run")
    if new.device != value.device:
        raise InterventionError(f"intervention at {_where(key, op)} returned a tensor on {new.device} for a value "
                                f"on {value.device}; an action must keep the device (move the new value there "
                                "with .to(tensor.device))")
    if new is not value and _held_by_the_forward(st, new):
        raise InterventionError(
            f"the action at {_where(key, op)} returned a tensor the forward already holds (an earlier op's "
            "output, an input, a parameter or a buffer); downstream readers of it could not be told from "
            "readers of the site, so the record would name the wrong parents. Return a copy instead "
            "(return held.clone())")


def _leaf_index(leaves, slot) -> int:
    """Where the output at ``slot`` is among a call's ``(slot, tensor)`` pairs, or -1."""
    for k, (leaf_slot, _) in enumerate(leaves):
        if leaf_slot == slot:
            return k
    return -1


def _argument_position(t, args, kwargs):
    """Where ``t`` was passed to the call (an index or a keyword), or None."""
    for pos, a in enumerate(args):
        if a is t:
            return pos
    for key, a in kwargs.items() if kwargs else ():
        if a is t:
            return key
    return None


def _aliases(new, old) -> bool:
    """Whether an action's value shares memory with the value it replaces (``t.view_as(t)``, ``t.detach()``, ``t``
    itself): the ops after the site may write it in place, which would change the kept original too."""
    return storage_key(new) == storage_key(old)


def _rebuild_output(out, changed):
    """The call's result with the ``(slot, tensor)`` pairs in ``changed`` put in."""
    if isinstance(out, torch.Tensor):
        return changed[0][1]
    if out is None:  # __setitem__: the receiver was written in place
        return out
    for slot, value in changed:
        out = _replace_at(out, slot if isinstance(slot, tuple) else (slot,), value, None)
    return out


def _held_by_the_forward(st, t) -> bool:
    """Whether ``t`` is already a value of the traced forward: an op's output or an input (bound in
    ``producers``), a parameter or a buffer."""
    return st.bound_producer(t) >= 0 or isinstance(t, torch.nn.Parameter) or id(t) in st.buffers


def _replace_at(obj, path: tuple, value, key):
    """``obj`` with the item at ``path`` replaced: containers are copied along the path, never mutated."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, (tuple, list)):
        items = list(obj)
        items[head] = _replace_at(items[head], rest, value, key)
        if isinstance(obj, list):
            return items
        if hasattr(type(obj), "_fields"):  # namedtuple
            return type(obj)(*items)
        return tuple(items) if type(obj) is tuple else type(obj)(items)  # torch.return_types structseqs
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{head: _replace_at(getattr(obj, head), rest, value, key)})
    if isinstance(obj, Mapping):
        copy = dict(obj) if type(obj) is dict else type(obj)(obj)
        copy[head] = _replace_at(obj[head], rest, value, key)
        return copy
    raise InterventionError(f"intervention at {key!r}: cannot rebuild a {type(obj).__name__} output with a changed "
                            "tensor; intervene at the op label of that tensor instead")


def _shown(action) -> str:
    """An action for a message: a helper's repr (``scale(2.0)``), a function's name."""
    if isinstance(action, Action):
        return repr(action)
    return getattr(action, "__qualname__", None) or type(action).__name__
