"""Validation of models whose weights are parameter classes of their own: a class computing the ops that read it
(as bitsandbytes' weights do) is replayed through that class, and a class whose deep copy computes otherwise is
validated against the model itself."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl
from trusted import assert_trusted
from accel_paths import PATHS, on_path


class _ScaledWeight(nn.Parameter):
    """A weight (stored as int8) that dequantizes itself in every linear reading it, through a ``__torch_function__``
    of its own, as bitsandbytes' weight classes do; its scale is an attribute of the parameter."""

    def __new__(cls, data, scale):
        weight = torch.Tensor._make_subclass(cls, data, False)
        weight.scale = scale
        return weight

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.linear:
            x, weight, *bias = args
            with torch._C.DisableTorchFunctionSubclass():
                return F.linear(x, weight.as_subclass(torch.Tensor).float() * weight.scale, *bias)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32])
@pytest.mark.parametrize("compiled", PATHS)
def test_ops_reading_a_parameter_class_that_computes_for_them_replay_through_it(compiled, dtype):
    # Replay copied the parameter as a plain tensor, so the linear ran without the weight's own __torch_function__:
    # an int8 weight's was not replayed ("replay raised RuntimeError: self and mat2 must have the same dtype"), and a
    # float weight's was reported as a MISMATCH, the validation of a faithful trace FAILED.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU())
    model[0].weight = _ScaledWeight((torch.randn(4, 6) * 10).to(dtype), 0.1)
    x = torch.randn(3, 6)
    with on_path(compiled):
        log = tl.trace(model, x)
    assert torch.equal(log.output, model(x))
    result = log.validate()
    assert_trusted(result)
    assert result.replayed == 2 and not result.not_replayed


class _KeepsAScale(nn.Parameter):
    """A parameter class keeping a scale beside its data, as quantized weight classes keep their state:
    ``Parameter.__deepcopy__`` rebuilds it from its data alone, so a copy's scale is another."""

    def __new__(cls, data, scale=2.0):
        weight = super().__new__(cls, data)
        weight.scale = scale
        return weight


class _ReadsItsScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = _KeepsAScale(torch.randn(4, 4), 3.0)

    def forward(self, x):
        return x @ (self.w * self.w.scale)


def test_a_model_its_deep_copy_computes_otherwise_is_validated_against_itself():
    """tl.validate runs its untraced reference on a deep copy of the model; a copy that lost a weight's scale computed
    otherwise, and the faithful trace was reported as FAILED, its outputs unlike an untraced run's.  Such a copy is
    now told apart before it runs, and the reference is the model itself, put back after."""
    torch.manual_seed(0)
    model, x = _ReadsItsScale(), torch.randn(2, 4)
    assert not torch.equal(copy.deepcopy(model)(x), model(x))  # the copy is not the model
    result = tl.validate(model, x)
    assert result.passed and result.outputs_match is True
    assert model.w.scale == 3.0 and type(model.w) is _KeepsAScale
