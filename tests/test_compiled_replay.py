"""Replaying a ``compiled`` op (a torch.compile'd submodule run compiled): its code reads the submodule's
parameters and buffers where they are now, not from the call's recorded arguments, and may write them. Replay
must neither write them nor vouch for, or fault, a value computed from parameters changed since."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from untouched import assert_clean_process


@pytest.fixture(autouse=True, scope="module")
def _collect_compile_garbage():
    yield
    gc.collect()


class Counted(nn.Module):
    """Scales by a step count it keeps in a buffer: its output depends on state its own call writes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x):
        self.step.add_(1)
        return self.fc(x) * self.step


class Net(nn.Module):
    def __init__(self, block, in_place=False):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(4, 4)
        self.block = block
        if in_place:
            block.compile(backend="eager")
        else:
            self.block = torch.compile(block, backend="eager")
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(self.pre(x)))


def _batch_norm_block():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU())


def _state(model):
    return {name: t.clone() for name, t in model.state_dict().items()}


def _changed(model, state):
    return [name for name, t in model.state_dict().items() if not torch.equal(t, state[name])]


@pytest.mark.parametrize("in_place", [False, True], ids=["wrapped", "in_place"])
def test_replaying_a_compiled_batch_norm_leaves_its_running_statistics_as_the_forward_left_them(in_place):
    model, x = Net(_batch_norm_block(), in_place), torch.randn(6, 4)
    log = tl.trace(model, x)
    after_forward = _state(model)
    result = log.validate()
    assert result.passed and result.replayed == 3, str(result)  # training-mode statistics do not feed the output
    assert _changed(model, after_forward) == []
    once = Net(_batch_norm_block(), in_place)
    once(x)
    checked = Net(_batch_norm_block(), in_place)
    assert tl.validate(checked, x).passed
    assert _changed(checked, _state(once)) == []  # as after one untraced forward
    assert_clean_process()


class ReadsRunningMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.compile(_batch_norm_block(), backend="eager")

    def forward(self, x):
        return self.block(x) + self.block._orig_mod[1].running_mean  # read as the compiled code left it


def test_a_buffer_the_trace_holds_by_reference_stays_readable_after_replaying_the_compiled_op_that_writes_it():
    model, x = ReadsRunningMean(), torch.randn(6, 4)
    log = tl.trace(model, x)
    held = log["buffer_1:1"].activation.clone()
    for _ in range(2):  # the second replay finds the buffer as the first left it
        result = log.validate()
        assert result.passed and result.replayed == 2 and not result.not_replayed, str(result)
    assert log["buffer_1:1"].dropped_reason is None and torch.equal(log["buffer_1:1"].activation, held)
    assert_clean_process()


@pytest.mark.parametrize("in_place", [False, True], ids=["wrapped", "in_place"])
def test_a_compiled_op_whose_parameters_changed_since_the_trace_is_not_replayed_rather_than_a_mismatch(in_place):
    model, x = Net(_batch_norm_block(), in_place), torch.randn(6, 4)
    log = tl.trace(model, x)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)  # an optimizer step
    result = log.validate()
    assert not result.mismatched, str(result)
    assert dict(result.not_replayed)["compiled_1_2:1"] == ("parameter block.0.weight changed since the trace (an "
                                                           "optimizer step?): validate right after tracing")
    assert_clean_process()


def test_a_compiled_op_reading_a_buffer_it_writes_is_not_replayed_and_the_buffer_is_left_as_it_was():
    model, x = Net(Counted()), torch.randn(3, 4)
    log = tl.trace(model, x)
    after_forward = _state(model)
    result = log.validate()
    assert not result.mismatched, str(result)
    assert "its compiled code wrote its module's buffers" in dict(result.not_replayed)["compiled_1_2:1"]
    assert _changed(model, after_forward) == [] and model.block._orig_mod.step.item() == 1
    assert_clean_process()


class Doubles(nn.Module):
    """Doubles its input in place; returns ``fc`` of it, or the input itself."""

    def __init__(self, returns_input):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.returns_input = returns_input

    def forward(self, x):
        x.mul_(2)
        return x if self.returns_input else self.fc(x)


class ReadsAfter(nn.Module):
    def __init__(self, returns_input):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(4, 4)
        self.block = torch.compile(Doubles(returns_input), backend="eager")

    def forward(self, x):
        h = self.pre(x)
        y = self.block(h)
        return y + h.sum()  # reads h as the compiled code left it


def test_a_read_of_what_a_compiled_op_wrote_and_did_not_return_is_not_replayed_against_its_output():
    model, x = ReadsAfter(returns_input=False), torch.randn(3, 4)
    log = tl.trace(model, x)
    assert torch.equal(log.output, ReadsAfter(returns_input=False)(x))
    assert log["sum_1_3"].parents == ["compiled_1_2:1"]  # the call that wrote h
    result = log.validate()
    assert result.passed and not result.mismatched, str(result)  # its output (fc of h) is not the value read
    assert "a value that no op output holds" in dict(result.not_replayed)["sum_1_3:1"]
    assert tl.validate(ReadsAfter(returns_input=False), x).passed


def test_a_read_of_what_a_compiled_op_wrote_and_returned_is_replayed_from_that_output():
    model, x = ReadsAfter(returns_input=True), torch.randn(3, 4)
    log = tl.trace(model, x)
    assert log["sum_1_3"].parents == ["compiled_1_2:1"]
    result = log.validate()
    assert result.passed and "sum_1_3:1" not in dict(result.not_replayed), str(result)
