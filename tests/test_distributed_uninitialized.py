"""Uninitialized memory through torch.distributed collectives: one that reads the tensor it writes
(``all_reduce``, a ``broadcast`` from this rank) leaves undefined bits undefined.  A broadcast received from
another rank fills its tensor whole: tests/test_distributed.py checks it on two ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import torchlens as tl

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")


class Collective(nn.Module):
    """Adds to its input a ``torch.empty`` buffer that a collective wrote, having read it first."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, x):
        buf = torch.empty(4)
        if self.name == "all_reduce":
            dist.all_reduce(buf)
        else:
            dist.broadcast(buf, src=0)  # this rank is the source: it sends what buf held
        return x + buf


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["all_reduce", "broadcast"])
def test_a_collective_reading_uninitialized_memory_is_no_certain_origin(one_rank, name):
    """Under inference_mode (no version counter) the collective is recorded as writing its tensor, and it was
    counted as overwriting it whole: the NaN torch.empty held (deterministic mode fills it so) was reported as
    born in the collective, from finite inputs."""
    with torch.inference_mode(), _filled_with_nan():
        log = tl.trace(Collective(name), torch.randn(4))
    collective = next(op for op in log.ops if op.func_name == name)
    assert collective.is_inplace and torch.isnan(log[-1].activation).all()
    report = tl.debug.nonfinite_origin(log)
    assert report.found and not report.certain and report.origin.func_name == "add"
    assert set(report.uninitialized) == {"empty_1_1:1", collective.label}


class _filled_with_nan:
    def __enter__(self):
        self.before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)  # and fill_uninitialized_memory (on by default): NaN

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.before)
