"""Models whose modules compute or change their weights, inputs or outputs outside forward(): parametrizations,
the hook-based weight norm and pruning, quantization-aware training's fake-quantize modules, and hooks the user
registered.  Their traces must leave the model's output and state as an untraced forward does, and replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl

from accel_paths import PATHS, on_path
from trusted import assert_trusted


def _qat_model():
    """A QAT model with the unfused FakeQuantize modules: their first forward resizes the per-channel scale
    and zero point (``resize_``) before filling them."""
    import torch.ao.quantization as quantization

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).train()
    per_channel = quantization.MovingAveragePerChannelMinMaxObserver
    model.qconfig = quantization.QConfig(
        activation=quantization.FakeQuantize.with_args(observer=quantization.MovingAverageMinMaxObserver),
        weight=quantization.FakeQuantize.with_args(observer=per_channel, quant_min=-128, quant_max=127,
                                                   dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    return quantization.prepare_qat(model)


@pytest.mark.parametrize("compiled", PATHS)
def test_a_fake_quantize_model_replays_skipping_only_the_resizes_that_grew_a_buffer(compiled):
    model, x = _qat_model(), torch.randn(2, 4)
    with on_path(compiled):
        log = tl.trace(model, x)
    result = log.validate()
    assert_trusted(result)
    grown = [label for label, reason in result.not_replayed if "resize_ grew" in reason]
    assert grown and all(log[label].func_name == "resize_" for label in grown)
    assert len(grown) == len(result.not_replayed)


def test_a_resize_that_shrinks_or_keeps_the_size_is_replayed():
    def resized(x):
        shrunk = (torch.ones(6) * x.sum()).resize_(2)
        grown = (torch.ones(1) * x.sum()).resize_(4)
        return shrunk.sum() + grown.copy_(x)

    result = tl.trace(resized, torch.randn(4)).validate()
    assert_trusted(result)
    assert [label for label, _ in result.not_replayed] == ["resize_2_8:1"]
