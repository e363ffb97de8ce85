"""nonfinite_origin(grads=True) when a custom autograd.Function's backward makes the NaN.  The Function runs its
forward under ``no_grad``: its inner ops need no gradient, and only its output gets the Function's node, whose
backward sends the gradient straight to the Function's input.  That output is the input's reader in the backward,
so the report names it, and the Function, as anomaly mode does; never the loss, nor the input's other readers alone."""

import os
import sys
import warnings

import pytest
import torch

import torchlens as tl

sys.path.insert(0, os.path.dirname(__file__))
import real_models  # noqa: E402


class NaNBackward(torch.autograd.Function):
    """A finite forward of two ops whose backward returns NaN (a faulty hand-written gradient)."""

    @staticmethod
    def forward(ctx, h):
        scaled = h * 2.0
        return scaled / 2.0

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def through_function(module, args, output):
    return NaNBackward.apply(output)


def through_function_beside_a_reader(module, args, output):
    """The Function reads the activation, and so does a finite op beside it."""
    return NaNBackward.apply(output) + output.tanh()


@pytest.fixture(scope="module")
def gpt2():
    return real_models.small_gpt2_lm(), torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))


def _report(model, ids, hook):
    handle = model.transformer.h[0].mlp.act.register_forward_hook(hook)
    try:
        log = tl.trace(model, ids, grads=True, save="none")
        log.backward(log.output.logits.sum())
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    return log, tl.debug.nonfinite_origin(log, grads=True)


def _anomaly_names(model, ids, hook):
    handle = model.transformer.h[0].mlp.act.register_forward_hook(hook)
    try:
        with warnings.catch_warnings(), torch.autograd.set_detect_anomaly(True):
            warnings.simplefilter("ignore")
            with pytest.raises(RuntimeError) as raised:
                model(ids).logits.sum().backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    return str(raised.value)


def test_a_nan_a_function_backward_sends_is_placed_in_that_function(gpt2):
    assert "NaNBackwardBackward" in _anomaly_names(*gpt2, through_function)
    log, report = _report(*gpt2, through_function)
    assert report.origin.module == "transformer.h.0.mlp.act:1" and not report.loss_nonfinite
    assert report.born_in_certain and [log[label].func_name for label in report.born_in] == ["div"]
    assert report.functions == {report.born_in[0]: "NaNBackward"}
    assert "custom autograd.Function NaNBackward" in str(report)


def test_a_function_beside_another_reader_is_a_candidate_not_left_out(gpt2):
    log, report = _report(*gpt2, through_function_beside_a_reader)
    assert sorted(log[label].func_name for label in report.born_in) == ["div", "tanh"]
    assert not report.born_in_certain and list(report.functions.values()) == ["NaNBackward"]


class LinearWithFaultyWeightGrad(torch.autograd.Function):
    """A hand-written linear (as quantized and low-rank adapters write theirs) whose weight gradient is NaN."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, (grad.transpose(-1, -2) @ x) * float("nan")


class CustomLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(LinearWithFaultyWeightGrad.apply(x, self.weight))


def test_a_nan_only_in_a_weight_grad_is_placed_in_the_function_that_read_the_weight():
    model = CustomLinear()
    log = tl.trace(model, torch.randn(3, 4), grads=True)
    log.backward(log.output.sum())
    report = tl.debug.nonfinite_origin(log, grads=True)
    # The Function read the weight through a transpose taken under no_grad, which has no backward of its own.
    assert report.origin is None and report.parameters == ("weight",)
    assert [log[label].func_name for label in report.born_in] == ["matmul"] and report.born_in_certain
    assert list(report.functions.values()) == ["LinearWithFaultyWeightGrad"]


def test_a_loaded_trace_places_a_function_backward_nan_as_the_live_one_does(gpt2, tmp_path):
    log, report = _report(*gpt2, through_function)
    log.save(tmp_path / "trace.tl")
    loaded = tl.debug.nonfinite_origin(tl.load(tmp_path / "trace.tl"), grads=True)
    assert not loaded.loss_nonfinite
    assert (loaded.origin_label, loaded.born_in, loaded.functions) == (report.origin_label, report.born_in,
                                                                       report.functions)
