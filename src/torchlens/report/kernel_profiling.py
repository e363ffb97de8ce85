"""``tl.report.kernel_profile``: profiler time of every captured op and module call, joined by ids.

One traced forward (optionally with its backward) runs inside ``torch.profiler.profile``.  Every
captured op and module call is bracketed by a profiler range named by its id (report/markers.py).
After the profiler closes, its events are joined to those ranges by ids alone (report/profile_join.py):
host aten ops by containment on their thread, device kernels through the CUPTI correlation id of the
runtime call that launched them, backward work through autograd sequence numbers.  Every time figure
is a profiler (Kineto) figure; torchlens only says which op each one belongs to, and how much it could
not place (``.coverage``).

Two ways in: by default torchlens owns the profiler (and refuses to start one inside another); with
``profiler=prof`` it borrows the one you run, adds its ranges, and joins after you close it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch

from ..checks import check_file_to_write, check_model, check_takes
from ..errors import MissingPackage, ProfilerBusyError, closest_hint, counted
from ..tree import as_kwargs
from .markers import ProfilerMarkers
from .profile_coverage import Coverage, find_problems
from .profile_events import events_from_profiler
from .profile_join import Target, join
from .profile_tables import layer_rows, module_rows, op_rows, table_columns

SIDECAR_SUFFIX = ".torchlens.json"
SIDECAR_SCHEMA = "torchlens.kernel_profile_map.v1"


def kernel_profile(model, args=(), kwargs=None, *, backward=False, chrome_trace=None, profiler=None,
                   activities=None, profiler_kwargs=None, name=None) -> "KernelProfile":
    """Profile one traced forward (and optionally backward) and attribute profiler time to ops.

    Args:
        model, args, kwargs: as for ``tl.trace``.  The trace saves no activations (the cheapest tier).
            ``model`` may instead be a trace taken with ``grads=True`` whose backward has not run yet:
            only that backward is profiled (no second forward), see report/backward_profile.py.
        backward: ``True`` runs ``torch.autograd.backward`` on every output that requires grad with
            all-ones gradients; a callable ``f(output)`` runs your own loss and backward instead.  For a
            model, either way the parameters' ``.grad`` end as they were (the backward runs with them set
            aside).  For a trace, the backward is the trace's own, as ``log.backward`` runs it: it fills the
            parameters' ``.grad`` as any backward does, so it can be a training step's backward.
        chrome_trace: a path: write torch's own chrome export of this profile there, untouched, plus
            ``<path>.torchlens.json`` naming its events by op, layer and module call.
        profiler: an entered ``torch.profiler.profile`` you run (borrowed mode): torchlens adds its
            ranges inside it, never steps or closes it; read the result after your ``with`` block.
        activities: profiler activities when torchlens owns the profiler (default CPU, plus CUDA when
            available).  ``profiler_kwargs`` go to ``torch.profiler.profile`` as given (``activities`` there
            counts as ``activities=``).
        name: display name of the trace.
    """
    if backward is not False and backward is not True and not callable(backward):
        raise TypeError("backward must be True, False, or a callable f(output) that runs the backward")
    if callable(backward):  # refused before the forward, not after it in Python's words
        check_takes(backward, 1, "tl.report.kernel_profile: backward is called as backward(output), with the output "
                    "of the traced forward", "give a function that computes a loss from it and runs its backward "
                    "(backward=lambda out: out.sum().backward()), or True for all-ones gradients")
    from ..record.trace import Trace

    if isinstance(model, Trace):  # reuse a trace taken with grads=True: profile its backward only
        from .backward_profile import profile_backward_of

        return profile_backward_of(model, backward, chrome_trace, profiler, activities, profiler_kwargs)
    check_model(model, "tl.report.kernel_profile")
    kwargs = as_kwargs(kwargs, "tl.report.kernel_profile")
    markers = ProfilerMarkers()
    if profiler is not None:
        _check_borrowed(profiler, chrome_trace)
        trace = _run(model, args, kwargs, markers, backward, name)
        return KernelProfile(trace, profiler, markers, borrowed=True, backward=backward is not False)
    if torch._C._autograd._profiler_enabled():
        raise ProfilerBusyError(
            "a torch profiler is already running in this process. Pass it as kernel_profile(..., "
            "profiler=prof) to add torchlens ranges to your profile (borrowed mode), or close it first.")
    check_chrome_path(chrome_trace)
    prof = _own_profiler(activities, profiler_kwargs)
    with prof:
        trace = _run(model, args, kwargs, markers, backward, name)
    result = KernelProfile(trace, prof, markers, borrowed=False, backward=backward is not False)
    if chrome_trace is not None:
        result.export_chrome_trace(chrome_trace)
    return result


def check_chrome_path(path) -> None:
    """Refuse a ``chrome_trace=`` path that cannot be written before anything runs: the file is written after
    profiling, and a failure then would lose the profile."""
    if path is None:
        return
    advice = "name a file in an existing folder (a str or a pathlib.Path); it is written after the profile is taken"
    path = check_file_to_write(path, "chrome_trace", advice, who="kernel_profile")
    # The id map is written beside it: a new file, which its folder must take.
    check_file_to_write(os.fsdecode(path) + SIDECAR_SUFFIX, "chrome_trace", f"{advice}, with its id map beside it",
                        who="kernel_profile")


def _own_profiler(activities, profiler_kwargs):
    """The profiler torchlens owns: it runs one step, its first, and is never stepped.  A schedule that
    leaves that step unrecorded would measure nothing, so it is refused before the model runs."""
    if profiler_kwargs is not None and not isinstance(profiler_kwargs, Mapping):
        raise TypeError(f"profiler_kwargs= is a dict of torch.profiler.profile's keyword arguments "
                        f"(profiler_kwargs={{'record_shapes': True}}), got {type(profiler_kwargs).__name__}")
    profiler_kwargs = dict(profiler_kwargs or {})
    if "activities" in profiler_kwargs:  # torch.profiler.profile's own keyword, so given there too: read as activities=
        if activities is not None:
            raise TypeError("activities were given twice, as activities= and in profiler_kwargs; give them once")
        activities = profiler_kwargs.pop("activities")
    activities = _listed_activities(activities) if activities is not None else _default_activities()
    _check_activities(activities)
    prof = torch.profiler.profile(activities=activities, **profiler_kwargs)
    recording = (torch.profiler.ProfilerAction.RECORD, torch.profiler.ProfilerAction.RECORD_AND_SAVE)
    if prof.current_action not in recording:
        raise ValueError(
            f"the schedule in profiler_kwargs does not record the profiler's first step ({prof.current_action.name}"
            "), and that step is the only one kernel_profile runs (it never calls step()): nothing would be "
            "measured. Drop the schedule, or run your own scheduled profiler and pass it as "
            "kernel_profile(..., profiler=prof) in a step it records.")
    return prof


def _listed_activities(activities) -> list:
    """``activities`` as a list of ProfilerActivity values, the defaults for an empty one: ``activities=3`` failed
    in ``list()``, ``["cpu"]`` inside torch's profiler, and ``""`` or ``0`` was taken for the defaults."""
    activity = torch.profiler.ProfilerActivity
    listed = list(activities) if isinstance(activities, (list, tuple, set, frozenset)) else None
    if listed is None or not all(isinstance(a, activity) for a in listed):
        raise TypeError(f"activities= is a list of torch.profiler.ProfilerActivity values "
                        f"([torch.profiler.ProfilerActivity.CPU]), got {activities!r}")
    return listed or _default_activities()


