"""``layer.grads`` of a layer some of whose passes can have no gradient: a recurrent cell warmed up under
``torch.no_grad()`` before the steps it is trained on (burn-in, the solver iterations of a fixed-point model).
Those passes are None beside the others' gradients, as in a module call's tuple, and a layer none of whose passes
can have one raises saying why."""

import pytest
import torch
import torch.nn as nn

import torchlens as tl


class WarmedUpGRU(nn.Module):
    """``warmup`` steps of a GRU cell under no_grad, then ``steps`` with gradients."""

    def __init__(self, warmup=2, steps=2):
        super().__init__()
        self.cell = nn.GRUCell(4, 6)
        self.warmup, self.steps = warmup, steps
        self.states = []  # every step's state, for the untraced reference

    def forward(self, x):
        h = torch.zeros(x.shape[0], 6)
        self.states.clear()
        for step in range(self.warmup + self.steps):
            with torch.set_grad_enabled(step >= self.warmup):
                h = self.cell(x, h)
            self.states.append(h)
        return h


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return WarmedUpGRU()


def test_passes_run_without_grad_are_none_beside_the_others_gradients(model):
    x = torch.randn(3, 4)
    model(x)
    for h in model.states[model.warmup:]:
        h.retain_grad()
    model.states[-1].pow(2).sum().backward()
    expected = [None] * model.warmup + [h.grad for h in model.states[model.warmup:]]

    log = tl.trace(model, x, grads=True)
    log.backward(log.output.pow(2).sum())
    (layer,) = [layer for layer in log.layers if layer.first.func_name == "gru_cell"]
    assert layer.num_passes == model.warmup + model.steps
    grads = layer.grads
    assert [g is None for g in grads] == [e is None for e in expected]
    assert all(torch.equal(g, e) for g, e in zip(grads, expected) if e is not None)
    with pytest.raises(tl.GradientUnavailable, match="does not require grad"):
        layer.ops[0].grad  # the pass itself still says why it has none


def test_a_layer_no_pass_of_which_can_have_a_gradient_raises_saying_why():
    frozen = WarmedUpGRU(warmup=3, steps=0)
    log = tl.trace(frozen, torch.randn(3, 4), grads=["cell"])
    (layer,) = [layer for layer in log.layers if layer.first.func_name == "gru_cell"]
    with pytest.raises(tl.GradientUnavailable, match="does not require grad"):
        layer.grads
