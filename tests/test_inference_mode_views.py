"""Views of in-place results traced under ``torch.inference_mode()``.

An inference tensor has no version counter, and a view of one has no ``_base``: nothing but the writes noted
on its storage says whether its value moved.  A read of such a view must name the op that made it, as the
same forward traced under ``torch.no_grad()`` does, on both capture paths.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl

from accel_paths import PATHS, on_path


class SmallVGG(nn.Module):
    """Features with in-place ReLUs, flattened by ``view`` for the classifier, as AlexNet and VGG do."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                                      nn.Conv2d(4, 4, 1), nn.ReLU(inplace=True))
        self.classifier = nn.Linear(4 * 3 * 3, 5)

    def forward(self, x):
        x = self.features(x)
        return self.classifier(x.view(x.size(0), -1))


class FirstColumns(nn.Module):
    """Returns a view of its in-place-written input after writing a tensor of its own, so that a write
    follows the view's op before the call returns."""

    def forward(self, h):
        kept = h[:, :2]
        torch.zeros(3).add_(1)  # a write, on other memory
        return kept


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.first = FirstColumns()

    def forward(self, x):
        h = self.fc(x).relu_()
        return self.first(h) * 2


@pytest.fixture(scope="module")
def vgg():
    torch.manual_seed(0)
    return SmallVGG().eval(), torch.randn(2, 3, 8, 8)


def _traced(model, x, context):
    with context():
        return model(x), tl.trace(model, x)


def _call(log, label):
    return next(call for call in log.module_calls if call.label == label)


@pytest.mark.parametrize("compiled", PATHS)
def test_a_view_of_an_in_place_relu_is_read_as_that_view_under_inference_mode(vgg, compiled):
    model, x = vgg
    with on_path(compiled):
        expected, log = _traced(model, x, torch.inference_mode)
        _, plain = _traced(model, x, torch.no_grad)
    assert torch.equal(log.output, expected)
    assert log["classifier"].parents == ["view_1_6:1"] and log["view_1_6"].parents == ["relu_2_5:1"]
    assert log.op_parents == plain.op_parents
    assert log.validate().passed


@pytest.mark.parametrize("compiled", PATHS)
def test_a_module_returning_a_view_of_an_in_place_result_names_that_view_under_inference_mode(compiled):
    torch.manual_seed(0)
    model, x = Gated().eval(), torch.randn(3, 4)
    with on_path(compiled):
        expected, log = _traced(model, x, torch.inference_mode)
        _, plain = _traced(model, x, torch.no_grad)
    assert torch.equal(log.output, expected)
    assert _call(log, "first:1").output_ops == _call(plain, "first:1").output_ops == ["getitem_1_3:1"]
    assert torch.equal(log["first"].activation, expected / 2)
