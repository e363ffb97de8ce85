"""How a call's arguments are recorded: which op made each tensor argument, and the arguments as they were.

A tensor written through a view since its op made it holds the writer's value, and a list the model
changes after the call must not change the record of the call.
"""

from __future__ import annotations

import pytest
import torch

import torchlens as tl


def _written_through_a_view(x):
    a = x * 2
    a[:1].add_(5)
    return torch.where(x > 0, a, x)  # three tensor arguments: the general scan, not the inline one


@pytest.mark.parametrize("inference", [False, True], ids=["versioned", "inference tensors"])
def test_an_argument_written_through_a_view_has_the_writer_for_its_parent(inference):
    # An inference tensor has no version counter: the write noted on its storage tells instead.
    with torch.inference_mode(inference):
        log = tl.trace(_written_through_a_view, torch.randn(3))
    assert log["where_1_5"].parents == ["gt_1_4:1", "add_1_3:1", "input_1:1"]


def _appends_after_the_call(x):
    parts = [x, x * 2]
    y = torch.cat(parts)
    parts.append(x * 3)  # a change to the list after the call
    return y


def test_a_list_argument_is_recorded_as_it_was_with_its_tensors_blanked():
    log = tl.trace(_appends_after_the_call, torch.randn(3))
    cat = log["cat_1_2"]
    assert cat.args == ([None, None],) and cat.parents == ["input_1:1", "mul_1_1:1"]


class _Tagged(torch.Tensor):
    """A tensor subclass of the user's: its Parameter is a _Tagged, not an nn.Parameter by type."""


class _CatsItsParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3).as_subclass(_Tagged))

    def forward(self, x):
        return torch.cat([x, self.w]) * 2  # the parameter inside a list: the container scan


def test_a_subclass_parameter_inside_a_list_is_a_parameter_not_a_parent():
    log = tl.trace(_CatsItsParameter(), torch.randn(3))
    cat = log["cat_1_1"]
    assert cat.parents == ["input_1:1"] and cat.params == ("w",) and log.unattributed == 0


def test_every_output_of_a_call_with_parameters_names_its_parameters():
    # nn.LSTM's one call returns its output and both final states: each op read the same weights.
    log = tl.trace(torch.nn.LSTM(4, 3), torch.randn(2, 1, 4))
    lstm = [op for op in log if op.type == "lstm"]
    assert len(lstm) == 3
    assert all(op.params == ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0") for op in lstm)
