"""A module call sees the same tensors as the trace, at any depth of its arguments and output."""

from __future__ import annotations

import torch
import torch.nn as nn

import torchlens as tl


class DeepIn(nn.Module):
    def forward(self, nested):
        return nested["a"][0][0][0][0][0] * 2  # six levels down: deeper than any fixed depth limit


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = DeepIn()

    def forward(self, x):
        y = x + 1
        return self.inner({"a": [[[[[y]]]]]})


def test_a_deeply_nested_module_input_is_the_op_that_made_it():
    log = tl.trace(Outer(), torch.randn(3))
    call = log.module_calls[0]
    made = log["add_1_1:1"]
    assert [i for i in call._input_nodes if i >= 0] == [made.index]
