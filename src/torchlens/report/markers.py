"""Profiler ranges that name each captured op and module call by id, for an exact join afterwards.

``capture.session.trace_with_markers(..., ProfilerMarkers())`` calls ``op_enter``/``op_exit`` around each torch call
the capture sees and ``module_enter``/``module_exit`` around every module call.  Each opens a profiler
range whose name is an id, never a label (labels only exist after the forward finishes):

    torchlens::op::<run>.<serial>        one torch call, serial = order of entry
    torchlens::module::<run>.<index>     one module call, index into ``trace.module_calls``
    torchlens::phase::<run>.<phase>      the whole forward / backward

``run`` is unique per profile in this process, so two profiles inside one borrowed profiler never
share a name.  A call that returns no tensor is not an op, so it leaves no entry in ``trace.calls``
and the next call reuses its call index; ``resolve_calls`` maps serials back to calls afterwards.

The ranges use ``torch._C._profiler._RecordFunctionFast``: about 3 us per range where
``torch.profiler.record_function`` costs ten times that, which matters with one range per op.
Kineto records them as ``cpu_op`` events; the join tells them from aten ops by this grammar.
"""

from __future__ import annotations

import itertools
import re

import torch

_RecordFunctionFast = torch._C._profiler._RecordFunctionFast
_runs = itertools.count(1)

PREFIX = "torchlens::"
_GRAMMAR = re.compile(r"torchlens::(op|module|phase)::(\d+)\.(\w+)\Z")


def parse_marker(name: str):
    """``(kind, run, key)`` for a torchlens marker name, else None.  ``key`` is an int for op/module."""
    if not name.startswith(PREFIX):
        return None
    found = _GRAMMAR.match(name)
    if found is None:
        return None
    kind, run, key = found.group(1), int(found.group(2)), found.group(3)
    if kind != "phase":
        if not key.isdigit():
            return None
        key = int(key)
    return kind, run, key


class ProfilerMarkers:
    """The ``markers`` object a marked trace drives: one profiler range per op and module call."""

    def __init__(self, run: int | None = None):
        self.run = next(_runs) if run is None else run  # pass ``run`` only to re-read a saved trace
        self._op_prefix = f"torchlens::op::{self.run}."
        self._module_prefix = f"torchlens::module::{self.run}."
        self.op_calls: list = []  # serial -> call index the capture was about to use
        self.function_nodes: dict = {}  # a custom Function's node number -> the call that made its output
        self.phases: list = []
        self._open_modules: dict = {}  # module call index -> open range
        self._open_phase = None

    # ----- the capture hook (keep these flat: they run once per op) ------------------------------
    def op_enter(self, call_index: int):
        serial = len(self.op_calls)
        self.op_calls.append(call_index)
        record = _RecordFunctionFast(self._op_prefix + str(serial))
        record.__enter__()
        return record

    def op_exit(self, record) -> None:
        record.__exit__(None, None, None)

    def module_enter(self, module_call_index: int) -> None:
        record = _RecordFunctionFast(self._module_prefix + str(module_call_index))
        record.__enter__()
        self._open_modules[module_call_index] = record

    def module_exit(self, module_call_index: int) -> None:
        record = self._open_modules.pop(module_call_index, None)
        if record is not None:
            record.__exit__(None, None, None)

    def function_node(self, sequence_number: int, call_index: int) -> None:
        """A ``Function.apply`` gave the output of call ``call_index`` its backward node: that node's backward
        belongs to the call, as a backward-only profile of a trace with gradients has it.  The first output
        named keeps the node (the trace's gradient capture keeps the first too)."""
        self.function_nodes.setdefault(sequence_number, call_index)

    # ----- phases and teardown ------------------------------------------------------------------
    def phase_enter(self, phase: str) -> None:
        self.phase_exit()
        self._open_phase = _RecordFunctionFast(f"torchlens::phase::{self.run}.{phase}")
        self._open_phase.__enter__()
        self.phases.append(phase)

    def phase_exit(self) -> None:
        if self._open_phase is not None:
            self._open_phase.__exit__(None, None, None)
            self._open_phase = None

    def close(self) -> None:
        """Close every range still open (a module that raised skips its exit), innermost first."""
        for index in sorted(self._open_modules, reverse=True):
            self._open_modules.pop(index).__exit__(None, None, None)
        self.phase_exit()

    # ----- names and resolution -----------------------------------------------------------------
    def op_name(self, serial: int) -> str:
        return self._op_prefix + str(serial)

    def module_name(self, index: int) -> str:
        return self._module_prefix + str(index)

    def phase_name(self, phase: str) -> str:
        return f"torchlens::phase::{self.run}.{phase}"

    def resolve_calls(self, num_calls: int) -> dict:
        """``{serial: call index}`` for the serials that became ops.

        Serials that share a call index belong to calls that returned no tensor, except the last one,
        which is the call the capture recorded (recording advances the index)."""
        last: dict = {}
        for serial, call in enumerate(self.op_calls):
            if call < num_calls:
                last[call] = serial
        return {serial: call for call, serial in last.items()}
