"""A model that names its own code with ``torch.profiler.record_function``: kernel_profile looks through those
ranges, which are neither aten ops nor torchlens's markers."""

import os
import sys

import pytest
import torch.nn as nn
from torch.profiler import record_function

import torchlens as tl

sys.path.insert(0, os.path.dirname(__file__))
import real_models  # noqa: E402


class Plain(nn.Module):
    """GPT-2's logits."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask).logits


class Annotated(Plain):
    """The same behind a range of the user's own, as a profiling guide has one name the stages of a model."""

    def forward(self, input_ids, attention_mask):
        with record_function("user range: language model"):
            return super().forward(input_ids, attention_mask)


@pytest.fixture(scope="module")
def gpt2():
    model, _, kwargs = real_models.build("gpt2")
    return model.eval(), kwargs


def _profile(model, kwargs):
    return tl.report.kernel_profile(model, (), kwargs, backward=lambda out: out.sum().backward())


def test_a_users_record_function_range_is_looked_through_by_the_join(gpt2):
    # The range opens in one torch call and closes in another, each inside its own op marker, so it nested in
    # neither: the join was called incomplete, and its Python time between ops was reported as the work of
    # "a torch call that returned no tensor".
    lm, kwargs = gpt2
    annotated = _profile(Annotated(lm), kwargs)
    assert annotated.complete and annotated.coverage.problems == []
    assert "call_without_op" not in annotated.coverage.host_unattributed
    # Every op has the aten ops and backward work it has without the range.
    plain = _profile(Plain(lm), kwargs)
    figures = ("aten", "aten_ops", "bwd_aten_ops")
    assert [[r[k] for k in figures] for r in annotated.ops] == [[r[k] for k in figures] for r in plain.ops]
