"""Every picture is laid out with a bounded effort: one network-simplex iteration per node past the viewer's
budget, ten within it, which leaves the pictures of common models placed exactly as unbounded."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
from torchlens.viz import html
from torchlens.viz.layout import LayoutEngineMissing, find_engine, layout
from zoo import SmallCNN, StepLoop, transformer_encoder


def _pictures(steps, monkeypatch) -> list:
    """The DOT text of every picture of the HTML page of a ``steps``-step loop, as handed to the layout."""
    laid = []
    monkeypatch.setattr(html, "layout", lambda texts, fmt: laid.extend(texts) or [b"<svg></svg>"] * len(texts))
    tl.trace(StepLoop(), torch.randn(2, steps, 8)).render(format="html")
    return laid


def test_a_picture_over_the_budget_takes_the_tighter_bound(monkeypatch):
    # 130 steps: the top picture has 130 collapsed cell calls and 393 ops (more than 250 nodes at any depth).
    top, *cells = _pictures(130, monkeypatch)
    assert "nslimit=1," in top.splitlines()[1]
    assert cells and all("nslimit=10," in text.splitlines()[1] for text in cells)
    small = _pictures(20, monkeypatch)
    assert len(small) == 1 and "nslimit=10," in small[0].splitlines()[1]
    # A static picture draws everything: the tighter bound past the budget, the looser one within it.
    assert "nslimit=1," in tl.trace(StepLoop(), torch.randn(2, 130, 8)).render()
    assert "nslimit=10," in tl.trace(StepLoop(), torch.randn(2, 20, 8)).render()


def _has_engine() -> bool:
    try:
        find_engine()
    except LayoutEngineMissing:
        return False
    return True


@pytest.mark.skipif(not _has_engine(), reason="needs Graphviz's dot or the graphviz-pure wheel")
@pytest.mark.parametrize("build, args", [(SmallCNN, (2, 3, 8, 8)), (transformer_encoder, (2, 5, 32))])
def test_the_bound_within_the_budget_leaves_common_pictures_as_unbounded(build, args):
    torch.manual_seed(0)
    log = tl.trace(build().eval(), torch.randn(*args))
    for depth in (None, 1):
        bounded = log.render(depth=depth)
        assert "nslimit=10," in bounded.splitlines()[1]
        unbounded = bounded.replace("nslimit=10, ", "", 1)
        laid_bounded, laid_unbounded = layout([bounded, unbounded])
        assert laid_bounded == laid_unbounded
