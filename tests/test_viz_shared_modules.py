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


class CallsItself(nn.Module):
    """A block that applies itself again on its own output (recursion): in the rolled view its later calls are
    drawn in the box of its first, from whose position they were made."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, repeats=2):
        x = torch.relu(self.fc(x))
        return self(x, repeats - 1) if repeats > 0 else x


class Recursive(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = CallsItself()

    def forward(self, x):
        return self.block(x)


def test_the_viewer_s_search_lists_only_module_boxes_it_can_go_to():
    # The search listed every rolled module position, drawn or not: "block" came up three times, and choosing the
    # second or third (the recursive calls, drawn inside the first box) did nothing.
    import json

    for model in (Recursive(), SharedOutsideItsFirstBox()):
        page = tl.trace(model, torch.randn(2, 4)).render(format="html", view="rolled")
        data = json.loads(re.search(r'id="tl-data">(.*?)</script>', page, re.S).group(1).replace("<\\/", "</"))
        # "where" holds each drawn item and module box: some module position here is drawn in another one's box
        assert len(data["groups"]) > len(data["where"]) - len(data["items"])
        assert [key for _, key in data["search"] if key not in data["where"]] == []
        drawn = {key for key in data["groups"] if key in data["where"]}
        assert {key for _, key in data["search"] if key in data["groups"]} == drawn
