"""Replaying a ``compiled`` op whose module did not hold, when it ran, the tensors it holds at replay: a forward
through ``torch.func.functional_call`` swaps other parameters in for the call alone, and a parameter replaced
after the trace is another object.  Replay reads the module's tensors where they are then, so it cannot read what
the compiled code read: validation lists the op as not replayed, never as a mismatch."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

import torchlens as tl
from untouched import assert_clean_process

SWAPPED = "its module's parameters or buffers are not the tensors its compiled code read when it ran"


@pytest.fixture(autouse=True, scope="module")
def _collect_compile_garbage():
    yield
    gc.collect()


class Net(nn.Module):
    def __init__(self, in_place):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(4, 4)
        self.block = nn.Linear(4, 4)
        if in_place:
            self.block.compile(backend="eager")
        else:
            self.block = torch.compile(self.block, backend="eager")

    def forward(self, x):
        return self.block(torch.relu(self.pre(x)))


class Functional(nn.Module):
    """Runs ``net`` with ``params`` swapped in for its own, as a meta-learning or ensembling step does."""

    def __init__(self, net, params):
        super().__init__()
        self.net = net
        self.params = params

    def forward(self, x):
        return functional_call(self.net, self.params, (x,))


def _compiled_op(log) -> str:
    return next(op.label for op in log.ops if op.type == "compiled")


def _reason(result, label: str) -> str:
    return dict(result.not_replayed).get(label, "")


@pytest.mark.parametrize("in_place", [False, True], ids=["wrapped", "in_place"])
def test_a_compiled_op_run_with_parameters_functional_call_swapped_in_is_not_replayed_rather_than_a_mismatch(in_place):
    net = Net(in_place)
    doubled = {name: p.detach() * 2 for name, p in net.named_parameters()}
    model, x = Functional(net, doubled), torch.randn(2, 4)
    log = tl.trace(model, x)
    result = log.validate()
    assert not result.mismatched, str(result)
    assert _reason(result, _compiled_op(log)).startswith(SWAPPED), str(result)
    assert "functional_call" in _reason(result, _compiled_op(log))
    assert not tl.validate(model, x).mismatched
    assert_clean_process()


@pytest.mark.parametrize("in_place", [False, True], ids=["wrapped", "in_place"])
def test_a_compiled_op_run_with_its_modules_own_parameters_through_functional_call_is_replayed(in_place):
    net = Net(in_place)
    model, x = Functional(net, dict(net.named_parameters())), torch.randn(2, 4)
    log = tl.trace(model, x)
    result = log.validate()
    assert result.passed and _compiled_op(log) not in dict(result.not_replayed), str(result)
    assert_clean_process()


@pytest.mark.parametrize("in_place", [False, True], ids=["wrapped", "in_place"])
def test_a_compiled_op_whose_parameter_was_replaced_since_the_trace_is_not_replayed_rather_than_a_mismatch(in_place):
    model, x = Net(in_place), torch.randn(2, 4)
    log = tl.trace(model, x)
    assert log.validate().passed
    linear = model.block if in_place else model.block._orig_mod
    linear.weight = nn.Parameter(linear.weight.detach() * 2)
    result = log.validate()
    assert not result.mismatched, str(result)
    assert _reason(result, _compiled_op(log)).startswith(SWAPPED), str(result)
    assert_clean_process()
