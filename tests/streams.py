"""Batch streams shared by the extraction tests: seeded batches, and a stream that is interrupted."""

from __future__ import annotations

import torch


def batches(n=10, rows=4, seed=2):
    """``n`` seeded batches of shape ``(rows, 8)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 8, generator=g) for _ in range(n)]


def interrupted(items, at):
    """Yield ``items`` and raise KeyboardInterrupt in place of item ``at`` (a user pressing Ctrl-C)."""
    for i, item in enumerate(items):
        if i == at:
            raise KeyboardInterrupt
        yield item
