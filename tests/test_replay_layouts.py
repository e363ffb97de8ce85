"""Replay hands each op copies of its inputs laid out as the forward's were, so a kernel whose order of
work follows the strides (a reduction) gives the same bits."""

import torch
import torch.nn as nn

import torchlens as tl


class _ExpandedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.randn(4) * 0.1)

    def forward(self, x):
        return x * self.scale.expand(3, 4).sum()


def test_a_reduction_over_an_expanded_tensor_replays_exactly():
    # An expanded tensor's elements overlap: a copy element by element cannot be made, and a contiguous
    # copy sums its twelve values in another order than the forward summed them.
    torch.manual_seed(0)
    result = tl.validate(_ExpandedBuffer(), torch.randn(3, 4))
    assert result.passed and result.replayed == 3, result

    def forward(x):
        y = x.expand(3, 4)
        return y.sum() + y.mean(0).sum(), torch.cumsum(y, 1)

    for _ in range(5):
        result = tl.validate(forward, torch.randn(4).requires_grad_())
        assert result.passed and result.replayed == 6, result
