"""Module sites: how a call is numbered, a call returning one tensor twice, and a call whose hook raised."""

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


class _CaughtHookFailure(nn.Module):
    """Calls ``pair``, whose forward hook raises, and falls back to ``x * 2`` when it does."""

    def __init__(self):
        super().__init__()
        self.pair = _Pair()

        def refuse(module, args, output):
            raise ValueError("hook refused the output")

        self.pair.register_forward_hook(refuse)

    def forward(self, x):
        try:
            a, b = self.pair(x)
        except ValueError:
            return x * 2
        return a + b


def test_a_module_call_whose_hook_raised_is_not_edited_nor_counted_as_reached():
    # The call computed an output, but its caller never received it: nothing to edit, and the site says so.
    model, x = _CaughtHookFailure(), torch.randn(2, 4)
    with pytest.raises(tl.InterventionError, match=r"'pair' were never reached.*returned None, or raised an "
                                                   r"exception, in its forward or one of its hooks"):
        tl.trace(model, x, intervene={"pair": tl.scale(3.0)})
    assert torch.equal(tl.trace(model, x).output, x * 2)
