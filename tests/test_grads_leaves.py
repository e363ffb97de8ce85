"""Leaves that start (or stop) requiring grad inside the forward: ``torch.zeros(n).requires_grad_()``, an
input made differentiable by the model itself, ``t.requires_grad = False``.  The trace's record of such a tensor
says what it is once set, and with ``grads=True`` its gradient is what autograd accumulates into its ``.grad``.
A leaf the trace hooked (an input that requires grad, a parameter an op returns as it is) is left as it was found.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.parametrizations import spectral_norm

import torchlens as tl
from torchlens.record.errors import GradientUnavailable

from accel_paths import on_path
from untouched import assert_untouched, snapshot


class LearnedOffset(nn.Module):
    """A forward that makes a leaf of its own and sets it to require grad, by the method or the setter."""

    def __init__(self, setter: bool):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.setter = setter

    def forward(self, x):
        offset = torch.zeros(3)
        if self.setter:
            offset.requires_grad = True
        else:
            offset.requires_grad_()
        return (self.linear(x) * offset).sum(), offset


class DifferentiableInput(nn.Module):
    """Makes its input differentiable, so that a backward from its output reaches the input's ``.grad``
    (a saliency map, or a physics-informed model's derivative by its coordinates)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        x.requires_grad_(True)
        return self.net(x).sum()


@pytest.mark.parametrize("setter", [False, True], ids=["requires_grad_", "setter"])
def test_a_leaf_set_to_require_grad_in_the_forward_has_its_gradient(setter):
    torch.manual_seed(0)
    model, x = LearnedOffset(setter), torch.randn(2, 3)
    log = tl.trace(model, x, grads=True)
    loss, offset = log.output
    loss.backward()
    assert offset.grad is not None
    assert log["zeros_1_1"].requires_grad
    assert torch.equal(log["zeros_1_1"].grad, offset.grad)  # what autograd gave the leaf itself
    assert torch.equal(log["output_2"].grad, offset.grad)
    # The same record without gradient capture.
    assert tl.trace(model, x)["zeros_1_1"].requires_grad


def test_an_input_made_differentiable_by_the_forward_has_the_gradient_autograd_gives_it():
    torch.manual_seed(0)
    model, x = DifferentiableInput(), torch.randn(5, 2)
    untraced = x.clone()
    model(untraced).backward()
    traced = x.clone()
    log = tl.trace(model, traced, grads=True)
    log.output.backward()
    assert log["input_1"].requires_grad
    assert torch.allclose(log["input_1"].grad, untraced.grad)
    assert torch.equal(log["input_1"].grad, traced.grad)
    assert tl.validate(model, x.clone()).passed


def test_a_leaf_set_to_no_longer_require_grad_has_no_gradient():
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x):
            x.requires_grad = False  # the caller's input, detached from autograd by the model
            return self.linear(x).sum()

    x = torch.randn(2, 3, requires_grad=True)
    log = tl.trace(Frozen(), x, grads=True)
    log.output.backward()
    assert x.grad is None
    assert not log["input_1"].requires_grad
    with pytest.raises(GradientUnavailable, match="does not require grad"):
        log["input_1"].grad


def test_a_selection_of_grads_decides_for_a_leaf_set_in_the_forward():
    model, x = LearnedOffset(setter=False), torch.randn(2, 3)
    log = tl.trace(model, x, grads=["linear"])
    log.output[0].backward()
    assert log["linear_1_2"].grad is not None
    assert not log["zeros_1_1"].has_grad  # not selected, though it now requires grad


# (accel.use, compiled modules left out): torchlens-accel's C++ hooks, its C hooks, pure Python.
HOOK_PATHS = [pytest.param((True, ()), id="cpp"), pytest.param((True, ("_autograd",)), id="c"),
              pytest.param((False, ()), id="python")]


@pytest.mark.picks_its_path
@pytest.mark.parametrize("path", HOOK_PATHS)
def test_a_leaf_the_trace_hooked_is_left_without_a_hook_dict_once_the_trace_is_dropped(path):
    # A leaf keeps a Python hook (torch's own, calling each hook of its dict) for as long as it holds a hook dict,
    # however empty: the dict the trace put on an input that requires grad, or on a parameter an op returns as it
    # is (spectral_norm's flatten(1) of its 2-D weight), stayed on it, so every later backward called Python there.
    torch.manual_seed(0)
    model = nn.Sequential(spectral_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 2))
    weight, x = model[0].parametrizations.weight.original, torch.randn(3, 4, requires_grad=True)
    before = snapshot(model, [x])
    with on_path(*path):
        log = tl.trace(model, x, grads=True)
    assert weight._backward_hooks  # the trace's hook, while the trace lives
    log.backward(log.output.square().sum())
    assert torch.equal(log["input_1"].grad, x.grad)
    del log
    assert weight._backward_hooks is None and x._backward_hooks is None
    assert_untouched(before, snapshot(model, [x]))
