"""The traced module's own address: its call is the whole trace, not a module call, so ``log["self"]`` (or ``""``)
names nothing in a trace of a module, and the refusal says where its output and inputs are instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.ReLU())


@pytest.mark.parametrize("key", ["", "self", "self:1"])
def test_the_root_of_a_module_trace_is_named_as_the_whole_trace(model, key):
    log = tl.trace(model, torch.randn(1, 2))
    with pytest.raises(KeyError) as refused:
        log[key]
    assert "the traced module's own call is the whole trace" in str(refused.value)
    assert "'output_1:1'" in str(refused.value) and "log.inputs" in str(refused.value)


def test_a_callables_calls_of_its_root_are_module_calls_named_self(model):
    # With root=, the callable's calls of the root are module calls: self:1 is one, and no note stands in for it.
    log = tl.trace(lambda x: model(x), torch.randn(1, 2), root=model)
    assert log["self:1"].label == "relu_1_2:1"
    with pytest.raises(KeyError) as refused:
        log["self:2"]
    assert "whole trace" not in str(refused.value) and "self made 1 call" in str(refused.value)


def test_a_callable_without_root_gets_no_note_about_a_traced_module(model):
    log = tl.trace(lambda x: model(x), torch.randn(1, 2))
    with pytest.raises(KeyError) as refused:
        log["self"]
    assert "whole trace" not in str(refused.value)
