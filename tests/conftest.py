"""Fixtures shared by the test modules."""

from __future__ import annotations

import gc

import pytest
import torch

import torchlens as tl


@pytest.fixture
def no_collector():
    """The cycle collector off for the test (after one pass over earlier tests' garbage): what the test
    sees freed is freed by reference counting, and no collection moves reference counts meanwhile."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def two_traces():
    """Two small traces of different models: the one a folder holds, and the one a save puts over it."""
    torch.manual_seed(0)
    old = tl.trace(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU()), torch.randn(2, 3))
    new = tl.trace(torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh()), torch.randn(2, 3))
    return old, new
