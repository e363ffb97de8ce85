"""capture/dispatch.py: Python-level torch functions reach the capture mode without torch's dispatcher,
and the record is the one torch's own dispatch gives."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import torchlens as tl
from torchlens.capture import dispatch

from accel_compare import _same_state, _same_trace, states  # noqa: F401  (states: a fixture)
from accel_paths import PATHS, on_path
from untouched import assert_clean_process
from zoo import zoo

TORCH_OWN = torch.overrides.handle_torch_function


def _torch_dispatch_calls(run) -> int:
    """How many times ``run()`` enters torch's own ``handle_torch_function``."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is TORCH_OWN.__code__:
            calls[0] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls[0]


def _two_ways(states, monkeypatch, run):  # noqa: F811
    """``run()`` traced with capture's dispatcher and with torch's own, from the same RNG state; the two
    capture states and traces must be the same."""
    torch.manual_seed(0)
    fast = run()
    with monkeypatch.context() as patched:
        patched.setattr(dispatch, "install", lambda: None)
        torch.manual_seed(0)
        own = run()
    (fast_state, _), (own_state, _) = states[-2:]
    _same_state(fast_state, own_state)
    _same_trace(fast, own)
    return fast


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("name", sorted(zoo()))
def test_every_zoo_model_records_the_same_through_either_dispatcher(name, compiled, states, monkeypatch):  # noqa: F811
    def run():  # a model of its own per run: a run in train mode moves its running statistics
        model, args, kwargs = zoo()[name]
        return tl.trace(model, args, kwargs)

    with on_path(compiled):
        _two_ways(states, monkeypatch, run)
    assert_clean_process()


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_transformers_record_the_same_through_either_dispatcher(name, compiled, states, monkeypatch):  # noqa: F811
    """Their F.embedding, F.layer_norm, F.dropout and Tensor.split calls (train mode: dropout draws)."""
    pytest.importorskip("transformers")
    import real_models

    def run():
        model, args, kwargs = getattr(real_models, name)()
        return tl.trace(model.train(), args, kwargs)

    with on_path(compiled):
        log = _two_ways(states, monkeypatch, run)
    assert {"layernorm", "dropout", "embedding"} <= {op.type for op in log.ops}


@pytest.mark.parametrize("compiled", PATHS)
def test_python_level_functions_skip_torchs_dispatcher_and_keep_their_user_line(  # noqa: F811
        compiled, states, monkeypatch):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.act = nn.LayerNorm(8), nn.ReLU()

        def forward(self, x):
            y = F.dropout(self.act(self.norm(x)), 0.0, training=False)
            return torch.functional.split(y, 4, dim=-1)[0] + y.split(2, dim=-1)[1].sum()

    model, x = Block().eval(), torch.randn(2, 8)
    with on_path(compiled):
        log = _two_ways(states, monkeypatch, lambda: tl.trace(model, x))
        assert _torch_dispatch_calls(lambda: tl.trace(model, x)) == 0
    assert {"layernorm", "relu", "dropout", "split"} <= {op.type for op in log.ops}
    assert all(op.source is not None and op.source.function.endswith("Block.forward")
               for op in log.ops if op.kind == "op")
    assert _torch_dispatch_calls(lambda: model(x)) == 0  # untraced: no mode, no dispatch at all


@pytest.mark.parametrize("compiled", PATHS)
def test_the_mode_gets_the_types_torch_would_pass(compiled):
    """``types`` as torch's ``_get_overloaded_args`` makes it, for every mix of plain arguments."""
    seen = []

    class Witness(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(types)
            return func(*args, **(kwargs or {}))

    t, p = torch.randn(3), nn.Parameter(torch.randn(3))
    cases = [(t,), (p,), (t, p), (p, t), (p, None, t), (None,), (p, p)]
    mode = Witness()
    with on_path(compiled):
        dispatch.install()
        try:
            ours = F.handle_torch_function  # what a trace on this path puts in place
        finally:
            dispatch.uninstall()
    assert ours in dispatch._OURS and not dispatch.installed()
    for relevant in cases:
        with mode:
            TORCH_OWN(torch.add, relevant, relevant[-1] if relevant[-1] is not None else t, 1)
        dispatch.capturing.mode = mode
        torch._C._push_on_torch_function_stack(mode)
        try:
            ours(torch.add, relevant, relevant[-1] if relevant[-1] is not None else t, 1)
        finally:
            torch._C._pop_torch_function_stack()
            dispatch.capturing.mode = None
        assert seen[-1] == seen[-2], (relevant, seen[-2:])
    assert torch._C._len_torch_function_stack() == 0


def test_another_mode_inside_the_forward_gets_torchs_own_dispatch():
    seen = []

    class Inner(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    class WithMode(nn.Module):
        def forward(self, x):
            with Inner():
                return F.relu(x) + 1

    x = torch.randn(4)
    log = tl.trace(WithMode(), x)
    assert "relu" in seen and torch.equal(log.output, F.relu(x) + 1)
    assert "relu" in [op.type for op in log.ops]
    assert _torch_dispatch_calls(lambda: tl.trace(WithMode(), x)) > 0  # two modes on the stack: torch's own
    assert_clean_process()


def test_a_tensor_subclass_argument_gets_torchs_own_dispatch(states, monkeypatch):  # noqa: F811
    class Tagged(torch.Tensor):
        pass

    class Model(nn.Module):
        def forward(self, x):
            return F.relu(x.as_subclass(Tagged)).as_subclass(torch.Tensor) * 2

    x = torch.randn(4)
    _two_ways(states, monkeypatch, lambda: tl.trace(Model(), x))
    assert _torch_dispatch_calls(lambda: tl.trace(Model(), x)) > 0


def test_another_thread_gets_torchs_own_dispatch_while_a_trace_runs():
    """A thread that is not tracing calls F.relu under a mode of its own while another thread traces."""
    started, release, seen, result = threading.Event(), threading.Event(), [], {}

    class Own(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append((getattr(func, "__name__", ""), types))
            return func(*args, **(kwargs or {}))

    class Waiting(nn.Module):
        def forward(self, x):
            started.set()
            release.wait(10)
            return F.relu(x)

    def side():
        try:
            started.wait(10)
            result["in place"] = F.handle_torch_function in dispatch._OURS  # a trace runs
            negative = torch.full((2,), -1.0)
            with Own():
                result["side"] = F.relu(negative)
        finally:
            release.set()

    thread = threading.Thread(target=side)
    thread.start()
    log = tl.trace(Waiting(), torch.randn(3))
    thread.join()
    assert result["in place"] and torch.equal(result["side"], torch.zeros(2))
    assert seen == [("relu", (torch.Tensor,))]
    assert [op.type for op in log.ops if op.kind == "op"] == ["relu"]
    assert_clean_process()


def test_torchs_own_is_back_after_a_trace_and_a_failed_one():
    class Failing(nn.Module):
        def forward(self, x):
            assert F.handle_torch_function in dispatch._OURS
            F.relu(x)
            raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        tl.trace(Failing(), torch.randn(2))
    assert not dispatch.installed() and F.handle_torch_function is TORCH_OWN
    assert_clean_process()
