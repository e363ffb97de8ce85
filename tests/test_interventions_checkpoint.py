"""An edit inside a non-reentrant torch.utils.checkpoint region is refused also when the model pushes a
saved-tensors hook of its own inside the region, which hides the region's hook from torch's one query."""

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
