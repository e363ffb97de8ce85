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


@pytest.mark.parametrize("max_ops, error", [(-3, ValueError), ("10", TypeError)])
def test_show_outside_a_notebook_refuses_a_bad_max_ops_as_a_notebook_would(log, monkeypatch, max_ops, error):
    opened = []
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr("webbrowser.open", lambda url: opened.append(url) or True)
    with pytest.raises(error, match=r"^show: max_ops="):
        log.show(max_ops=max_ops)
    assert opened == []
    page = log.show(max_ops=10)  # a good value is taken, and unused outside a notebook: the page draws every op
    page.unlink()
    assert len(opened) == 1


def test_color_by_grad_norm_without_gradients_says_how_to_get_them():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(tl.errors.GradientUnavailable, match="grads=True"):
        tl.trace(model, (torch.randn(2, 4),)).render(color_by="grad_norm")
    log = tl.trace(model, (torch.randn(2, 4),), grads=True)
    with pytest.raises(ValueError, match="run a backward through log.output first"):
        log.render(color_by="grad_norm", format="html")
    log.output.sum().backward()
    assert "colour: grad norm" in log.render(color_by="grad_norm")
