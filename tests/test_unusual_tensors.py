"""Tensors without values, tensor subclasses and torch.func transforms: a trace of them is right or says
what it cannot vouch for, and validation answers instead of failing inside torch."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import torchlens as tl


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.fc(x).relu())


def test_validate_under_fake_tensor_mode_replays_nothing_and_says_why():
    """A FakeTensor reports a real device but holds no values: validation treats it as a meta tensor
    (shapes and dtypes compared, no op replayed, the reason given) instead of failing inside torch (a deep
    copy of the model lands in another FakeTensorMode; ``torch.equal`` on fake tensors is data-dependent)."""
    with FakeTensorMode():
        model, x = Small(), torch.randn(2, 4)
        log = tl.trace(model, x)
        assert log["head"].shape == (2, 2)
        result = tl.validate(model, x)
        replayed = log.validate()
    reason = "fake tensors (FakeTensorMode) hold no values to compare"
    assert result.passed and result.replayed == 0 and result.outputs_match, str(result)
    assert {why for _, why in result.not_replayed} == {reason}
    assert replayed.status == "nothing to replay" and {why for _, why in replayed.not_replayed} == {reason}
