"""A ``save=`` selection of module addresses lets go of the ops inside each selected call that the call did not
return, as the call returns (``SelectedModuleOutputs`` in capture/saving.py): what is let go must really be
freed, and what the selection keeps must be what a ``save="all"`` trace holds for it."""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

import torchlens as tl


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.inner = []  # a weak reference to each call's first inner op, which the call does not return

    def forward(self, x):
        h = self.a(x)
        self.inner.append(weakref.ref(h))
        return self.b(torch.relu(h)) + x


class _Blocks(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block() for _ in range(n))
        self.alive_at_end = None

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        # The blocks' inner ops, as the forward ends: nothing but the trace could hold them now.
        self.alive_at_end = [r() is not None for block in self.blocks for r in block.inner]
        return x


def test_the_ops_a_selected_call_lets_go_are_freed_as_it_returns_without_a_budget():
    # Without max_saved_bytes (tl.extract's case) a saved op's binding held the tensor itself, so what a selected
    # call let go stayed in memory until the forward ended: the selection held every block's inner ops at once.
    model, x = _Blocks(), torch.randn(4, 16)
    with torch.no_grad():  # (autograd holds no inner op either)
        log = tl.trace(model, x, save=[f"blocks.{i}" for i in range(3)])
        assert model.alive_at_end == [False, False, False]
        everything = tl.trace(model, x)
    kept = sorted(log.saved_activations)
    assert [log.labels[i] for i in kept] == ["add_1_4:1", "add_2_8:1", "add_3_12:1", "output_1:1"]
    assert all(torch.equal(log.ops[i].activation, everything.ops[i].activation) for i in kept)
