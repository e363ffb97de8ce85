"""Gradient capture, continued: what ``log.backward`` passes on to autograd, a module call returning several
tensors, and regions of the forward that autograd does not record.

The reference is an untraced run of the same model: ``retain_grad()`` on its tensors, or ``Oracle``
(tests/grad_oracle.py), which calls it on every tensor each torch call returns.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.record.errors import GradientUnavailable
from accel_paths import PATHS, on_path
from grad_oracle import Oracle, _assert_bit_identical, _op_grads
from zoo import LoopRNN, zoo


def test_a_module_call_returning_several_tensors_has_a_gradient_per_tensor():
    lstm = nn.LSTM(4, 6, batch_first=True)
    model = nn.ModuleDict({"lstm": lstm})  # the call to read is a submodule's (the root's is the trace's output)
    x = torch.randn(2, 3, 4)
    out, (h, c) = lstm(x)
    for t in (out, h, c):
        t.retain_grad()
    (out.pow(2).sum() + 2 * h.sum() + 3 * c.sum()).backward()
    lstm.zero_grad()
    log = tl.trace(lambda v: model["lstm"](v), x, root=model, grads=True)
    traced_out, (traced_h, traced_c) = log.output
    log.backward(traced_out.pow(2).sum() + 2 * traced_h.sum() + 3 * traced_c.sum())
    (call,) = [c for c in log.module_calls if c.label == "lstm:1"]  # (log["lstm:1"] names its first output op)
    assert isinstance(call.grad, tuple) and len(call.grad) == 3
    assert all(torch.equal(g, t.grad) for g, t in zip(call.grad, (out, h, c)))


class _TopTwo(nn.Module):
    def forward(self, x):
        return x.topk(2, dim=-1)


class _FrozenThenTop(nn.Module):
    """A call under torch.no_grad(), a call returning values and integer indices, and one ablated below."""

    def __init__(self):
        super().__init__()
        self.frozen, self.fc, self.top = nn.Linear(4, 4), nn.Linear(4, 4), _TopTwo()

    def forward(self, x):
        with torch.no_grad():
            frozen = self.frozen(x)
        values, _ = self.top(self.fc(x))
        return values.sum() + frozen.sum() + self.fc.bias.sum()  # a gradient for the backward even when ablated


def test_a_module_call_whose_outputs_can_have_no_gradient_says_why_as_its_output_op_does():
    # frozen:1.grad was None, as if no backward had reached it, where its output op raises saying why.
    model, x = _FrozenThenTop(), torch.randn(2, 4)
    log = tl.trace(model, x, grads=True, intervene={"fc": tl.zero_ablate()})
    log.backward(log.output)
    calls = {c.label: c for c in log.module_calls}
    with pytest.raises(GradientUnavailable, match=r"^linear_1_1:1: its output does not require grad \(made under "
                                                  r"torch.no_grad\(\)"):
        calls["frozen:1"].grad
    with pytest.raises(GradientUnavailable, match=r"an intervention \(zero_ablate\(\)\) replaced its output"):
        calls["fc:1"].grad
    with pytest.raises(GradientUnavailable, match=r"^topk_1_3:1: its output does not require grad"):
        calls["top:1"].grad  # the values are computed from the ablated zeros: no output can have a gradient
    log = tl.trace(model, x, grads=True)
    log.backward(log.output)
    values_grad, indices_grad = {c.label: c for c in log.module_calls}["top:1"].grad  # in a tuple: None beside
    assert torch.equal(values_grad, torch.ones(2, 2)) and indices_grad is None


def test_backward_with_inputs_accumulates_only_into_those_inputs_as_autograd_does():
    model, x = LoopRNN(steps=4), torch.randn(2, 8)
    oracle = Oracle()
    with oracle:
        out = model(x)
    torch.autograd.backward(out.pow(2).sum(), inputs=[model.cell.weight])
    expected, weight_grad = oracle.grads(), model.cell.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.pow(2).sum(), inputs=[model.cell.weight])
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, expected)
    assert torch.equal(model.cell.weight.grad, weight_grad) and model.cell.bias.grad is None
    assert log.num_backwards == 1


class InferenceModeRegion(nn.Module):
    """A frozen feature extractor run under ``torch.inference_mode()`` inside the forward, then a trained head."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        with torch.inference_mode():
            z = self.frozen(x).relu()
        return self.head(z.clone())


