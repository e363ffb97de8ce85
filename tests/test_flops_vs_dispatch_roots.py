"""flops_vs_dispatch of a callable that runs a model (``lambda **k: m.generate(**k)``): ``root=`` names its
modules by their addresses in the model, and FlopCounterMode's rows are matched to them only where its module
tracker named them by those paths."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import torchlens as tl

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

EMBED, VOCAB, NEW_TOKENS = 32, 50, 2


@pytest.fixture(scope="module")
def gpt2():
    config = transformers.GPT2Config(n_layer=1, n_embd=EMBED, n_head=2, vocab_size=VOCAB, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def t5():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).eval()


def generate(model):
    return lambda **k: model.generate(**k, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def rows_of(result) -> dict:
    return {row["module"]: row for row in result.modules}


def test_root_names_a_generate_loops_modules_and_matches_flop_counter_modes_rows(gpt2):
    """Without ``root=`` every module of a lambda reads ``<unregistered ...>`` with no native figure; with it
    the rows are the model's addresses and carry FlopCounterMode's own per-module counts."""
    ids = torch.tensor([[1, 2, 3]])
    plain = tl.report.flops_vs_dispatch(generate(gpt2), kwargs={"input_ids": ids})
    assert all(row["module"].startswith(("(root", "<unregistered")) for row in plain.modules)
    assert any("n/a" in note and "root=" in note for note in plain.notes)  # the note says what to pass
    result = tl.report.flops_vs_dispatch(generate(gpt2), kwargs={"input_ids": ids}, root=gpt2)
    rows = rows_of(result)
    assert "transformer.h.0.attn.c_attn" in rows and not any("unregistered" in name for name in rows)
    # The head projects the last position once per new token: 2 * EMBED * VOCAB FLOPs each, bias-free.
    assert rows["lm_head"]["native"] == rows["lm_head"]["torchlens"] == NEW_TOKENS * 2 * EMBED * VOCAB
    assert rows["self"]["native"] == result.native_total  # every step is a call of the model itself
    assert all(row["native"] is not None for row in result.modules)
    assert result.native_total == plain.native_total and result.torchlens_total == plain.torchlens_total


def test_modules_met_before_the_root_have_no_native_row(t5):
    """generate() runs T5's encoder before calling the model: the tracker names it ``T5Stack`` and its blocks
    ``T5Stack.block.0``, and the decoder is a T5Stack too, so neither stack's rows have a figure of their own
    (not a false 0); the head, met inside the model's calls, keeps its count."""
    ids = torch.tensor([[1, 2, 3]])
    result = tl.report.flops_vs_dispatch(generate(t5), kwargs={"input_ids": ids}, root=t5)
    rows = rows_of(result)
    stacks = [row for name, row in rows.items() if name.startswith(("encoder", "decoder"))]
    assert stacks and all(row["native"] is None for row in stacks)
    assert rows["encoder.block.0.layer.0.SelfAttention.q"]["torchlens"] > 0
    assert rows["lm_head"]["native"] == rows["lm_head"]["torchlens"] > 0
    assert 0 < rows["self"]["native"] < result.native_total  # the encoder's products ran outside the model


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.fc(x)


def test_a_module_outside_the_root_adds_nothing_to_a_root_row_of_the_same_name():
    """A module the model calls but does not hold is named by its class, its children ``Scorer.fc``: that
    child is not the model's own ``fc`` and its FLOPs stay out of that row."""
    outside = Scorer()
    model = nn.Module()
    model.fc = nn.Linear(4, 4, bias=False)
    model.forward = lambda x: outside(model.fc(x))
    x = torch.randn(2, 4)
    rows = rows_of(tl.report.flops_vs_dispatch(model, x))
    assert rows["fc"]["native"] == rows["fc"]["torchlens"] == 2 * 2 * 4 * 4


def test_root_must_be_a_module(gpt2):
    with pytest.raises(TypeError, match="root= must be an nn.Module"):
        tl.report.flops_vs_dispatch(generate(gpt2), kwargs={"input_ids": torch.tensor([[1]])}, root="gpt2")
