"""``Trace``: the record of one forward pass, held as columns, read through light views.

The trace holds plain data only (columns, rows, tensors); every record it hands out (``Op``, ``Layer``,
``ModuleCall``, ``Module``, ``Param``, ``Buffer``) is a view made on demand that refers to the trace, and no
view is kept by the trace.  So there is no reference cycle: a trace is freed, with its activations and
the autograd graph its output holds, as soon as nothing refers to it or to one of its records."""

from __future__ import annotations

import gc
from collections import Counter

import torch

from ..checks import as_position
from ..errors import TorchlensError, TraceCleanedUp, refuse_unknown_keywords
from .columns import Call, Kind
from . import grads as _grads
from . import tables
from .derived import Derived as _Derived
from .dropped import drop_written, op_indices
from .layouts import alias_key, held_bytes
from .lookup import (Ambiguous, LayersByLabel, build_lookup, missing_key_note, module_object_hint, raise_ambiguous,
                     record_name_hint)
from .model_index import holds_packed_weights
from .modules import Module, ModuleCall, call_children, call_ops
from .op import Layer, Op
from .params import Buffer, Param, listed_params
from .trace_columns import TraceColumns
from .view import RecordList, View


_NOT_COPIED = ("a Trace cannot be {} (a live one holds the model and torch's callables; every one holds a record read "
               "on demand): keep one with log.save(path) and read it back, as a separate trace, with tl.load(path)")