def test_an_inference_mode_region_has_no_gradient_and_the_refusal_names_it():
    model = InferenceModeRegion()
    log = tl.trace(model, torch.randn(3, 4), grads=True)
    log.backward(log.output.sum())
    assert log["head"].grad is not None and model.head.weight.grad is not None
    for label in ("frozen", "relu_1_2:1"):
        with pytest.raises(GradientUnavailable, match=r"torch\.inference_mode\(\)"):
            log[label].grad


def test_a_backward_cut_off_by_an_ablation_names_the_site_that_cut_it():
    # autograd's "element 0 of tensors does not require grad" named neither the ablation nor the way out.
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(2, 4)
    log = tl.trace(model, x, grads=True, intervene={"2": tl.zero_ablate()})
    with pytest.raises(RuntimeError, match="does not require grad") as caught:
        log.backward(log.output.sum())
    (note,) = caught.value.__notes__
    assert note.startswith("torchlens: the intervention at linear_2_3:1 replaced a value that needs a gradient")
    assert "tl.scale(0.0) zeroes it and keeps the graph" in note
    frozen = nn.Sequential(nn.Linear(4, 2)).requires_grad_(False)  # no site to blame: autograd's message alone
    log = tl.trace(frozen, x, grads=True, intervene={"0": tl.zero_ablate()})
    with pytest.raises(RuntimeError, match="does not require grad") as caught:
        log.backward(log.output.sum())
    assert not getattr(caught.value, "__notes__", None)


def test_a_loss_that_is_no_tensor_is_refused_naming_what_to_give():
    # log.backward(output.sum().item()) failed in torch with a bare AssertionError ("Expected output to be a
    # torch.Tensor").
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, grads=True)
    with pytest.raises(TypeError,
                       match=r"log\.backward\(loss\): loss is the tensor to backpropagate from .* got float"):
        log.backward(log.output.sum().item())
    log.backward([log.output.sum()])  # a list of tensors, as torch.autograd.backward takes
    assert torch.equal(log[-1].grad, torch.ones_like(log.output))


def test_a_backward_flag_that_is_no_bool_is_refused_before_the_backward():
    # retain_graph="yes" and create_graph="no" failed in torch's engine with "'str' object cannot be interpreted as
    # an integer", naming neither option.
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, grads=True)
    loss = log.output.sum()
    for option in ("retain_graph", "create_graph"):
        with pytest.raises(TypeError, match=rf"^log\.backward: {option}='no' is a str, not True or False; give True"):
            log.backward(loss, **{option: "no"})
    assert log.num_backwards == 0
    log.backward(loss, retain_graph=True)
    log.backward(loss, retain_graph=False, create_graph=False)
    assert log.num_backwards == 2 and torch.equal(log[-1].grad, 2 * torch.ones_like(log.output))


class OverwritesSaved(nn.Module):
    """Scales a sigmoid's output in place after another op read it: sigmoid's backward needs that output as made."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.sigmoid(self.fc(x))
        doubled = h * 2
        h.mul_(3)
        return doubled + h


WRITE_NOTE = "torchlens: the forward wrote in place at mul_2_4:1 (writing sigmoid_1_2:1)"


@pytest.mark.parametrize("compiled", PATHS)
def test_a_backward_refused_for_a_value_the_forward_overwrote_names_the_write(compiled):
    # Autograd names only "[torch.FloatTensor [3, 4]] ... is at version 1": the note names the forward's write.
    torch.manual_seed(0)
    model, x = OverwritesSaved(), torch.randn(3, 4)
    with on_path(compiled):
        log = tl.trace(model, x, grads=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as caught:
        log.backward(log.output.sum())
    assert any(note.startswith(WRITE_NOTE) for note in caught.value.__notes__)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as caught:
        tl.report.attribution_patching(model, torch.randn(3, 4), torch.randn(3, 4), lambda out: out.sum())
    assert any(note.startswith(WRITE_NOTE) for note in caught.value.__notes__)


@pytest.mark.parametrize("compiled", PATHS)
def test_a_profiled_backward_refused_for_a_value_the_forward_overwrote_names_the_write(compiled):
    # kernel_profile's backward, of the model or of a trace, raised autograd's bare refusal without the note.
    torch.manual_seed(0)
    model, x = OverwritesSaved(), torch.randn(3, 4)
    with on_path(compiled):
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as caught:
            tl.report.kernel_profile(model, x, backward=True)
        assert any(note.startswith(WRITE_NOTE) for note in caught.value.__notes__)
        log = tl.trace(model, x, grads=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as caught:
        tl.report.kernel_profile(log, backward=lambda out: out.sum().backward())
    assert any(note.startswith(WRITE_NOTE) for note in caught.value.__notes__)
    assert not torch._C._autograd._profiler_enabled()