def _check_activities(activities) -> None:
    """Refuse activities that leave nothing to record: torch drops CUDA where it is not available (with a
    warning) and then fails on the empty list with a bare assertion."""
    cuda = torch.profiler.ProfilerActivity.CUDA
    if activities and all(a == cuda for a in activities) and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(f"activities={activities} asks for CUDA only, and {why}, so the profiler would record "
                         "nothing; profile the host with activities=[torch.profiler.ProfilerActivity.CPU], or leave "
                         "activities out (the CPU, and CUDA where it is available)")


def _default_activities() -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def _check_borrowed(profiler, chrome_trace) -> None:
    if not hasattr(profiler, "export_chrome_trace") or not hasattr(profiler, "profiler"):
        raise TypeError(f"profiler= takes a torch.profiler.profile object, got {type(profiler).__name__}")
    if profiler.profiler is None or not torch._C._autograd._profiler_enabled():
        raise ValueError("the profiler passed as profiler= is not recording now: call kernel_profile inside "
                         "its `with torch.profiler.profile(...) as prof:` block, in a step its schedule records")
    if chrome_trace is not None:
        raise ValueError("with a borrowed profiler the trace only exists once you close it: call "
                         "result.export_chrome_trace(path) after your `with` block")


def _run(model, args, kwargs, markers, backward, name):
    from ..capture.restore import backward_leaves, grads_set_aside, module_run_by
    from ..capture.session import trace_with_markers

    try:
        markers.phase_enter("forward")
        trace = trace_with_markers(model, args, kwargs, markers, save="none", name=name)
        if backward is not False:
            # Every leaf the backward may write .grad into: the parameters, and the inputs and other tensors
            # the forward read that require grad (an optimizer may hold those too).
            kept = backward_leaves(trace, module_run_by(model), trace.output)
            markers.phase_enter("backward")
            with grads_set_aside(kept):
                run_backward(trace, backward)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # every launched kernel finishes inside the profile
    finally:
        markers.close()
    return trace