class Trace(TraceColumns):
    """Everything one forward pass computed, addressable by label, module call or position.

    ``log['linear_1_1']`` is a Layer, ``log['linear_1_1:2']`` an Op, ``log['fc:2']`` the output op of
    that module call, ``log['fc']`` the Module (or its output op when it ran once), ``log[i]`` and
    ``log[a:b]`` index ops in execution order."""

    loaded_from = None  # the folder a trace read by ``tl.load`` came from (it holds no model)
    rank = world_size = None  # this process's rank and the world size when traced under torch.distributed
    # A loaded trace's function of each call, by qualified name (``torch.distributed.distributed_c10d.gather``):
    # ``tl.load`` sets it, since such a trace holds no functions and names alone are ambiguous (torch.gather).
    saved_func_paths = None
    # Interventions (torchlens.intervene): what was applied where, and the values before (and, in a loaded trace,
    # op index -> why the file holds no value before).
    _interventions, _originals, _originals_unsaved = {}, {}, {}  # (``interventions``: trace_columns.py)
    stopped_after = None  # the stop_after= site the forward was stopped at (output is then None)
    _gradcap = None  # a capture.grads.GradCapture when traced with grads=...
    _packlog = None  # a capture.packing.PackLog when traced with saved_for_backward=True
    caveats: tuple = ()  # guarantees this trace gives only in weakened form, one sentence each
    _ran_elsewhere: tuple = ()  # capture.modules: addresses of the modules called on other threads while traced
    # Set after finalize by the layers named; declared here so this class lists all a Trace holds.
    _flops_col = None  # report.flops.flops_column: each op's FLOPs, derived once (kept by cleanup and save)
    _autocast: dict = {}  # capture.session: device type -> autocast state around the forward, for replay
    _settings: tuple = ()  # capture.session: global_settings() as the forward began and as it ended, for replay
    _root_class = None  # capture.session: the root module's class name (the module table's first row)
    _rootless = False  # capture.session: True for a callable traced with no module to name its modules (no root=)
    _deep = None  # capture.session: the deep= it was traced with (None: a loaded trace does not say)
    _stats_left_nonfinite, _stats_untracked = {}, ()  # capture.session: for nonfinite_origin (debug/nonfinite.py)
    _input_aliases: dict = {}  # capture.session: input slot -> the input op of the tensor an earlier slot named
    _module_call_frames = None  # capture.session: (code, offset) per module call, tells loops from reuse
    _output_structure = None  # io.load: (the output with an OutputSlot per tensor,), from record.saved_output
    _saved_repetition = None  # io.trace_state: in a loaded trace, the live trace's "loop" or "reused" verdict
    _outside_attributes: tuple = ()  # record.finalize: module attributes (not buffers) read from outside the trace
    _replay = None  # record.finalize: a record.replay_context.ReplayContext (contexts, parameter values) for validate
    _held_by_compiled = None  # record.finalize: call index -> weakrefs to what a compiled op's module held as it ran
    _saved_versions = None  # record.finalize: each saved tensor's version at the end (None: capture's own copy)
    _batch_counted = None  # record.finalize: (id(running statistic) -> slot, batch counters, their versions)
    _own_outputs: frozenset = frozenset()  # record.finalize: output nodes showing their own tensor, not the producer's
    _per_example_calls: frozenset = frozenset()  # record.finalize: calls reading vmap's batched tensors
    _param_grads = None  # io.grads: parameter address -> gradient, in a trace read by ``tl.load``
    _unsaved_grads: dict = {}  # io.grads: op index or parameter address -> why its saved gradient is missing
    _param_grads_missing = None  # io.grads: in a trace read by ``tl.load``, why its parameter gradients were not saved
    _grad_stats = None  # record.grads / io.grads: each op's gradient statistics, kept once derived
    _module_param_counts = None  # record.module_table: parameters per module, counted before cleanup
    _params_by_module = None  # record.finalize: id(module) -> (module, [its parameters]) as the forward ran
    _params_listed = True  # io.params: False in a loaded trace whose file predates the parameter table
    _param_counts_from_ops = False  # record.module_table: those counts came from the ops (an older saved file)
    _raw = None  # record.finalize.RawRecord: what the columns below are derived from, until all of them are
    # Built on first read (a trace nobody reads sets none of them), or set by ``cleanup``.
    _calls_named = False  # whether ``calls`` has named the raw call tuples
    _cleaned = False
    _children_col = _lookup = _layer_index_col = _layer_keys = _call_children_col = _call_ops_col = None
    _call_depths_col = _call_op_counts_col = None  # record.modules: each module call's depth, and its ops counted
    _param_rows = _buffer_rows = None  # record.params rows, built on first read of ``params`` / ``buffers``
    _packed_col: dict = {}  # cleanup: op index -> the packed weights it read (``Op.packed_params``)

    # The columns: derived on first read, a group at a time, from ``_raw`` (a trace made by
    # ``record.finalize``), or given to ``__init__`` (a trace read by ``tl.load``).
    _kind = _Derived("columns")
    _call = _Derived("columns")
    _slot = _Derived("columns")
    _meta = _Derived("columns")
    _parents = _Derived("columns")
    _module_call = _Derived("columns")
    _inplace = _Derived("columns")
    _io = _Derived("columns")
    _call_rows = _Derived("modules")  # a record.modules.CallRow per module call
    _module_rows = _Derived("modules")  # a record.modules.ModuleRow per module
    _labels = _Derived("labels")
    _layer_labels = _Derived("labels")
    _pass = _Derived("labels")
    _group = _Derived("labels")
    _group_size = _Derived("labels")
    _types = _Derived("labels")
    _func_names = _Derived("labels")
    _param_addresses = _Derived("params")

    def __init__(self, model_name, calls, activations, dropped, finite, param_addresses, output, model,
                 unattributed, timings, budget_exhausted_at, alias_reads=frozenset(), index=None, raw=None,
                 kind=None, call=None, slot=None, meta=None, parents=None, module_call=None, inplace=None,
                 io=None, labels=None, layer_labels=None, pass_col=None, group=None, group_size=None, types=None,
                 func_names=None, call_rows=None, module_rows=None, call_op_indices=None):
        """Either ``raw`` (``record.finalize.RawRecord``: the columns are derived from it on first read)
        or every column (``tl.load``).  ``finalize`` passes its arguments by position: matching fourteen
        keywords costs about 0.7 us per trace."""
        self.model_name = model_name
        self._calls = calls  # raw call tuples until ``calls`` names them (record/columns.py)
        if raw is not None:
            self._raw = raw
        else:
            self._kind = kind
            self._call = call
            self._slot = slot
            self._meta = meta
            self._parents = parents
            self._module_call = module_call
            self._inplace = inplace
            self._io = io
            self._labels = labels
            self._layer_labels = layer_labels
            self._pass = pass_col
            self._group = group
            self._group_size = group_size
            self._types = types
            self._func_names = func_names
            self._call_rows = call_rows
            self._module_rows = module_rows
            self._call_ops_col = call_op_indices
        self._activations = activations
        self._dropped = dropped
        self._finite = finite
        if param_addresses is not None:  # else derived from ``raw`` on first read
            self._param_addresses = param_addresses
        self._output = output
        self._model = model
        self.unattributed = unattributed
        self.timings = timings
        self.budget_exhausted_at = budget_exhausted_at
        self._alias_reads = alias_reads
        # Only the (address, parameter) list is kept for the lazy Param records, not the whole index.
        self._model_params = index.params if index is not None else None

    def _derive_all(self) -> None:
        """Every derived column, now (before ``cleanup`` releases what they are derived from)."""
        self._kind, self._call_rows, self._labels, self._param_addresses

    # ----- records -------------------------------------------------------------------------------
    @property
    def ops(self) -> RecordList:
        """Every op (inputs, buffers and outputs included) in execution order."""
        return RecordList(self, Op, range(len(self._kind)), tables.ops_frame)

    @property
    def params(self) -> RecordList:
        """The model's parameters and the ops that used each (built on first use)."""
        if not self._params_listed:  # an empty list would say the model had none
            raise TorchlensError(f"log.params: the trace loaded from {self.loaded_from} was saved by an earlier "
                                 "torchlens, which kept no table of the model's parameters; op.params names those each "
                                 "op used, and the summary counts them")
        if self._param_rows is None:
            from .params import build_params, param_states

            states = param_states(self._model_params, self._replay) if self._model_params is not None else None
            self._param_rows = build_params(self, states)
        return RecordList(self, Param, range(len(self._param_rows)), tables.params_frame)

    @property
    def buffers(self) -> RecordList:
        """Every buffer of the model the forward read (``Buffer`` records), in the order first read."""
        if self._buffer_rows is None:
            from .params import build_buffers

            self._buffer_rows = build_buffers(self)
        return RecordList(self, Buffer, range(len(self._buffer_rows)), tables.buffers_frame)

    @property
    def layers(self) -> RecordList:
        """Every layer (an op and its passes, ``Layer`` records), in order of first execution."""
        self._layer_index()
        return RecordList(self, Layer, self._layer_keys, tables.layers_frame)

    @property
    def layers_by_label(self) -> dict:
        """Layer label -> ``Layer``, in order of first execution."""
        return LayersByLabel((label, Layer(self, label)) for label in self._layer_index())

    @property
    def module_calls(self) -> RecordList:
        """Every module call, in the order the calls began."""
        return RecordList(self, ModuleCall, range(len(self._call_rows)), tables.module_calls_frame)

    @property
    def modules(self) -> RecordList:
        """Every module called, in the order of its first call."""
        return RecordList(self, Module, range(len(self._module_rows)), tables.modules_frame)

    def _layer_index(self) -> dict:
        """Layer label -> its op indices, in order of first execution (derived once from the labels)."""
        if self._layer_index_col is None:
            indices: dict = {}
            for i, layer in enumerate(self._layer_labels):
                indices.setdefault(layer, []).append(i)
            self._layer_index_col, self._layer_keys = indices, list(indices)
        return self._layer_index_col

    def _call_children(self) -> list:
        if self._call_children_col is None:
            self._call_children_col = call_children(self._call_rows)
        return self._call_children_col

    def _call_ops(self) -> list:
        """Every module call's op indices, nested calls included: derived on first use, as most traces never ask."""
        if self._call_ops_col is None:
            self._call_ops_col = call_ops(self._call_rows, self._module_call)
        return self._call_ops_col

    # ----- the record model (record/columns.py), read-only --------------------------------------
    @property
    def calls(self) -> list:
        """Every tensor-producing torch call in execution order, as recorded (``record.columns.Call``:
        ``.func``, ``.parents``, ``.module_call``, ``.first_record``, ``.num_outputs`` ...).  An op's call
        is ``op.call``; ``calls[c].first_record`` is the index of its first op."""
        if not self._calls_named:
            # Named on first read, not in finalize: a trace nobody reads per call pays nothing.  In place,
            # since the capture state that filled the list may still hold it.  Without the collector,
            # whose passes over a large trace would cost more than the naming (as tl.trace does).
            collecting = gc.isenabled()
            gc.disable()
            try:
                make = tuple.__new__
                self._calls[:] = [make(Call, c) for c in self._calls]
                self._calls_named = True
            finally:
                if collecting:
                    gc.enable()
        return self._calls

    @property
    def op_children(self) -> list:
        """Each op's child op indices, in execution order (derived on first read), by op index."""
        return self._children()

    @property
    def dropped_activations(self) -> dict:
        """Op index -> why its saved value was dropped (it changed behind capture's back, during the trace or
        since: ``drop_written`` looks first)."""
        self.drop_written()
        return self._dropped

    def drop_written(self, indices=None) -> None:
        """Drop the saved tensors (of ``indices``, or all) written in place, or freed, since their op ran: see
        ``record.dropped.drop_written``.  Readers of the activations call this first."""
        drop_written(self, None if indices is None else op_indices(self, indices))

    def keep_activations(self, kept, dropped=None) -> None:
        """Release every saved activation whose op index is not in ``kept`` (``save=`` filters after the forward),
        and the value an intervention replaced there: ``op.original`` is kept where the op's value is.
        ``dropped``: op index -> why an op the filter wanted holds no value (``SavePolicy.apply``)."""
        self._dropped.update(dropped or ())
        self._activations = {i: t for i, t in self._activations.items() if i in kept}
        if self._originals:
            self._originals = {i: t for i, t in self._originals.items() if i in kept}

    def relabel(self, labels, layer_labels, pass_numbers, groups) -> None:
        """Replace the label columns (a stopped trace takes those of the whole forward); group sizes are recounted."""
        self._types  # the rest of the label group is derived first, so that it never overwrites these
        self._labels, self._layer_labels, self._pass, self._group = labels, layer_labels, pass_numbers, groups
        self._group_size = dict(Counter(groups))  # one pass: a stop late in a long forward has many layers
        self._lookup = self._layer_index_col = None  # derived from the labels: rebuilt on use

    # ----- the reference library's names (see docs/labels.md) -----------------------------------
    @property
    def layer_list(self) -> RecordList:
        """Every op in execution order (the reference's name for ``ops``)."""
        return self.ops

    @property
    def layer_labels(self) -> list:
        """Each layer's label once, in order of first execution."""
        return [layer.layer_label for layer in self.layers]

    @property
    def op_labels(self) -> list:
        """Every op's label (``relu_1_2:3``), in execution order."""
        return list(self._labels)

    @property
    def inputs(self) -> RecordList:
        """The input records (``input_1:1`` ...), one per tensor passed to the forward: indexed as ``ops`` are (a
        plain list took ``log.inputs[True]`` for the second input)."""
        return self._ops_of_kind(Kind.INPUT)

    @property
    def outputs(self) -> RecordList:
        """The output records (``output_1:1`` ...), one per tensor the forward returned."""
        return self._ops_of_kind(Kind.OUTPUT)

    def _ops_of_kind(self, kind) -> RecordList:
        return RecordList(self, Op, [i for i, k in enumerate(self._kind) if k == kind], tables.ops_frame)

    @property
    def output(self):
        """The model's return value, exactly as forward returned it (for a loaded trace: rebuilt from its
        saved tensors and structure, see ``record/saved_output.py``; None when ``stopped_after`` is set:
        the forward was stopped there by ``stop_after=``)."""
        if self._cleaned:
            raise TraceCleanedUp("the trace was cleaned up; its output was released")
        if self.loaded_from is not None:
            from .saved_output import rebuild_output

            return rebuild_output(self)  # plain tuples and dicts around the saved tensors
        return self._output

    @property
    def model(self):
        """The traced model (None for a loaded trace); a cleaned-up trace no longer holds it."""
        if self._cleaned:
            raise TraceCleanedUp("the trace was cleaned up; it no longer holds the model")
        return self._model

    @property
    def num_passes_max(self) -> int:
        """The most passes any layer ran (1 when nothing repeated)."""
        return max(self._group_size.values(), default=1)

    @property
    def is_recurrent(self) -> bool:
        """Whether some layer ran more than one pass (a loop, a module called again)."""
        return self.num_passes_max > 1

    @property
    def saved_bytes(self) -> int:
        """The saved activations' sizes summed, each at its own size, as ``max_saved_bytes`` counts them: not the
        memory they hold, since a view saved with its base counts again, and one saved without it counts its
        own elements while keeping the base's whole storage alive."""
        distinct = {alias_key(t): t for t in self._activations.values()}  # each op's detach of one tensor: once
        return sum(held_bytes(t) for t in distinct.values())

    @property
    def capture_duration(self) -> float:
        """Seconds from the start of ``tl.trace`` to the finished record."""
        return self.timings.get("total", 0.0)

    @property
    def num_backwards(self) -> int:
        """How many backward passes reached this trace's ops (each ``.backward()`` or ``autograd.grad``)."""
        return self._gradcap.backwards if self._gradcap is not None else 0

    def backward(self, loss, gradient=None, retain_graph=None, create_graph=False, inputs=None) -> None:
        """``torch.autograd.backward(loss, ...)``: fills every op's ``.grad`` (trace with ``grads=True``)."""
        # (``_grads`` is imported with this module: an import statement here costs more than the call itself)
        _grads.backward(self, loss, gradient, retain_graph, create_graph, inputs)

    @property
    def saved_for_backward_bytes(self) -> int:
        """Bytes autograd keeps for backward over the whole forward (distinct storages, each once)."""
        from .grads import saved_for_backward_bytes

        return saved_for_backward_bytes(self)

    def saved_for_backward(self):
        """Per module call, what autograd keeps for backward, largest first (``str()`` it, or ``.to_pandas()``)."""
        from .grads import SavedForBackward

        return SavedForBackward(self)

    def _children(self) -> list:
        if self._children_col is None:
            children: list = [[] for _ in self._kind]
            for i, parents in enumerate(self._parents):
                for _, p in parents:
                    if p >= 0 and (not children[p] or children[p][-1] != i):
                        children[p].append(i)
            self._children_col = children
        return self._children_col

    # ----- indexing ------------------------------------------------------------------------------
    def __getitem__(self, key):
        if isinstance(key, bool):  # an int to Python, but never meant as op 0 or op 1
            raise TypeError(f"index a trace with a label string, an int or a slice, not a bool ({key!r})")
        key = as_position(key)  # a NumPy integer is a position, as log.ops takes it
        if isinstance(key, int) and not -len(self) <= key < len(self):
            raise IndexError(f"op index {key} is out of range: this trace has {len(self)} ops "
                             f"(0..{len(self) - 1}, or -1..-{len(self)} from the end)")
        if isinstance(key, (int, slice)):
            return self.ops[key]
        if not isinstance(key, str):
            raise TypeError(f"index a trace with a label string, an int or a slice, not {type(key).__name__}"
                            f"{record_name_hint(key) or module_object_hint(self, key)}")
        found = self._keys().get(key)
        if found is None:
            raise KeyError(f"no op, layer, module call or module named {key!r} in this trace"
                           f"{missing_key_note(self, key)}")
        if type(found) is Ambiguous:
            raise_ambiguous(self, key, found)
        view, view_key = found
        return view(self, view_key)

    def _by_label(self, label: str):
        """The ``Op`` or ``Layer`` of a label this trace handed out (``parents``, ``output_ops``): what
        ``log[label]`` reads, also where a module named like that label makes the key ambiguous."""
        found = self._keys().get(label)
        if type(found) is Ambiguous:
            found = found.first  # the label's: labels claim their keys first
        if found is None:
            return self[label]  # raises, naming the closest keys
        view, view_key = found
        return view(self, view_key)

    def _keys(self) -> dict:
        """Every string key -> what it names (record/lookup.py), built on first use."""
        if self._lookup is None:
            self._lookup = build_lookup(self)
        return self._lookup

    def __contains__(self, key) -> bool:
        if type(key) is str:  # a key naming two things is in the trace too, though log[key] refuses it
            return key in self._keys()
        if isinstance(key, (View, Layer)):  # a record (log['fc:1'], log.params[0]) is in the trace that made it
            return key._trace is self
        if isinstance(key, torch.Tensor):  # False would say no op made it, where the keys are names, not values
            raise TypeError("`in` looks a trace up by label, address, position or record ('linear_1_1:1' in log, op in "
                            "log), not by tensor: the tensors are the ops' values, compared with log[label].activation")
        try:
            self[key]
        except (KeyError, IndexError, TypeError):
            return False
        return True

    def __len__(self) -> int:
        return len(self._kind)

    def __iter__(self):
        return iter(self.ops)

    # A trace holds the live model, torch callables and code objects, and derives its columns from one
    # raw record on first read: a pickle cannot hold it, and a copy would share that record half-derived.
    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_COPIED.format("pickled"))

    def __copy__(self):
        raise TypeError(_NOT_COPIED.format("copied"))

    def __deepcopy__(self, memo):
        raise TypeError(_NOT_COPIED.format("copied"))

    # ----- views and tools -----------------------------------------------------------------------
    def to_pandas(self):
        """A pandas DataFrame with one row per op and a column per field (``log.ops.to_pandas()``)."""
        return self.ops.to_pandas()

    def __str__(self) -> str:
        from .summary import summary_text

        return summary_text(self)

    def __repr__(self) -> str:
        from .summary import repr_text

        return repr_text(self)

    def _repr_html_(self) -> str:
        from ..viz import notebook_html

        return notebook_html(self)

    def summary(self, depth=None):
        """The module tree as a table: one row per module call (``print`` it, or ``.to_pandas()``)."""
        from .module_table import module_summary

        return module_summary(self, depth)

    def validate(self, progress=None):
        """Replay every op from its saved parents and compare (see ``tl.validate``); ``progress`` as there."""
        if self.loaded_from is not None:
            raise TorchlensError(f"this trace was loaded from {self.loaded_from}: replay needs the torch callables "
                                 "and parameters, which saved traces name but do not hold; validate the live "
                                 "model with tl.validate(model, x)")
        from ..validate import validate_trace

        return validate_trace(self, progress=progress)

    @property
    def flops(self):
        """Total analytic forward FLOPs (a multiply-add counts 2); see ``torchlens.report.flops``."""
        from ..report.flops import total_flops

        return total_flops(self)

    def render(self, path=None, **kwargs):
        """Draw the trace (``.html``, ``.svg``, ``.png`` or ``.dot``, by the suffix); with no path, return the
        content.  Options (``view``, ``depth``, ``color_by``, ``format``, ...): ``help(torchlens.viz.render)``."""
        from ..viz import render

        refuse_unknown_keywords("log.render", kwargs, render)
        return render(self, path, **kwargs)

    def show(self, **kwargs):
        """Open the interactive viewer: inline in Jupyter (returns None), else in a browser (returns the
        file's path).  The options are ``render``'s, and ``max_ops`` for a notebook's inline drawing."""
        from ..viz import show

        return show(self, **kwargs)

    def save(self, path, **kwargs):
        """Write the trace to the folder ``path`` (read it back with ``tl.load``) and return the path;
        ``activations=False`` keeps metadata only, ``overwrite=True`` replaces a saved trace there."""
        from ..io import save

        refuse_unknown_keywords("log.save", kwargs, save)
        return save(self, path, **kwargs)

    def to_chrome_trace(self, path, **kwargs):
        """Write a host-clock chrome trace JSON of the ops and module calls (instrumented times, not the
        profiler's clock) to ``path`` and return it; ``module_calls=False`` leaves the module calls out."""
        from ..report.chrome import to_chrome_trace

        refuse_unknown_keywords("log.to_chrome_trace", kwargs, to_chrome_trace)
        return to_chrome_trace(self, path, **kwargs)

    def cleanup(self) -> None:
        """Release every saved activation and every reference to the model and its tensors.

        Metadata (labels, shapes, modules, timings) stays readable; reading an activation afterwards
        raises ``ActivationUnavailable``.  Calling it again does nothing."""
        if self._cleaned:
            return
        self._derive_all()  # from the arguments, parameters and module objects released below
        if self._flops_col is None:
            from ..report.flops import flops_column

            flops_column(self)  # FLOPs are shape metadata: derive them while the arguments are still held
        listed_params(self)  # parameter records keep shapes, not tensors: build them before the index goes
        if holds_packed_weights(self):  # found in the modules and arguments released below
            packed = {op.index: op.packed_params for op in self.ops}
            self._packed_col = {index: names for index, names in packed.items() if names}
        from .module_table import module_param_counts

        module_param_counts(self)  # counted from the module objects, which cleanup releases

        from .grads import release

        release(self)  # gradient statistics stay; the tensors and every hook go
        self._model_params = None
        self._cleaned = True
        self._activations = {}
        self._replay = None  # parameter values kept for replay
        self._originals = {}
        self._output = None
        self._model = None
        self._calls = [c._replace(args=None, kwargs=None, params=()) for c in self.calls]
        for row in self._module_rows:
            row.ref = None

    @property
    def is_cleaned_up(self) -> bool:
        """Whether ``cleanup()`` released the saved activations and the model."""
        return self._cleaned


def checked_trace(value, who: str, wanted: str = "log = tl.trace(model, x)") -> Trace:
    """``value``, which ``who`` (a reader such as ``nonfinite_origin``, or an argument such as ``reference=``)
    takes as a Trace: a model (``nonfinite_origin(model, x)``) or anything else is refused saying what to
    give, instead of failing later on a missing attribute of it."""
    if not isinstance(value, Trace):
        raise TypeError(f"{who} takes a Trace ({wanted}), got {type(value).__name__}: trace the model first and "
                        "pass the trace")
    return value


__all__ = ["Trace", "RecordList", "checked_trace"]
