"""Module sites: how a call is numbered, and a call returning one tensor twice."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl


class _Pair(nn.Module):
    """Returns one tensor twice, as a tuple."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h, h


class _SumOfPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = _Pair()

    def forward(self, x):
        a, b = self.pair(x)
        return a + b


def test_a_module_call_numbered_zero_is_refused_as_such():
    # Else it would be a site no call ever reaches, reported as control flow that skipped it.
    model, x = _SumOfPair(), torch.randn(2, 4)
    with pytest.raises(KeyError, match="module call 'pair:0': calls are numbered from 1"):
        tl.trace(model, x, intervene={"pair:0": tl.scale(2.0)})


def test_a_tensor_a_module_site_returns_twice_is_one_value_edited_once():
    model, x = _SumOfPair(), torch.randn(2, 4)
    seen = []

    def triple(t, op):
        seen.append(op.output_index)
        return t * 3

    log = tl.trace(model, x, intervene={"pair": triple})
    assert seen == [0]  # the action ran once, for the first place the tensor is returned
    assert [applied.site for applied in log.interventions] == ["pair"]
    with torch.no_grad():
        h = model.pair.fc(x)
    assert torch.equal(log.output, h * 3 + h * 3)
