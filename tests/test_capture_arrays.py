"""NumPy array arguments (docs/capture_honesty.md, Values): recorded as copies, since a write through a tensor
on an array's memory moves no version counter, and held once per array while its bytes stay the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import torchlens as tl
from accel_paths import PATHS, on_path


class _TableReader(nn.Module):
    """Reads one NumPy table in three ops, positionally and by keyword."""

    def __init__(self):
        super().__init__()
        self.table = np.random.default_rng(0).random((3, 4), dtype=np.float32)

    def forward(self, x):
        return torch.asarray(self.table) + torch.as_tensor(self.table) * x + torch.tensor(data=self.table)


def _arrays_read(log) -> list:
    """``(op label, array)`` for each NumPy array an op's record holds as an argument, in op order."""
    return [(op.label, a) for op in log.ops for a in (*(op.args or ()), *(op.kwargs or {}).values())
            if isinstance(a, np.ndarray)]


@pytest.mark.parametrize("compiled", PATHS)
def test_an_unchanged_array_many_ops_take_is_held_once(compiled):
    # Each op taking the table recorded a copy of its own: a large array read by many ops was held that
    # many times over.
    model, x = _TableReader(), torch.randn(3, 4)
    with on_path(compiled):
        log = tl.trace(model, x)
    read = _arrays_read(log)
    assert [label.split("_")[0] for label, _ in read] == ["asarray", "astensor", "tensor"]
    first = read[0][1]
    assert all(a is first for _, a in read) and not np.shares_memory(first, model.table)
    assert np.array_equal(first, model.table)
    assert torch.equal(log.output, model(x))


class _WritesBetweenReads(nn.Module):
    """Reads an array, writes it through a tensor on its memory (no version counter moves), reads it, writes
    it through NumPy, and reads it again."""

    def forward(self, x):
        a = x.detach().numpy() * 2
        first = torch.tensor(a)
        torch.from_numpy(a).add_(1)
        second = torch.tensor(a)
        a += 1
        return first, second, torch.tensor(data=a)


@pytest.mark.parametrize("compiled", PATHS)
def test_an_array_written_between_two_reads_is_recorded_as_each_read_it(compiled):
    # Held once per array, the copy must not stand for a read after a write: each op keeps what it read.
    x = torch.arange(12.0).reshape(3, 4)  # whole numbers: x * 2 + 1 + 1 is x * 2 + 2 exactly
    with on_path(compiled):
        log = tl.trace(_WritesBetweenReads(), x)
    read = [a for _, a in _arrays_read(log)]
    assert len(read) == 3 and len({id(a) for a in read}) == 3
    for k, a in enumerate(read):
        assert np.array_equal(a, (x * 2 + k).numpy())
    result = log.validate()
    assert result.passed and all(op.startswith("add") for op, _ in result.not_replayed), str(result)


class _WritesAfterATensorOnIt(nn.Module):
    """Makes a tensor on an array's memory (``torch.asarray`` copies nothing), or a copy of it, then writes the
    array through NumPy."""

    def __init__(self, copy):
        super().__init__()
        self.copy = copy

    def forward(self, x):
        a = x.detach().numpy() * 2
        t = torch.asarray(a, copy=self.copy)
        a[:] = 0
        return t + 1


@pytest.mark.parametrize("compiled", PATHS)
def test_an_output_on_an_array_written_afterwards_is_a_mismatch_not_a_pass(compiled):
    # The write moves no version counter, so the saved output shows the written values: replay must say so
    # (docs/capture_honesty.md, Values), and a copy keeps what the op made.
    x = torch.arange(12.0).reshape(3, 4)
    with on_path(compiled):
        shared = tl.trace(_WritesAfterATensorOnIt(copy=None), x)
        copied = tl.trace(_WritesAfterATensorOnIt(copy=True), x)
    assert not shared["asarray_1_2:1"].activation.any()
    result = shared.validate()
    assert result.status == "failed" and [label for label, *_ in result.mismatched] == ["asarray_1_2:1"]
    assert torch.equal(copied["asarray_1_2:1"].activation, x * 2) and copied.validate().passed
