"""Raw capture state: the flat lists one forward pass fills, and the few helpers the hot path calls.

The raw lists (read only by ``record.finalize``) are ``calls`` (one ``record.columns.Call`` layout
per tensor-producing torch call), ``records`` (one ``Record`` per tensor: a call's output, or a source
whose ``call`` is ``INPUT`` or ``BUFFER``) and ``module_calls`` (one ``ModuleCallRaw`` layout, as a list
filled in while the call runs).  ``record/columns.py`` names and documents every field.  Record index
-1 in ``parents`` means a tensor capture never saw being made (see ``Trace.unattributed``).

A position generalises to any depth: an int (positional argument), a keyword name, or a tuple whose
first element is one of those followed by the path inside that argument (``tree.tensor_leaves``), as
in ``(1, 1)`` for ``idx`` in ``x[..., idx]``.  Non-tensor arguments are held by value (``tree.strip``).

What replay needs beyond that is kept small: the grad mode and autocast state of a call only where
they differ from the trace-wide state (``contexts``; for ``scaled_dot_product_attention`` also the attention
backends it could choose from), and the value of a parameter before each write
the forward made to it (``param_writes``); ``record/replay_context.py`` describes both.
"""

from __future__ import annotations

import operator
from weakref import ref as weakref

import torch

from ..copies import copy_with_layout
from ..tree import is_uninitialized, made_in_transform
from ..record.finite import nonfinite_flags
from ..record.layouts import memory_span, shape_of, sharing_bytes, spans_meet, storage_key, storage_keys, version_of
from ..record.dropped import MADE_IN_TRANSFORM, WRITTEN_UNSEEN, why_stale
from ..record.replay_context import attention_backends, grad_and_autocast

from ..record.columns import BUFFER, CALL_FUNC, CALL_KWARGS, CALL_NUM_OUTPUTS, CALL_PARENTS, INPUT
from . import accel
from .bindings import is_bound
from .budget import SaveBudget
from .fused_writes import stat_slots
from .outside import note_outside
from .pass_through import end_pass_through, note_pass_through, note_returned_arguments
from .unversioned_writes import (UNSEEN, exported_alias, moved_unseen, note_data_write, note_export,
                                 note_unversioned_write, note_write_past_counters, read_not_saved, read_through,
                                 repointed_onto, set_onto_other_bytes, unwritten_since)

_any_autocast = torch._C._is_any_autocast_enabled
_VERSION = operator.attrgetter("_version")

INFERENCE_CAVEAT = ("inference tensors (made under torch.inference_mode()) carry no version counter: in-place "
                    "writes to them were recognised by name only (add_, __setitem__, out=, inplace=True), so a "
                    "write capture could not predict (a fused kernel writing an argument, code running with torch "
                    "function handling disabled, Tensor.set_) is neither attributed nor detected in their saved "
                    "activations")
# The output position (``Written.outputs``) of a tensor a call wrote, not by name, and did not return (a
# compiled submodule writing its input): no output of the call holds its value.
NOT_RETURNED = -1


