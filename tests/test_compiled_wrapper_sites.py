"""Sites at a ``torch.compile`` wrapper's address when the trace runs compiled submodules eagerly
(``compiled="eager"``): the call the trace names there is the wrapped module's."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl

from test_unusual_tensors import WithCompiled


@pytest.mark.parametrize("site", ["block", "block:1"])
def test_a_compiled_wrapper_run_eagerly_is_a_site_with_the_gradient_a_hook_gives(site):
    """Under ``compiled="eager"`` the call the trace names ``block:1`` is that of the module the wrapper holds (the
    wrapper's own call is not recorded): a site at the wrapper's address edits that call, as a forward hook on it
    does, gradients included, where it failed inside torch's hooks (IndexError) for a wrapper the root called."""
    model, x = WithCompiled(in_place=False), torch.randn(3, 4)
    kept = {}

    def hook(module, args, output):
        kept["edited"] = edited = output * 3
        edited.retain_grad()
        return edited

    handle = model.block._orig_mod.register_forward_hook(hook)
    expected = model(x)
    expected.sum().backward()
    handle.remove()
    log = tl.trace(model, x, grads=True, intervene={site: tl.scale(3.0)}, compiled="eager")
    log.backward(log.output.sum())
    assert torch.equal(log.output, expected)
    assert [applied.label for applied in log.interventions] == ["mul_1_4:1"]
    assert torch.equal(log["block:1"].grad, kept["edited"].grad)


class Stacked(nn.Module):
    def __init__(self):
        super().__init__()
        self.outer = nn.Sequential(WithCompiled(in_place=False).block, nn.Linear(4, 4))

    def forward(self, x):
        return self.outer(x)


@pytest.mark.parametrize("model", [WithCompiled(in_place=False), Stacked()], ids=["from root", "nested"])
def test_a_stop_at_a_compiled_wrapper_run_eagerly_leaves_the_calls_around_it_unreturned(model):
    """The stop is recorded in the wrapped module's call: a call around the wrapper never returned, so it lists
    no output op (it listed the wrapper's, as if it had returned it), and one from the root raised IndexError."""
    address = "block" if isinstance(model, WithCompiled) else "outer.0"
    log = tl.trace(model, torch.randn(3, 4), stop_after=address, compiled="eager")
    assert log.stopped_after == f"{address}:1"
    outputs = {call.label: call.output_ops for call in log.module_calls}
    assert outputs[f"{address}:1"] == [log[f"{address}:1"].label] and outputs.get("outer:1", []) == []
