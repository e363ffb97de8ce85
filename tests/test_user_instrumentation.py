"""A trace inside the user's own instruments: their profiler, modes and function transforms.

What each instrument saw, and what is still installed afterwards, must be what it would be around an
untraced forward, or what docs/capture_honesty.md says it sees; a combination torchlens cannot serve is
refused with an error naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

import torchlens as tl
from untouched import assert_clean_process

PROFILED_FIRST_TRACE = """
import importlib.machinery, sys
import pytest
import torch
import torchlens as tl
from torch.profiler import ProfilerActivity, profile

model, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(2, 4, requires_grad=True)
with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
    before = set(sys.modules)
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    imported = set(sys.modules) - before
extension = lambda name: str(getattr(sys.modules[name], "__file__", "")).endswith(
    tuple(importlib.machinery.EXTENSION_SUFFIXES))
print(sorted(filter(extension, imported)))
print(len([event.name for event in prof.events()]) > 0)
"""


@pytest.mark.picks_its_path  # the child traces on the compiled path whatever the suite's path is
def test_the_first_trace_inside_a_users_stack_profiler_leaves_its_events_readable():
    # The first trace of a process imported torchlens-accel's compiled modules inside the block; torch's
    # Python tracer (with_stack=True) then held freed names, and prof.events() raised UnicodeDecodeError.
    env = dict(os.environ, TORCHLENS_ACCEL="1")
    run = subprocess.run([sys.executable, "-c", PROFILED_FIRST_TRACE], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:2] == ["[]", "True"], run.stdout


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.norm, self.head = nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.norm(F.gelu(self.fc(x)) + x)).softmax(-1)


class DispatchLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


class Logged(torch.Tensor):
    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_users_dispatch_mode_and_flop_counter_see_the_models_kernels_plus_one_detach_per_saved_output():
    model, x = Net(), torch.randn(4, 6)
    with DispatchLog() as untraced:
        expected = model(x)
    with DispatchLog() as traced:
        log = tl.trace(model, x)
    assert torch.equal(log.output, expected) and not _get_current_dispatch_mode_stack()
    extra = Counter(traced.calls) - Counter(untraced.calls)
    assert not Counter(untraced.calls) - Counter(traced.calls)
    assert extra == Counter({"aten.detach.default": sum(op.kind == "op" for op in log.ops)})
    with FlopCounterMode(display=False) as plain:
        model(x)
    with FlopCounterMode(display=False) as counted:
        tl.trace(model, x)
    assert counted.get_total_flops() == plain.get_total_flops() > 0


def test_a_subclass_with_its_own_torch_function_sees_the_models_calls_plus_captures_reads():
    model, x = Net(), torch.randn(4, 6).as_subclass(Logged)
    Logged.calls = []
    expected = model(x)
    untraced, Logged.calls = Logged.calls, []
    log = tl.trace(model, x)
    assert not Counter(untraced) - Counter(Logged.calls)
    assert set(Counter(Logged.calls) - Counter(untraced)) == {"__get__", "detach"}
    assert torch.equal(log.output, expected) and type(log.output) is Logged
    assert log.validate().passed


def test_a_flop_counters_module_hooks_run_in_the_forward_and_are_recorded_as_ops():
    # Documented: for a leaf input that requires grad, ModuleTracker's hooks (FlopCounterMode's) call view_as.
    model, x = Net(), torch.randn(4, 6, requires_grad=True)
    with FlopCounterMode(display=False):
        log = tl.trace(model, x)
    assert torch.equal(log.output, model(x))
    assert [op.label for op in log.ops[:4]] == ["input_1:1", "viewas_1_1:1", "viewas_2_2:1", "linear_1_3:1"]
    assert [op.label for op in tl.trace(model, x).ops[:2]] == ["input_1:1", "linear_1_1:1"]


class _CountsCalls(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_mode_entered_before_the_trace_and_exited_inside_the_forward_is_refused_rather_than_cutting_the_trace():
    # Exiting a mode pops the top of torch's stack, which was the capture's: the linear and tanh after the hook
    # ran unseen, and the trace came back holding the first two ops, its output an op with no parent.
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh()), torch.randn(2, 4)
    counting = _CountsCalls()
    counting.__enter__()
    handle = model[1].register_forward_hook(lambda module, args, output: counting.__exit__(None, None, None))
    try:
        with pytest.raises(RuntimeError, match=r"took the capture's mode off torch's function-mode stack.*"
                                               r"Enter and exit the mode both inside the forward"):
            tl.trace(model, x)
    finally:
        handle.remove()
        while torch._C._len_torch_function_stack():  # the mode the hook meant to exit stays, as the error says
            torch._C._pop_torch_function_stack()
    assert_clean_process()
    with _CountsCalls() as around:  # entered and exited around the trace: traced as usual, and counted
        log = tl.trace(model, x)
    assert [op.type for op in log.ops] == ["input", "linear", "relu", "linear", "tanh", "output"]
    assert around.calls >= 4 and torch.equal(log.output, model(x)) and log.validate().passed
