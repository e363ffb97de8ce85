"""A picture larger than the viewer's budget is laid out with a bounded effort; smaller ones as ever."""

from __future__ import annotations

import torch
import torch.nn as nn

import torchlens as tl
from torchlens.viz import html


class StepLoop(nn.Module):
    """A recurrent cell applied in a Python loop, reading the input at every step: the loop's edges from the input
    span ever more layers of the picture, the shape on which Graphviz's unbounded placement ran for minutes."""

    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(16, 8)

    def forward(self, x):
        h = torch.zeros(x.shape[0], 8)
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(torch.cat([x[:, t], h], 1)))
        return h


def _pictures(steps, monkeypatch) -> list:
    """The DOT text of every picture of the HTML page of a ``steps``-step loop, as handed to the layout."""
    laid = []
    monkeypatch.setattr(html, "layout", lambda texts, fmt: laid.extend(texts) or [b"<svg></svg>"] * len(texts))
    tl.trace(StepLoop(), torch.randn(2, steps, 8)).render(format="html")
    return laid


def test_only_a_picture_over_the_budget_bounds_its_layout(monkeypatch):
    # 130 steps: the top picture has 130 collapsed cell calls and 393 ops (more than 250 nodes at any depth).
    top, *cells = _pictures(130, monkeypatch)
    assert "nslimit=1" in top.splitlines()[1]
    assert cells and not any("nslimit" in text for text in cells)
    small = _pictures(20, monkeypatch)
    assert len(small) == 1 and "nslimit" not in small[0]
    # A static picture draws everything: the same bound past the budget, none within it.
    assert "nslimit=1" in tl.trace(StepLoop(), torch.randn(2, 130, 8)).render()
    assert "nslimit" not in tl.trace(StepLoop(), torch.randn(2, 20, 8)).render()
