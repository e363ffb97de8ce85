"""Predicate sites (``intervene={lambda op: ...: action}``): a predicate that fails on one of the ops it is
given says which op that was."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from untouched import assert_clean_process  # noqa: E402


class _Head(nn.Module):
    """An op inside a submodule, then one of the root's own forward (``module`` None), as GPT-2's logits slice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)[:, -1]


@pytest.mark.parametrize("stop", [False, True], ids=["intervene", "stop_after"])
def test_a_predicate_that_raises_names_the_op_it_was_given(stop):
    # A test written for ops inside modules ("fc" in op.module) raised its bare "argument of type 'NoneType' is not
    # iterable" at the root's own getitem, naming no op; the error now says which op, and that its module is None.
    model, x = _Head(), torch.randn(2, 3, 4)
    site = lambda op: "fc" in op.module  # noqa: E731
    options = {"stop_after": site} if stop else {"intervene": {site: tl.scale(2.0)}}
    with pytest.raises(TypeError, match="NoneType") as raised:
        tl.trace(model, x, **options)
    kind = "stop_after site" if stop else "intervention site"
    assert raised.value.__notes__[-1].startswith(
        f"torchlens: raised by the {kind} predicate given the op getitem_1_2:1 (type 'getitem', module None, made "
        "outside every submodule)")
    assert_clean_process()
    kept = tl.trace(model, x, intervene={(lambda op: op.module is not None and "fc" in op.module): tl.scale(2.0)})
    assert torch.equal(kept.output, (model.fc(x) * 2)[:, -1])


def test_activation_patching_by_positions_names_the_op_a_predicate_raised_at_or_matched_nothing():
    # With positions=, a raising predicate raised bare (no note naming the op), and one matching nothing leaked a
    # StopIteration from the report's own lookup.
    model, clean, corrupt = _Head(), torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    metric = lambda out: out[0, 0]  # noqa: E731
    with pytest.raises(TypeError, match="NoneType") as raised:
        tl.report.activation_patching(model, clean, corrupt, metric, sites=[lambda op: "fc" in op.module],
                                      positions=1, progress=False)
    assert "given the op getitem_1_2:1" in raised.value.__notes__[-1]
    with pytest.raises(KeyError, match="predicate matched no op of the reference trace"):
        tl.report.activation_patching(model, clean, corrupt, metric, sites=[lambda op: op.type == "conv2d"],
                                      positions=1, progress=False)


@pytest.mark.parametrize("stop", [False, True], ids=["intervene", "stop_after"])
def test_a_predicate_testing_values_in_the_default_reference_says_it_saves_none(stop):
    # A predicate reading op.activation met None in the metadata-only reference made for label sites and raised
    # "'NoneType' object has no attribute 'abs'", with nothing saying why the op had no value; the note says so now.
    model, x = _Head(), torch.randn(2, 3, 4)
    site = lambda op: bool(op.activation.abs().max() > 0)  # noqa: E731
    options = {"stop_after": site} if stop else {"intervene": {site: tl.scale(2.0)}}
    with pytest.raises(AttributeError, match="NoneType") as raised:
        tl.trace(model, x, **options)
    assert "reference saved no activation for linear_1_1:1" in raised.value.__notes__[-1]
    assert_clean_process()
    log = tl.trace(model, x, reference=tl.trace(model, x), **options)  # a reference that saved the values
    if stop:
        assert log.stopped_after == "linear_1_1:1"
    else:
        assert [a.label for a in log.interventions] == ["linear_1_1:1", "getitem_1_2:1"]
