"""Keyword arguments held in a mapping, as a tokenizer returns them (a transformers ``BatchEncoding``, which is a
mapping but no dict): traced as ``model(**inputs)`` runs them."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import torchlens as tl

sys.path.insert(0, os.path.dirname(__file__))  # the real-model corpus lives beside this file
import real_models  # noqa: E402 - imports transformers lazily, per entry


@pytest.fixture(scope="module")
def gpt2():
    pytest.importorskip("transformers")
    return real_models.small_gpt2_lm()


def _encoding():
    from transformers import BatchEncoding

    ids = torch.tensor([[5, 9, 13, 21], [7, 3, 30, 2]])
    return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def test_a_tokenizers_mapping_is_taken_as_the_keyword_arguments(gpt2):
    inputs = _encoding()
    expected = gpt2(**inputs).logits
    log = tl.trace(gpt2, (), inputs)  # was refused: "kwargs must be a dict ..., got a BatchEncoding"
    assert torch.equal(log.output.logits, expected)
    assert [op.io_path for op in log.ops if op.kind == "input"] == ["input.input_ids", "input.attention_mask"]
    assert tl.validate(gpt2, (), inputs).passed
    table = tl.report.activation_patching(gpt2, (), (), lambda out: out.logits[0, -1, 3], kwargs=inputs,
                                          sites=["transformer.h.0"], progress=False)
    assert list(table.error) == [""]


def test_keyword_arguments_that_are_no_mapping_are_still_refused(gpt2):
    with pytest.raises(TypeError, match=r"kwargs must be a dict \(or another mapping\).*got a list"):
        tl.trace(gpt2, (), [torch.tensor([[5, 9]])])
