"""Options of render and show given wrong: each refused by name, in every format, before anything is drawn."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl


@pytest.fixture(scope="module")
def log():
    return tl.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), (torch.randn(2, 4),))


@pytest.mark.parametrize("fmt", ["dot", "html"])
def test_a_title_that_is_no_string_is_refused_by_name(log, fmt):
    with pytest.raises(TypeError, match=r"title= takes a string .* got int 5"):
        log.render(format=fmt, title=5)
    assert "<b>my model</b>" in log.render(title="my model")
