"""A tensor ``Tensor.set_`` puts on another tensor's memory inside the forward (docs/capture_honesty.md).

``set_`` reaches no ``__torch_function__``: capture sees only that the tensor's version counter moved with no
write it saw.  The ops reading the tensor afterwards read the values of the tensor whose memory it took, so
they name that tensor's op as their parent, and its own saved value (what the op that made it returned) is
dropped rather than kept as the values it holds now.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from accel_paths import PATHS, on_path


def _whole(y):
    return torch.empty(0).set_(y)


def _rows(y):
    return torch.empty(0).set_(y.untyped_storage(), 4, (2, 4), (4, 1))  # y[1:] of a contiguous (3, 4) y


def _after_a_write(y):
    y.add_(1)
    return torch.empty(0).set_(y)


class _SetReader(nn.Module):
    """Puts a fresh tensor on its hidden activation's memory (``put``) and reads it."""

    def __init__(self, put):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.put = put

    def forward(self, x):
        return self.put(self.fc(x)).relu()


def _trace(model, x, compiled):
    with torch.no_grad(), on_path(compiled), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emptied tensor's saved value is dropped, with a warning
        return tl.trace(model, x)


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("put, parent", [(_whole, "linear_1_1:1"), (_after_a_write, "add_1_2:1")],
                         ids=["set_", "set_after_a_write"])
def test_a_read_after_set_names_the_op_whose_memory_it_took(compiled, put, parent):
    # The relu named the empty as its parent, a 0-element tensor, though it read the linear's 3x4 values,
    # and validation could not replay it.
    model, x = _SetReader(put), torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
    log = _trace(model, x, compiled)
    relu = log.ops[-2]
    assert relu.func_name == "relu" and relu.parents == [parent]
    assert torch.equal(log.output, expected) and torch.equal(relu.activation, expected)
    result = log.validate()
    assert result.passed and relu.label not in dict(result.not_replayed), str(result)


@pytest.mark.parametrize("compiled", PATHS)
def test_a_read_of_part_of_an_op_s_memory_after_set_is_not_replayed_and_says_why(compiled):
    # The relu read the linear's last two rows: no op output is that value, so replay must not take one.
    model, x = _SetReader(_rows), torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
    log = _trace(model, x, compiled)
    relu = log.ops[-2]
    assert relu.parents == ["linear_1_1:1"] and torch.equal(log.output, expected)
    result = log.validate()
    assert result.passed, str(result)
    assert "Tensor.set_ put on part of that storage" in dict(result.not_replayed)[relu.label]


class _SetThenWrite(nn.Module):
    """Puts a recorded tensor on its hidden activation's memory, then writes it in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        u = torch.ones(3, 4).set_(y)
        kept = u.relu()
        u.mul_(2)
        return kept, y.exp()


@pytest.mark.parametrize("compiled", PATHS)
def test_a_tensor_set_on_other_memory_then_written_drops_its_saved_value(compiled):
    # Before the write, capture copied the ones' saved value to keep it: the copy held the linear's values,
    # and validation reported the ones as a mismatch.
    model, x = _SetThenWrite(), torch.randn(3, 4)
    with torch.no_grad():
        made = model.fc(x)
    log = _trace(model, x, compiled)
    ones = log["ones_1_2:1"]
    assert not ones.has_activation and "Tensor.set_" in ones.dropped_reason
    assert log["relu_1_3:1"].parents == ["linear_1_1:1"] and log["mul_1_4:1"].parents == ["linear_1_1:1"]
    assert torch.equal(log["linear_1_1:1"].activation, made)
    result = log.validate()
    assert result.passed, str(result)


class _PutOnAWrittenInput(nn.Module):
    """Returns a fresh tensor put on its written input's memory, after a write elsewhere."""

    def forward(self, y):
        u = torch.empty(0).set_(y)
        torch.zeros(2).add_(1)  # a write after the empty: the module's output is looked at closely
        return u


class _SetInAModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.put = _PutOnAWrittenInput()

    def forward(self, x):
        y = self.fc(x)
        y.add_(1)
        return self.put(y).relu()


@pytest.mark.parametrize("compiled", PATHS)
def test_a_module_returning_a_tensor_set_on_written_memory_does_not_rebind_it_to_its_first_op(compiled):
    # Looking up the module's output found the write of y's memory older than the empty and took u as
    # unchanged since: it bound u to the empty again, and the relu named the empty as its parent.
    model, x = _SetInAModule(), torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
    log = _trace(model, x, compiled)
    assert log["relu_1_6:1"].parents == ["add_1_2:1"] and torch.equal(log.output, expected)
    result = log.validate()
    assert result.passed and "relu_1_6:1" not in dict(result.not_replayed), str(result)
