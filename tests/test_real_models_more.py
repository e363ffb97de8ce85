"""Real ``transformers`` architectures beyond the corpus of tests/real_models.py, each for what it alone exercises.

Tiny configs with random weights, built once per module (``HF_HUB_OFFLINE`` set by real_models, nothing is
downloaded); the tests skip when ``transformers`` is not installed.
"""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
from real_models import VOCAB, _attention_mask, _tokens
from real_models_nn import HIDDEN

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def longt5():
    """LongT5 with transient-global attention: its block aggregates and attention scores are einsums over
    ``...`` (``...nd,...ng->...gd``), an equation the FLOPs registry has no formula for."""
    torch.manual_seed(0)
    config = transformers.LongT5Config(d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                                       num_heads=4, vocab_size=VOCAB, local_radius=2, global_block_size=2,
                                       encoder_attention_type="transient-global", decoder_start_token_id=0,
                                       pad_token_id=0)
    model = transformers.LongT5ForConditionalGeneration(config).eval()
    model.config.use_cache = False
    return model, {"input_ids": _tokens(), "attention_mask": _attention_mask(), "decoder_input_ids": _tokens(seq=5)}


def test_flops_vs_dispatch_compares_a_forward_whose_einsums_have_no_formula(longt5):
    # The counted run dropped every call of a product function some of whose calls had no formula, so its
    # list of products was shorter than the trace's, and the comparison was refused as two different programs.
    model, kwargs = longt5
    result = tl.report.flops_vs_dispatch(model, (), kwargs)
    log = tl.trace(model, (), kwargs, save="none")
    einsums = [op.label for op in log.ops if op.func_name == "einsum"]
    assert einsums and sorted(result.torchlens_total.unknown) == sorted(einsums)
    assert result.witness["products_match"] and result.witness["outputs_match"]
    assert any("einsum" in note and "no torchlens formula" in note for note in result.notes), result.notes
    native = sum(row["native"] for row in result.families)
    assert result.native_total == native > 0