def run_backward(trace, backward) -> None:
    """The profiled backward of ``trace``'s output.  Autograd's refusal of a value the forward overwrote after
    saving it names only a shape and a version: it gets the note naming the forward's in-place writes."""
    from ..record.grads import note_model_writes

    try:
        _run_backward(trace.output, backward)
    except RuntimeError as exc:
        note_model_writes(trace, exc)
        raise


def _run_backward(output, backward) -> None:
    if callable(backward) and backward is not True:
        backward(output)
        return
    from ..tree import tensor_leaves

    roots = [t for _, t in tensor_leaves(output) if t.requires_grad]
    if not roots:
        raise ValueError("backward=True needs a model output that requires grad; none does (eval under "
                         "no_grad, or integer outputs). Pass backward=f(output) to run your own loss.")
    torch.autograd.backward(roots, grad_tensors=[torch.ones_like(t) for t in roots])


class KernelProfile:
    """Profiler time per op, layer and module call of one traced run, with its coverage.

    Built by ``kernel_profile``.  ``events=`` (a list of ``profile_events.Event``) joins those events
    instead of reading ``profiler``: a trace read back from disk with ``events_from_chrome``."""

    def __init__(self, trace, profiler, markers, *, borrowed: bool, backward: bool, events=None,
                 backward_nodes=None, backward_numbered=frozenset()):
        self.backward_nodes = backward_nodes  # {sequence number: call} for a backward-only profile
        self.backward_numbered = backward_numbered  # there: the calls known to have made their nodes, or none
        self.trace = trace
        self.profiler = profiler
        self.markers = markers
        self.borrowed = borrowed
        self.backward = backward
        self._events = events
        self._joined = None
        self._tables: dict = {}
        self._index = None

    # ----- the join (lazy: a borrowed profiler is only readable once its owner closed it) ---------
    def _join(self):
        if self._joined is None:
            events = self._events if self._events is not None else events_from_profiler(self.profiler)
            if self.backward_nodes is not None:
                from .backward_profile import join_backward

                serial_of_call, joined, problems = join_backward(self, events)
            else:
                serial_of_call = {c: s for s, c in self.markers.resolve_calls(len(self.trace.calls)).items()}
                functions = {seq: serial_of_call[c] for seq, c in self.markers.function_nodes.items()
                             if c in serial_of_call}
                joined = join(events, self.markers.run, set(serial_of_call.values()), function_nodes=functions)
                problems = find_problems(joined, len(self.trace.module_calls), serial_of_call)
            rows = op_rows(self.trace, serial_of_call, joined, self.backward)
            self._joined = (joined, Coverage(joined, problems), rows, serial_of_call)
            self._events = None
        return self._joined

    @property
    def coverage(self) -> Coverage:
        """What the join attributed to ops and module calls, and what it could not, by reason."""
        return self._join()[1]

    @property
    def complete(self) -> bool:
        """Whether the join is complete (see ``coverage.problems`` when it is not)."""
        return self.coverage.complete

    @property
    def has_device(self) -> bool:
        """Whether the profile recorded device activity (a CPU-only run's has none, so no device time)."""
        return self._join()[0].has_device

    def _table(self, level: str) -> list:
        tables = self._tables
        if level not in tables:
            joined, _, rows, _ = self._join()
            if level == "op":
                tables[level] = [{k: v for k, v in row.items() if k != "_index"} for row in rows]
            elif level == "layer":
                tables[level] = layer_rows(self.trace, rows, self.backward)
            else:
                tables[level] = module_rows(self.trace, rows, joined, self.backward)
        return tables[level]

    @property
    def ops(self) -> list:
        """One dict per captured call (multi-output calls: one row, extra labels in ``outputs``)."""
        return [dict(row) for row in self._table("op")]

    @property
    def layers(self) -> list:
        """One dict per layer: the figures of its passes summed (``passes`` counts them)."""
        return [dict(row) for row in self._table("layer")]

    @property
    def module_calls(self) -> list:
        """Per module call: inclusive figures, and ``self_*`` ones (its own ops and direct work)."""
        return [dict(row) for row in self._table("module")]

    def __getitem__(self, label: str) -> dict:
        """The row of an op label (``linear_1_1:1``), a layer (``linear_1_1``) or a module call."""
        if self._index is None:
            index: dict = {}
            for level, key in (("module", "module_call"), ("layer", "layer"), ("op", "op")):
                for row in self._table(level):
                    index[row[key]] = row
                    for extra in row.get("outputs", ()):
                        index.setdefault(extra, row)
            self._index = index
        row = self._index.get(label)
        if row is None and not isinstance(label, str):  # the spelling hint below compares strings
            raise TypeError(f"a profile's rows are found by label, an op ('linear_1_1:1'), a layer or a module call "
                            f"('fc1:1'), not {type(label).__name__} {label!r}")
        if row is None:  # a module's second name (shared, or registered twice) says how its calls are labelled
            from ..record.lookup import alias_note

            raise KeyError(f"no op, layer or module call {label!r} in this profile"
                           f"{alias_note(self.trace, label) or closest_hint(label, self._index)}")
        return dict(row)

    def device_time(self, label: str):
        """Device nanoseconds of an op, layer or module call (inclusive); None when not measured.  A profile that
        recorded no device activity (a CPU-only run) has no device time to give: refused, naming the CPU time."""
        row = self[label]
        if not self.has_device:  # None would read as "this op was not measured", when no op could be
            raise ValueError(f"no device time for {label!r}: this profile recorded no device activity (a CPU-only run"
                             ": the profiler times device kernels only for a model on a GPU, with "
                             "ProfilerActivity.CUDA); its self CPU time is profile[label]['cpu_ns']")
        return row["device_ns"]

    def to_pandas(self, level: str = "op"):
        """A DataFrame of ``level`` ``"op"``, ``"layer"`` or ``"module"`` rows."""
        if level not in ("op", "layer", "module"):
            raise ValueError(f"level must be 'op', 'layer' or 'module', got {level!r}")
        try:
            import pandas as pd
        except ImportError as exc:
            raise MissingPackage("KernelProfile.to_pandas needs pandas: pip install pandas") from exc
        rows = self._table(level)
        return pd.DataFrame(rows) if rows else pd.DataFrame(columns=table_columns(level, self.backward))

    # ----- chrome trace + sidecar -----------------------------------------------------------------
    def export_chrome_trace(self, path) -> tuple:
        """Write torch's own chrome export to ``path`` and the id map beside it; returns both paths."""
        path = check_file_to_write(path, "path", "name a file in an existing folder (a str or a pathlib.Path)",
                                   who="export_chrome_trace")
        if self.profiler is None:
            raise ValueError("this profile was built from events, not a live profiler: nothing to export")
        self._join()  # also checks the profiler is closed
        self.profiler.export_chrome_trace(path, use_python_export=True)
        sidecar = path + SIDECAR_SUFFIX
        with open(sidecar, "w") as f:
            json.dump(self.sidecar(os.path.basename(path)), f, indent=1)
        return path, sidecar

    def sidecar(self, trace_file: str = "") -> dict:
        """Map from native trace event identities to op, layer and module call labels."""
        joined, coverage, rows, serial_of_call = self._join()
        call_of_serial = {s: c for c, s in serial_of_call.items()}
        row_of_call = {c: rows[c] for c in range(len(rows))}
        module_calls = self.trace.module_calls

        def describe(target: Target):
            if target.kind == "op":
                row = row_of_call[call_of_serial[target.key]] if target.key in call_of_serial else None
                if row is None:
                    return {"op": None, "note": "a torch call that produced no op"}
                return {"op": row["op"], "layer": row["layer"], "module_call": row["module"],
                        "phase": target.phase}
            return {"module_call": module_calls[target.key].label}

        markers = {}
        for serial in range(len(self.markers.op_calls)):
            name = self.markers.op_name(serial)
            if name in joined.marker_ids:
                markers[name] = {"kind": "op", **describe(Target("op", serial, "forward"))}
        for index in range(len(module_calls)):
            name = self.markers.module_name(index)
            if name in joined.marker_ids:
                markers[name] = {"kind": "module_call", "module_call": module_calls[index].label}
        for phase in self.markers.phases:
            name = self.markers.phase_name(phase)
            if name in joined.marker_ids:
                markers[name] = {"kind": "phase", "phase": phase}
        return {
            "schema": SIDECAR_SCHEMA,
            "trace_file": trace_file,
            "clock": "The trace file is torch's own chrome export, unmodified, on the profiler's (Kineto) "
                     "clock. This map only names its events; it adds no times.",
            "model": self.trace.model_name,
            "torch": torch.__version__,
            "keys": {"markers": "event name", "external_ids": "args['External id'] of host events",
                     "correlations": "args['correlation'] of runtime and device events"},
            "markers": markers,
            "marker_external_ids": {k: v for k, v in joined.marker_ids.items() if k in markers},
            "external_ids": {str(k): describe(v) for k, v in joined.external_ids.items()},
            "correlations": {str(k): describe(v) for k, v in joined.correlations.items()},
            "complete": coverage.complete,
            "problems": coverage.problems,
        }

    # ----- printing --------------------------------------------------------------------------------
    def __str__(self) -> str:
        from .profile_text import profile_text

        return profile_text(self)

    def __repr__(self) -> str:
        state = "pending (profiler still open)" if self._joined is None and self.borrowed else "joined"
        return f"<KernelProfile of {self.trace.model_name}: {counted(len(self.trace.calls), 'torch call')}, {state}>"
