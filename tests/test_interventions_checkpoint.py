"""An edit inside a non-reentrant torch.utils.checkpoint region is refused also when the model pushes a
saved-tensors hook of its own inside the region, which hides the region's hook from torch's one query; an alias
reading the same elements changes nothing the recomputation misses, and is allowed there."""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import torchlens as tl


class _HookedInsideCheckpoint(nn.Module):
    """A checkpointed block that runs under a saved-tensors hook of its own (as offloading code does)."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)

    def hooked(self, x):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return self.block(x)

    def forward(self, x):
        return self.head(checkpoint(self.hooked, x, use_reentrant=False))


@pytest.fixture(scope="module")
def hooked():
    torch.manual_seed(0)
    return _HookedInsideCheckpoint(), torch.randn(3, 4, requires_grad=True)


@pytest.mark.parametrize("site", ["block.0", "tanh_1_2:1"])
def test_an_edit_under_a_models_own_saved_tensors_hook_inside_the_region_is_refused(hooked, site):
    model, x = hooked
    with pytest.raises(tl.InterventionError, match="inside a non-reentrant torch.utils.checkpoint region"):
        tl.trace(model, x, intervene={site: tl.scale(3.0)})
    with torch.no_grad():  # the region pushes no hook and nothing is recomputed: allowed
        assert tl.trace(model, x, intervene={site: tl.scale(3.0)}).interventions


def test_an_edit_after_the_region_closed_is_allowed(hooked):
    model, x = hooked
    log = tl.trace(model, x, intervene={"head": tl.scale(3.0)})
    assert torch.equal(log.output, model(x) * 3.0)


class _CastInsideCheckpoint(nn.Module):
    """Llama's norms in a checkpointed block: ``h.to(torch.float32)`` of a float32 ``h`` hands back ``h`` itself."""

    def __init__(self, reentrant=None):
        super().__init__()
        self.reentrant = reentrant  # None: no checkpoint
        self.fc = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 2)

    def region(self, h):
        h = h.to(torch.float32)
        return self.block(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)) + h

    def forward(self, x):
        h = self.fc(x)
        h = self.region(h) if self.reentrant is None else checkpoint(self.region, h, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.fixture(scope="module")
def cast_models():
    torch.manual_seed(0)
    plain = _CastInsideCheckpoint()
    checkpointed = _CastInsideCheckpoint(reentrant=False)
    checkpointed.load_state_dict(plain.state_dict())
    return plain, checkpointed


def test_attribution_patching_of_a_checkpointed_model_is_that_of_the_same_model_unchecked(cast_models):
    # Its probe at an op handing back its input is a view of that input, which changes no value: it used to be
    # refused as an edit inside the region, failing the whole table.
    clean, corrupt = torch.randn(3, 4), torch.randn(3, 4)
    metric = lambda out: out[0, 0] - out[1, 1]
    plain, checkpointed = (tl.report.attribution_patching(m, clean, corrupt, metric) for m in cast_models)
    assert plain.site.tolist() == checkpointed.site.tolist()
    assert plain.estimate.equals(checkpointed.estimate)
    assert not plain.estimate[plain.site == "to_1_2:1"].isna().any()


def test_an_alias_of_the_value_inside_the_region_is_allowed_and_changes_no_gradient(cast_models):
    x = torch.randn(3, 4)
    grads = []
    for model in cast_models:
        model.zero_grad(set_to_none=True)
        log = tl.trace(model, x, grads=True, intervene={"block.0": lambda t, op: t.view_as(t)})
        log.backward(log.output.pow(2).sum())
        grads.append([log["block.0"].grad, log["linear_1_1:1"].grad] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with pytest.raises(tl.InterventionError, match="inside a non-reentrant torch.utils.checkpoint region"):
        tl.trace(cast_models[1], x, grads=True, intervene={"block.0": lambda t, op: t * 1.0})


def test_attribution_patching_through_a_reentrant_region_says_what_refuses_it_and_what_to_do():
    # torch's own refusal names .grad(), which the caller of the table never wrote.
    torch.manual_seed(0)
    model = _CastInsideCheckpoint(reentrant=True)
    refused = r"attribution_patching takes the metric's gradient .*use_reentrant=False"
    with pytest.raises(tl.InterventionError, match=refused):
        tl.report.attribution_patching(model, torch.randn(3, 4), torch.randn(3, 4), lambda out: out[0, 0])
    assert all(p.grad is None for p in model.parameters())