class CaptureState:
    """Everything one trace accumulates while the model runs."""

    # Set on the instance only when they change (the op handler reads none of them; a source or a
    # failure reads a few): a trace that meets none of these cases does not pay for setting them.
    unattributed = 0  # tensor arguments whose producer capture never saw
    outside: dict | None = None  # id -> weak reference, per tensor of those
    per_example_calls: set | None = None  # positions of calls reading vmap's batched tensors (outside.py)
    # id(Parameter) -> input record, for Parameters passed to the model as inputs: the argument scan files
    # every Parameter as parameter metadata, and finalize turns these back into parent edges.
    parameter_inputs: dict | None = None
    # Output nodes showing the returned tensor itself rather than their producer's (record/finalize.py).
    own_outputs: set | None = None
    save_sources = True  # inputs and buffers; False when a save= selection cannot pick them
    keyed_to = 0  # records below this index that were saved are keyed in ``_by_storage``
    budget_exhausted_at: int | None = None
    held_at_exhaustion: tuple = ()  # the records whose saved tensors filled max_saved_bytes as it ran out
    failure = None  # (func, module call, exception) of the torch call the latest exception left first
    versionless = False  # an inference tensor was seen: in-place writes known by name only
    raised_in = None  # (exception, module call index) where an exception left a module call
    caught_calls = ()  # the module calls an exception left, when the forward is over (capture/caught.py)
    acting = False  # an intervention's action runs: the module calls it makes are none of the forward's
    mode_lifted = False  # the forward took the capture's mode off the function-mode stack (capture/teardown.py)
    # The module traced (not a callable's root=): its own call is the trace, not a module call, while its calls
    # of itself inside that one (recursion) are; ``root_running`` says whether that call is running.
    root = None
    root_running = False
    # [module call, id, previous entry, record] per op returning an argument itself (pass_through.py), or None.
    pass_through: list | None = None
    _watched = ()  # (address, Parameter) of the model: see ``param_storages``
    # The parameters' versions as the forward begins, in the model index's order (set by the trace driver): one
    # that moved by the end with no write seen was written by a call capture cannot see (record/finalize.py,
    # note_unseen_param_writes).
    param_versions_at_start = None
    held_by_compiled = None  # call index of a compiled op -> weak refs to what its module held as it ran (RoutedRun)
    called_elsewhere: set | None = None  # ids of the modules threads not tracing called meanwhile (modules.py)
    compiled_functions = ()  # names of the torch.compile'd functions run with capture aside (compiled_functions.py)
    array_copies: dict | None = None  # id(NumPy array argument) -> (weak reference, copy): see recorded_array
    _param_storages = None
    # Off unless set (the constructor or the trace driver sets them only when on).
    selector = None  # save_mode 2: (func, module call) -> whether to save
    save_device = None
    budget = None  # a SaveBudget (capture/budget.py) under max_saved_bytes=
    # Optional profiler markers (report/markers.py): an object with op_enter(call index) -> token,
    # op_exit(token), module_enter(module call index) and module_exit(module call index).
    markers = None
    intervention = None  # interventions (intervene/runtime.py): called at the calls in ``site_calls``
    site_calls = None  # with it, a frozenset of call positions (label sites): recorded, then handed to at_call

    def __init__(self, *, save_mode: int, selector=None, save_device=None, record_finite: bool = False,
                 buffers: dict | None = None, max_saved_bytes: int | None = None, params=()):
        self.calls: list = []
        self.records: list = []
        self.module_calls: list = []
        self.module_stack: list = []
        self.call_frames: list = []  # per module call: (code, offset) of the user frame that made it
        self.producers: dict = {}  # id(tensor) -> (tensor or weakref, record index, version when bound)
        # storage key -> [(record index, version after the write, memory_span of what it wrote), ...]
        self.writers: dict = {}
        self.last_write = -1  # the latest record in ``writers``: no noted write came after a binding to it or later
        # id(tensor) -> (its binding's reference, how many writes of its storage were found to miss it)
        self.unwritten: dict = {}
        self.data_bases: dict = {}  # id(x.data result) -> (weakref to it, weakref to x)
        self.exports: dict = {}  # address of bytes handed out (note_export) -> weakref to their base tensor
        self.buffers = buffers or {}  # id(buffer tensor) -> (tensor, address)
        # (call index, parent record) read after a write through a view, while the call wrote it through
        # another argument, or of a statistic a kernel wrote
        self.alias_reads: set = set()
        self.recent_alias_reads: list = []  # those noted since a call last recorded nothing (see below)
        # Saving.  save_mode: 0 nothing, 1 everything, 2 ask ``selector`` per op.
        self.save_mode = save_mode
        if selector is not None:
            self.selector = selector
        if save_device is not None:
            self.save_device = save_device
        self.saved: dict = {}  # record index -> detached tensor
        self.saved_versions: dict = {}  # record index -> version when saved (None: our private copy)
        self.batch_counted = None  # (id(statistic) -> slot, batch counters, their versions) at the trace's end
        self._by_storage: dict = {}  # storage key -> [record index, ...]: see ``saved_by_storage``
        self.unkeyed: list = []  # record indices below ``keyed_to`` saved again since (see ``save``)
        if max_saved_bytes is not None:
            self.budget = SaveBudget(max_saved_bytes)
        # No device move and no budget: the hot path saves inline (capture/mode.py).
        self.plain_save = save_device is None and max_saved_bytes is None
        self.clobbered: dict = {}  # record index -> reason its saved value was dropped
        self.finite_flags: dict | None = {} if record_finite else None
        # Replay context: the trace-wide grad/autocast state, the calls that ran under another one, and
        # the model's parameters by storage (their values before an in-place write are kept).
        # grad_and_autocast(), with its one C call reused for ``any_autocast``.
        any_autocast = self.any_autocast = _any_autocast()
        self.context = grad_and_autocast() if any_autocast else (torch.is_grad_enabled(), {})
        self.grad_enabled = self.context[0]
        # call index -> grad_and_autocast() where it differs from ``context`` (+ attention backends)
        self.contexts: dict = {}
        self.param_writes: dict = {}  # id(Parameter) -> [(call index, value before the write or None)]
        if params:  # (address, Parameter) pairs: their storages are read on the first write (param_storages)
            self._watched = params
        self.grads = None  # a capture.grads.GradCapture when tracing with grads=...
        self.suspend = None  # () -> a context manager pausing module-call recording and the shim (session)

    def version(self, t: torch.Tensor):
        """``version_of(t)``, noting when a tensor has no version counter (see ``INFERENCE_CAVEAT``)."""
        try:
            return t._version
        except RuntimeError:
            self.versionless = True
            return None

    # ----- parents -------------------------------------------------------------------------------
    def producer_of(self, t: torch.Tensor) -> int:
        entry = self.producers.get(id(t))
        if entry is not None and is_bound(entry, t):
            version = version_of(t)
            # An inference tensor has no version counter (None): only the writes noted on its storage tell.
            if entry[2] == version and (version is not None or storage_key(t) not in self.writers):
                return entry[1]
            # Its version counter moved since it was bound: a view or base sharing it was written.
            index = self._last_writer_of(t, entry, version)
            # No write capture saw moved it: ``t.set_(y)`` may have put it on y's bytes (a read names y's op).
            holder = self._repointed_onto(t) if self._set_onto_other_bytes(t, entry, version, index) else None
            if holder is not None:
                return self._read_through(t, holder)
            if index is None:  # every such write missed its bytes: still the value that op made
                self.producers[id(t)] = (entry[0], entry[1], version)
                return entry[1]
            # The value read is not that op's output as saved (written through an alias), or unknown (UNSEEN).
            return self._read_not_saved(entry[1] if index == UNSEEN else index)
        return self._source_of(t)

    def _last_writer_of(self, t: torch.Tensor, entry: tuple, version):
        """The record of the latest write since ``t`` was bound (``entry``) that reached ``t``'s bytes, None
        when no write reached them, or ``UNSEEN`` when capture did not see the last write of its storage.
        Writes checked once are not checked again."""
        writes = self.writers.get(storage_key(t))
        if not writes or writes[-1][1] != version:
            return UNSEEN
        span = memory_span(t)
        checked = self.unwritten.get(id(t)) if self.unwritten else None
        checked = checked[1] if checked is not None and checked[0] is entry[0] else 0  # the same binding's
        for k in range(len(writes) - 1, checked - 1, -1):
            record, _, written = writes[k]
            if record <= entry[1]:
                break
            if spans_meet(span, written):
                return record
        self.unwritten[id(t)] = (entry[0], len(writes))
        return None

    note_pass_through = note_pass_through
    note_returned_arguments = note_returned_arguments
    end_pass_through = end_pass_through
    _note_data_write = note_data_write
    note_export = note_export
    _exported_alias = exported_alias
    note_unversioned_write = note_unversioned_write
    _moved_unseen = moved_unseen
    _note_write_past_counters = note_write_past_counters
    _repointed_onto = repointed_onto
    _unwritten_since = unwritten_since
    _set_onto_other_bytes = set_onto_other_bytes
    _read_through = read_through
    _note_outside = note_outside
    _read_not_saved = read_not_saved

    def value_record(self, t: torch.Tensor) -> int:
        """The record whose saved value ``t`` is as a module call takes or returns it: the op it is bound to, or
        -1 when no op made it or a view or base of it was written since (``y = x * 2; y[:, :1].zero_();
        return y``): no op's activation is then the value the call saw (the write's is the view it wrote),
        though the next op reading ``t`` names that write (``producer_of``).  Called with the capture mode on
        (module calls run inside it): tensors' properties are read with torch functions disabled."""
        entry = self.producers.get(id(t))
        if entry is None or not is_bound(entry, t):
            return -1
        if self.last_write <= entry[1]:  # nothing written since it was bound: the common case, no read
            return entry[1]
        with torch._C.DisableTorchFunction():
            version = version_of(t)
            if entry[2] == version and (version is not None or storage_key(t) not in self.writers):
                return entry[1]
            # Written since, or moved with no write seen (``t.set_(y)``: its next read finds y's op).
            index = self._last_writer_of(t, entry, version)
            if index is not None or self._set_onto_other_bytes(t, entry, version, index):
                return -1
        self.producers[id(t)] = (entry[0], entry[1], version)  # every write since missed its bytes
        return entry[1]

    def _add_write(self, key: int, index: int, version, span) -> None:
        """Note that record ``index`` wrote ``span`` of storage ``key``, leaving its version at ``version``."""
        self.writers.setdefault(key, []).append((index, version, span))
        if index > self.last_write:
            self.last_write = index

    def record_holding(self, t: torch.Tensor):
        """The record whose value ``t`` still is (bound to it, and not written since), or None: off the hot
        path, where the handler reads ``producers`` inline."""
        entry = self.producers.get(id(t))
        if entry is not None and is_bound(entry, t) and entry[2] == version_of(t):
            return entry[1]
        return None

    def data_replaced(self, t: torch.Tensor, value) -> None:
        """``t.data = value`` ran: ``t`` now holds ``value``'s memory.  It is bound to the record whose value
        ``value`` still is, or to none (a value capture did not make), so that its next read is of unknown
        origin rather than the op that made its old value."""
        if self._param_storages is not None and isinstance(t, torch.nn.Parameter) and \
                any(p is t for _, p in self._watched):
            self._param_storages = None  # a watched parameter moved to new memory: its key is read again
        index = self.record_holding(value) if isinstance(value, torch.Tensor) else None
        if index is None:
            self.producers.pop(id(t), None)
        else:
            self.producers[id(t)] = (weakref(t), index, version_of(t))

    def note_version_bump(self, t: torch.Tensor) -> None:
        """torch moved ``t``'s version counter by one without writing it: ``Function.apply`` does so for a
        tensor its forward marked dirty (``ctx.mark_dirty``), after the forward's own in-place op, which
        capture saw, wrote it.  The record that op made still holds the value: its binding, the last write
        of its memory and its saved activation move to the new version with it, so that later reads name
        that op (and not its input, or a write capture missed) and its activation is kept."""
        version = version_of(t)
        entry = self.producers.get(id(t))
        if version is None or entry is None or not is_bound(entry, t):
            return
        before = version - 1
        writes = self.writers.get(storage_key(t))
        if writes and writes[-1][1] == before:
            writes[-1] = (writes[-1][0], version, writes[-1][2])
        if entry[2] == before:
            self.producers[id(t)] = (entry[0], entry[1], version)
            if self.saved_versions.get(entry[1]) == before:
                self.saved_versions[entry[1]] = version

    def written_through_alias(self, t: torch.Tensor) -> bool:
        """Whether ``t`` was written through a view or its base since it was bound: the op ``producer_of``
        names for it then made that alias, not ``t``."""
        entry = self.producers.get(id(t))
        return entry is not None and is_bound(entry, t) and entry[2] != version_of(t)

    def bound_producer(self, t: torch.Tensor) -> int:
        """The op a tensor was last bound to, without touching its properties (module hooks run with
        the capture mode active, where every tensor property read would re-enter it)."""
        entry = self.producers.get(id(t))
        return entry[1] if entry is not None and is_bound(entry, t) else -1

    def _source_of(self, t: torch.Tensor) -> int:
        buffer = self.buffers.get(id(t))
        if buffer is not None and buffer[0] is t:
            # By reference, like an activation: a write predicted before the call (in place, or
            # BatchNorm's running statistics in training: capture/fused_writes.py) copies it first.
            return self._add(t, BUFFER, buffer[1], held=True)
        return self._note_outside(t)  # a tensor from outside the trace (capture/outside.py)

    def _add(self, t: torch.Tensor, kind: int, slot, held: bool = False) -> int:
        """Record (and save) a source tensor: each of its properties read once.  ``held``: the tensor is
        held for the whole trace anyway (a buffer, by the model index), so it is bound by itself (see
        ``is_bound``), without a weak reference."""
        index = len(self.records)
        requires_grad = t.requires_grad
        self.records.append((kind, slot, shape_of(t), t.dtype, t.device, requires_grad, None))
        version = self.version(t)
        self.producers[id(t)] = (t if held else weakref(t), index, version)
        if self.save_mode and self.save_sources:
            if self.plain_save and not requires_grad:  # ``save``'s common case, with the version just read
                self.saved[index] = t
                self.saved_versions[index] = version
            else:
                self.save(index, t, requires_grad)
        if self.finite_flags is not None:  # an input's, a parameter's or a buffer's NaN is named as such
            self.record_finite(index, t)
        return index

    def add_source(self, t: torch.Tensor, kind: int, slot) -> int:
        index = self._add(t, kind, slot)
        if kind == INPUT and type(t) is torch.nn.Parameter:
            if self.parameter_inputs is None:
                self.parameter_inputs = {}
            self.parameter_inputs[id(t)] = index
        if self.grads is not None and t.requires_grad:
            self.grads.watch_source(index, t)
        return index

    def note_context(self, call_index: int) -> None:
        """The call about to be recorded ran under another grad mode or autocast state than the trace."""
        context = grad_and_autocast()
        if context != self.context:
            self.contexts[call_index] = context

    def note_attention_backends(self, call_index: int) -> None:
        """The ``scaled_dot_product_attention`` call about to be recorded: the backends it chose its kernel
        from (an ``sdpa_kernel`` block, inside the forward or around it), kept for replay beside its grad mode
        and autocast state, since another backend computes other low bits."""
        self.contexts[call_index] = self.contexts.get(call_index, self.context)[:2] + (attention_backends(),)

    @property
    def param_storages(self) -> dict:
        """Storage key -> Parameter, for the parameters the constructor was given (``params``).

        Keyed on the first write a call makes (only writes ask): a storage read per parameter is the
        largest set-up cost of a trace otherwise, and most forwards write nothing in place.  A
        parameter's storage is the one it has when the forward first writes anything."""
        storages = self._param_storages
        if storages is None:
            storages = self._param_storages = {storage_key(p): p for _, p in self._watched}
        return storages

    def keep_param(self, key: int, call_index: float, before) -> None:
        """Note a write to a parameter by the call ``call_index``: ``before`` is its value before the
        write (None: the write was not predicted, so the old value is lost)."""
        param = self.param_storages.get(key)
        if param is None or is_uninitialized(param):  # a lazy parameter being materialized: no value before
            return
        writes = self.param_writes.setdefault(id(param), [])
        if writes and writes[-1][0] == call_index:
            return  # the predicted write of this call was kept already
        writes.append((call_index, None if before is None else param.detach().clone()))

    def note_writes(self, written: list, record_index: int) -> None:
        """Tensors an op wrote (in place, through ``out=``, or inside a fused kernel), from its first output
        record ``record_index``.  Each is bound to the output it is (``Written.outputs``); one written only
        through another argument stays bound as it was, so that its next read finds the write through the
        alias (``producer_of``) instead of taking an output it is not for its value."""
        outputs = getattr(written, "outputs", None)
        # What a custom op writes by its schema is no output of it when it returns tensors: the write is
        # noted on the storage (a later read finds it there, as a read through an alias), the tensor stays
        # bound as it was; when it returns None, the written tensors are its outputs, bound as recorded.
        by_schema = getattr(written, "by_schema", False)
        count = self.calls[-1][CALL_NUM_OUTPUTS]
        if len(written) > 1:
            # Arguments it wrote that share memory (addmm with out= a view of its input, _foreach_add_ of
            # two views of one tensor): what it made depends on the order its kernel read and wrote, which
            # replay on separate copies of them cannot repeat.
            call_index = len(self.calls) - 1
            for t in sharing_bytes(written):
                entry = self.producers.get(id(t))
                if entry is not None and is_bound(entry, t):
                    self.alias_reads.add((call_index, entry[1]))
        for k, t in enumerate(written):
            key = storage_key(t)
            if self.param_storages:
                self.keep_param(key, len(self.calls) - 1, None)
            position = outputs[k] if outputs is not None else 0
            if position is None:
                continue  # the argument it was written through is noted, with the bytes written
            # Written and returned, it is that output; written and not returned (a compiled submodule writing its
            # input), no output holds its value: the write is noted on the storage alone, as a schema's is.
            bound = not by_schema and position != NOT_RETURNED
            index = record_index + (position if 0 <= position < count else 0)
            version = version_of(t)
            rebound = self._moved_unseen(t, key, version)
            self._add_write(key, index, version, memory_span(t))
            if bound:
                self.producers[id(t)] = (weakref(t), index, version)
            if rebound:
                self._note_write_past_counters(t, index, key)
            alias = self.data_bases.get(id(t))
            if alias is None and bound and self.exports:
                alias = self._exported_alias(t, key)
            if bound and alias is not None and alias[0]() is t and alias[1]() is not None:
                self._note_data_write(t, alias[1](), index, key)
            stale = self.saved_by_storage.pop(key, None)
            if stale:
                for i in stale:
                    if self.saved_versions.get(i) is not None:
                        self._drop(i, "overwritten in place by a write capture could not predict")

    # ----- saving --------------------------------------------------------------------------------
    @property
    def saved_by_storage(self) -> dict:
        """Storage key -> record indices of the activations saved in that memory.

        Keyed lazily: the hot path notes nothing per op (records at or after ``keyed_to`` are the new
        ones), and the keys are computed here, the first time a write needs them (copy-on-write before a
        predicted write, or a write found after a call), so over a trace each record is looked at once.
        A saved tensor keeps its storage alive, so its key is the same now as when it was saved."""
        new = range(self.keyed_to, len(self.records))
        pending = self.unkeyed
        if new or pending:
            by_storage, saved = self._by_storage, self.saved
            for index in (*pending, *new) if pending else new:
                t = saved.get(index)
                if t is None:
                    continue  # not saved, or dropped since (over the budget, or clobbered)
                key = storage_key(t)
                stored = by_storage.get(key)
                if stored is None:
                    by_storage[key] = [index]
                else:
                    stored.append(index)
            pending.clear()
            self.keyed_to = new.stop
        return self._by_storage

    def wants(self, func, module_call: int) -> bool:
        return self.selector(func, module_call)

    def save(self, index: int, t: torch.Tensor, requires_grad: bool) -> None:
        if requires_grad:
            t = t.detach()
        if self.save_device is not None and t.device != self.save_device and t.device.type != "meta":
            self._keep(index, t.to(self.save_device), None)  # a meta tensor has no data to move: kept as it is
            return
        if self.budget is None:  # the common case, inlined
            self.saved[index] = t
            self.saved_versions[index] = self.version(t)
        else:
            self._keep(index, t, self.version(t))
        if index < self.keyed_to:  # saved again (an intervention's replacement): key it on the next write
            self.unkeyed.append(index)

    def _keep(self, index: int, t: torch.Tensor, version) -> None:
        if self.budget is not None and not self.budget.admit(t):
            if self.budget_exhausted_at is None:
                self.budget_exhausted_at = index
                self.held_at_exhaustion = tuple(self.saved)
                self.save_mode = 0
                self.plain_save = False
            return
        self.saved[index] = t
        self.saved_versions[index] = version

    def release(self, index: int) -> torch.Tensor:
        """Let go of the activation saved for ``index`` during the forward; returns it."""
        t = self.saved.pop(index)
        self.saved_versions.pop(index, None)
        if self.budget is not None:
            self.budget.release(t)
        return t

    def protect_saved(self, t, between_calls: bool = False) -> None:
        """Copy every saved activation sharing ``t``'s storage before an in-place write to ``t``: the next call's,
        or (``between_calls``) one made by no call (``t.data = value``), between the last call and the next."""
        for key in storage_keys(t):  # a wrapper subclass's: the memory of every tensor it wraps
            if self.param_storages:  # replay needs the parameter as the ops before this write saw it
                # A write between calls is kept half a call early, so that the next call's own write is kept too.
                self.keep_param(key, len(self.calls) - 0.5 if between_calls else len(self.calls), True)
            stale = self.saved_by_storage.pop(key, None)
            if stale:
                copies: dict = {}
                for i in stale:
                    if i not in self.saved:
                        continue
                    # Changed unseen since it was saved (``u.set_(y)`` put it on other memory), a copy would hold
                    # what it holds now, not what its op made; else it is kept as the later readers saw it.
                    if self.saved_versions.get(i) not in (None, version_of(self.saved[i])):
                        self._drop(i, WRITTEN_UNSEEN)
                    else:
                        self._copy_saved(i, copies)

    def guard_running_stats(self, norms: list, batch) -> None:
        """Keep the running statistics that the norm calls ``norms`` read, saved by reference, true to the
        forward: a later training forward writes them in its kernel, moving no version counter.  A
        BatchNorm's own statistic is watched through its batch counter (``batch``,
        ``ModelIndex.batch_counters``), which that forward moves: the counters' versions are noted once per
        trace, and ``Trace.drop_written`` drops a statistic whose counter has moved since.  Any other is
        copied."""
        calls, saved, versions, watched = self.calls, self.saved, self.saved_versions, batch.slot_of
        held, unwatched = [], []
        for c in norms:
            call = calls[c]
            stats = stat_slots(call[CALL_FUNC], call[CALL_KWARGS])
            for slot, record in call[CALL_PARENTS]:
                if slot in stats and versions.get(record) is not None:  # saved by reference, not copied
                    (held if id(saved[record]) in watched else unwatched).append(record)
        if held:
            try:
                self.batch_counted = (watched, batch.counters, tuple(map(_VERSION, batch.counters)))
            except RuntimeError:  # a counter that is an inference tensor has no version counter
                unwatched += held
        copies: dict = {}
        for record in unwatched:
            if versions.get(record) is not None:  # (a statistic read twice is copied once)
                self._copy_saved(record, copies)

    def _copy_saved(self, index: int, copies: dict) -> None:
        """Save a private copy in place of ``index``'s saved tensor, which a write is about to change.  ``copies``:
        id of a tensor copied for this write -> its copy, so that the records that saved one tensor object (dropout
        in eval mode returns its input itself) share one copy, as they shared the tensor."""
        t = self.saved[index]
        copy = self.saved[index] = copies[id(t)] if id(t) in copies else copies.setdefault(id(t), copy_with_layout(t))
        self.saved_versions[index] = None
        if self.budget is not None:
            self.budget.replaced(t, copy)

    def protect_saved_all(self, out) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.protect_saved(t)

    def _drop(self, index: int, reason: str) -> None:
        if index in self.saved:
            self.release(index)  # and out of the max_saved_bytes count: saving may go on
        self.clobbered[index] = reason

    def record_finite(self, index: int, t: torch.Tensor) -> None:
        # On an accelerator the flags stay on the device and are read once after the forward: no host
        # sync per op.  A meta tensor has no values: its op stays unexamined.
        flags = nonfinite_flags(t, sync=False)
        if flags is not None:
            self.finite_flags[index] = flags

    def check_saved_versions(self) -> list:
        """Drop and report saved activations mutated by means capture could not see."""
        compiled = accel.compiled("_reads")
        mutated = compiled.stale(self.saved, self.saved_versions) if compiled is not None else None
        if mutated is None:  # the compiled check cannot answer (or is not built): the same check here
            mutated = self._stale_in_python()
        for i in mutated:
            self._drop(i, why_stale(self.saved[i]))
        return mutated

    def _stale_in_python(self) -> list:
        """``check_saved_versions``'s reads: drops what a torch.func transform made, and returns the indices
        whose tensor's version changed since it was saved."""
        # A C-level pass and a plain loop: a comprehension is a call of its own (Python 3.11), and most
        # traces drop nothing.
        wrapped, saved = made_in_transform, self.saved
        if any(map(wrapped, saved.values())):
            for i in [i for i, t in saved.items() if wrapped(t)]:
                self._drop(i, MADE_IN_TRANSFORM)
        mutated = []
        for i, v in self.saved_versions.items():
            if v is not None and saved[i]._version != v:
                mutated.append(i)
        return mutated

    # ----- calls that record nothing --------------------------------------------------------------
    def forget_unrecorded_reads(self) -> None:
        """The call just scanned made no tensor, or raised, and is no op: the reads through an alias its scan
        noted (``producer_of``) are no op's, and not the next recorded call's, which takes its call index."""
        call_index, recent = len(self.calls), self.recent_alias_reads  # each read is looked at once here
        self.alias_reads.difference_update([read for read in recent if read[0] == call_index])
        recent.clear()

    def note_failure(self, func, module_call: int, exc: BaseException) -> None:
        if self.recent_alias_reads:
            self.forget_unrecorded_reads()
        if self.failure is None or self.failure[2] is not exc:  # else a call around the one it left first
            self.failure = (func, module_call, exc)


class StopForward(BaseException):
    """Raised at a ``stop_after=`` site (intervene/runtime.py) and caught by the trace driver.  A
    BaseException, so the model's own ``except Exception`` blocks let it through, as they do
    KeyboardInterrupt."""
