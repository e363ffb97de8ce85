"""PyTorch machinery a model's forward uses beyond plain ops: attention backend selection, custom
operators, higher-order ops.  Each traces faithfully and replays as it ran, or the trace says what it
could not capture."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402


def test_attention_replays_with_the_backends_it_chose_from():
    # sdpa_kernel selects scaled_dot_product_attention's kernel; another backend computes other low bits.
    # Replay ran every attention call under the backends enabled at validation, and reported a mismatch
    # on a faithful trace.
    pytest.importorskip("transformers")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from real_models import small_gpt2_lm

    model = small_gpt2_lm()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))

    class MathAttention(torch.nn.Module):  # the model's own forward opens the block
        def __init__(self):
            super().__init__()
            self.lm = model

        def forward(self, ids):
            with sdpa_kernel([SDPBackend.MATH]):
                return self.lm(ids).logits

    result = tl.validate(MathAttention(), ids)
    assert any(op.type == "scaleddotproductattention" for op in tl.trace(MathAttention(), ids).ops)
    assert result.passed and not result.not_replayed, str(result)
    with sdpa_kernel([SDPBackend.MATH]):  # a block around the trace, closed before validating
        log = tl.trace(model, ids)
    result = log.validate()
    assert result.passed and not result.not_replayed, str(result)
