"""In-place writes capture must see coming, on both capture paths: the value each op made stays saved, and
the ops after a write read the write."""

import pytest
import torch
import torch.nn as nn

import torchlens as tl

from accel_paths import PATHS, on_path


@pytest.mark.parametrize("compiled", PATHS)
def test_a_write_whose_tensor_is_passed_by_keyword_keeps_the_value_before_it(compiled):
    # nn.init.constant_ hands its tensor on to capture as tensor=, with no positional argument.
    def forward(x):
        y = x * 2
        nn.init.constant_(y, 0.5)
        return y + 1

    x = torch.randn(2, 3)
    with on_path(compiled):
        log = tl.trace(forward, x)
    assert log["mul_1_1:1"].dropped_reason is None
    assert torch.equal(log["mul_1_1:1"].activation, x * 2)
    assert log["constant_1_2:1"].is_inplace and log["add_1_3:1"].parents == ["constant_1_2:1"]
    result = log.validate()
    assert result.passed and result.replayed == 3
