"""Uninitialized memory through torch.distributed collectives: one that reads the tensor it writes
(``all_reduce``, a ``broadcast`` from this rank) leaves undefined bits undefined."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import torchlens as tl
from distributed_workers import launch

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


def broadcast_into_empty(rank, world):
    """Rank 0 sends ones; rank 1 receives into torch.empty, by world rank (src) and by group rank (group_src)."""
    from torchlens.record.columns import uninitialized_ops

    group = dist.new_group(list(range(world)))

    def receive(x):
        by_world, by_group = (torch.ones(4) if rank == 0 else torch.empty(4) for _ in range(2))
        dist.broadcast(by_world, src=0)
        dist.broadcast(by_group, group=group, group_src=0)
        return x + by_world + by_group

    with torch.inference_mode():  # recorded as writes, which the undefined-memory rule reads
        log = tl.trace(receive, torch.randn(4))
    return sorted(log.ops[i].func_name for i in uninitialized_ops(log, through_writes=True))


def test_a_broadcast_received_from_another_rank_fills_torch_empty_whole(tmp_path):
    (_, sender), (_, receiver) = launch(broadcast_into_empty, 2, str(tmp_path))
    assert sender == {"value": []} and receiver == {"value": ["empty", "empty"]}  # the broadcasts' values defined
