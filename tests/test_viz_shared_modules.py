"""Rolled pictures of a module shared by two positions: drawn once, in its first position, so its calls from
the other position sit inside module boxes they never ran in, and collapsing those boxes must not hide them."""

from __future__ import annotations

import re

import torch
import torch.nn as nn

import torchlens as tl

EDGE = re.compile(r"^\s*(\w+)(?::p\d+)? -> (\w+)(?: \[label=\"([^\"]*)\"\])?;", re.M)
MODULE_NODE = r'^\s*(m\d+) \[[^\n]*<b>{} \((\w+)\)'


class Encoder(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.inner = nn.Sequential(shared, nn.ReLU())

    def forward(self, x):
        return self.inner(x)


class SharedOutsideItsFirstBox(nn.Module):
    """``shared`` runs first as ``encoder.inner.0``, then again from the root, on the encoder's output."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(4, 4)
        self.encoder = Encoder(shared)  # registered first: its address is encoder.inner.0
        self.shared = shared
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.encoder(x)
        return self.head(torch.sigmoid(self.shared(x)))


def loops(dot) -> list:
    return [(a, label) for a, b, label in EDGE.findall(dot) if a == b]


def test_a_shared_call_outside_its_first_box_keeps_its_edge_into_the_collapsed_box():
    """The second call reads the encoder's output; rolled, it is drawn inside the encoder, so collapsing the
    encoder showed encoder -> sigmoid alone, as if the encoder's output went straight on: the loop back into
    the shared layer (pass 1 of the encoder's ReLU feeding pass 2 of the layer) was swallowed."""
    log = tl.trace(SharedOutsideItsFirstBox(), torch.randn(2, 4))
    assert [c.label for c in log.module_calls if c.address == "encoder.inner.0"] == [
        "encoder.inner.0:1", "encoder.inner.0:2"]
    assert log["linear_1_1:2"].parents == ["relu_1_2:1"]
    for depth, address in ((0, "encoder"), (1, "encoder.inner")):
        rolled = log.render(view="rolled", depth=depth)
        (node, _), = re.findall(MODULE_NODE.format(re.escape(address)), rolled, re.M)
        assert loops(rolled) == [(node, "1\u21922")]
    # Unrolled, the second call is a node of its own, outside the encoder's one call: nothing is folded.
    unrolled = log.render(depth=0)
    assert loops(unrolled) == [] and "encoder.inner.0:2 (Linear)" in unrolled


def test_a_module_called_once_still_swallows_the_edges_inside_its_call():
    """The same model with the second call made by a module of its own: no loop is drawn on the encoder."""
    model = SharedOutsideItsFirstBox()
    model.shared = nn.Linear(4, 4)  # no longer the encoder's layer
    log = tl.trace(model, torch.randn(2, 4))
    for depth in (0, 1):
        assert loops(log.render(view="rolled", depth=depth)) == []
