"""Module call recorders are built once per thread and rebound to each trace (capture/modules.py).

A trace binds its thread's recorders to its own state when it starts and unbinds them when it ends: each
trace records exactly its own module calls, a recorder reached after its trace ended records nothing, and
a thread that traces gets recorders of its own.  Checked on both paths (compiled recorder and Python).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.capture import call_impl

from accel_paths import on_path


class _Seen(nn.Module):
    """Two children called from user code; notes what receives module calls during its forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.receivers = []

    def forward(self, x):
        self.receivers.append(call_impl.receiver())
        return self.b(self.a(x).relu())


def _paths():
    from torchlens.capture import accel

    return [False, True] if accel.available() else [False]


@pytest.mark.parametrize("compiled", _paths())
def test_consecutive_traces_share_one_recorder_and_record_only_their_own_calls(compiled):
    model, x = _Seen(), torch.randn(2, 4)
    with on_path(compiled):
        first, second = tl.trace(model, x), tl.trace(model, torch.randn(3, 4))
    assert model.receivers[0] is model.receivers[1]  # kept for the thread, not built per trace
    assert [mc.label for mc in first.module_calls] == [mc.label for mc in second.module_calls] == ["a:1", "b:1"]
    assert first["linear_1_1"].shape == (2, 4) and second["linear_1_1"].shape == (3, 4)
    assert torch.equal(first.output, model(x))


@pytest.mark.parametrize("compiled", _paths())
def test_a_recorder_reached_after_its_trace_ended_runs_the_call_and_records_nothing(compiled):
    model, x = _Seen(), torch.randn(2, 4)
    with on_path(compiled):
        log = tl.trace(model, x)
    recorder = model.receivers[0]
    assert call_impl.receiver() is not recorder  # torch's own is back in place
    out = recorder(model.a, x)  # e.g. a call that looked the recorder up just before the trace ended
    assert torch.equal(out, model.a(x))
    assert [mc.label for mc in log.module_calls] == ["a:1", "b:1"]  # read after that call: not in it
    assert [mc.label for mc in tl.trace(model, x).module_calls] == ["a:1", "b:1"]


@pytest.mark.parametrize("compiled", _paths())
def test_each_thread_traces_with_recorders_of_its_own(compiled):
    model, x = _Seen(), torch.randn(2, 4)
    with on_path(compiled):
        tl.trace(model, x)
        logs = []
        worker = threading.Thread(target=lambda: logs.append(tl.trace(model, x)))
        worker.start()
        worker.join()
        tl.trace(model, x)
    main, other, again = model.receivers
    assert main is again and other is not main
    assert [mc.label for mc in logs[0].module_calls] == ["a:1", "b:1"]
