"""The built-in demo model: a small CNN with a recurrent refinement loop and an attention head.

It needs no downloads and exercises what a trace shows: nested modules, a module reused across loop
iterations (passes), in-place ops, and functional calls in the root forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class DemoNet(nn.Module):
    def __init__(self, classes: int = 10, steps: int = 3):
        super().__init__()
        self.steps = steps
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = self.stem(x)
        for _ in range(self.steps):  # one module, several passes
            x = x + self.block(x)
        tokens = x.flatten(2).transpose(1, 2)
        attended, _ = self.attn(tokens, tokens, tokens, need_weights=False)
        pooled = attended.mean(dim=1)
        return F.log_softmax(self.head(pooled), dim=-1)


def demo_model() -> tuple:
    """``(model, input)`` for the demo, seeded so every run prints the same trace."""
    torch.manual_seed(0)
    return DemoNet().eval(), torch.randn(2, 3, 16, 16)
