"""Keyword arguments held in a mapping, as a tokenizer returns them (a transformers ``BatchEncoding``, which is a
mapping but no dict): traced as ``model(**inputs)`` runs them."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

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


def test_keyword_arguments_named_by_no_string_are_refused_before_the_forward():
    # {0: x} as kwargs failed as the forward was called, with Python's "keywords must be strings" noted as raised
    # "in the root forward": the model never ran.
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    for name, run in (("trace", tl.trace), ("validate", tl.validate)):
        with pytest.raises(TypeError, match=rf"^tl\.{name}: kwargs are keyword arguments, named by strings, but one "
                                            r"key is int 0; positional arguments go in args, as a tuple$") as refused:
            run(model, (), {0: x})
        assert not getattr(refused.value, "__notes__", None)
    assert calls == []
    assert torch.equal(tl.trace(model, (), {"input": x}).output, model(x))


def _notes(exc_info) -> str:
    return "\n".join(getattr(exc_info.value, "__notes__", []))


def test_a_mapping_of_keyword_arguments_given_as_the_one_argument_is_named_with_the_way_to_pass_it(gpt2, tmp_path):
    batch = dict(_encoding())
    # GPT-2 reads the dict as its input_ids and fails inside ("'dict' object has no attribute 'size'"), no word of why.
    with pytest.raises((TypeError, AttributeError)) as raised:
        tl.trace(gpt2, batch)
    assert "its keys name the forward's parameters (input_ids, attention_mask)" in _notes(raised)
    assert "tl.trace(model, (), batch)" in _notes(raised)
    with pytest.raises((TypeError, AttributeError)) as raised:
        tl.validate(gpt2, batch)
    assert "as model(**batch) does" in _notes(raised)
    with pytest.raises((TypeError, AttributeError)) as raised:
        tl.extract(gpt2, [batch], ["transformer.h.0"], tmp_path / "out", progress=False)
    assert "kwargs_of=dict in tl.extract" in _notes(raised)


def test_a_dict_the_forward_takes_as_one_argument_gets_no_such_note():
    class Reader(torch.nn.Module):
        def forward(self, batch):
            return batch["x"] * batch["missing"]

    with pytest.raises(KeyError) as raised:
        tl.trace(Reader(), {"x": torch.ones(2)})
    assert "keyword arguments" not in _notes(raised)
