"""What ``flops_vs_dispatch``'s refusal of a forward that draws random numbers advises: eval mode only where a
module is in training mode, since a forward that samples by itself (ViLT's multinomial patch sampling) draws in
eval mode too."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl


class SampledPatches(nn.Module):
    """Keeps two of four patches drawn with ``torch.multinomial``, in eval mode too, as ViLT samples its patches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        keep = torch.multinomial(torch.ones(x.shape[0], x.shape[1]), 2)
        return self.proj(torch.gather(x, 1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1])))


X = torch.randn(2, 4, 4)


def test_a_forward_that_samples_in_eval_mode_is_not_told_to_call_eval():
    with pytest.raises(tl.errors.WitnessFailed, match=r"draws random numbers \(multinomial_1_\d+:1\)") as refused:
        tl.report.flops_vs_dispatch(SampledPatches().eval(), X)
    assert "eval mode already" in str(refused.value) and "model.eval()" not in str(refused.value)


def test_a_forward_in_training_mode_is_told_to_call_eval():
    with pytest.raises(tl.errors.WitnessFailed, match=r"Call model.eval\(\)"):
        tl.report.flops_vs_dispatch(SampledPatches().train(), X)
