"""``torch.distributed`` collectives recorded as writes of the tensors they write, whatever the grad mode: they
move no version counter, so only their names say what they wrote (a one-rank gloo group)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import torchlens as tl
from torchlens.record.columns import uninitialized_ops
from accel_paths import PATHS, on_path

MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference": torch.inference_mode}


def _receives(x):
    """Rank 0 broadcasts memory it never filled, all-reduces a product, and gathers into a list of zeros."""
    sent = torch.empty(4)
    dist.broadcast(sent, src=0)
    summed = x * 2
    dist.all_reduce(summed)
    gathered = [torch.zeros(4)]
    dist.gather(summed, gathered, dst=0)
    return x + sent.sum() * 0 + summed + gathered[0]


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", PATHS)
def test_collectives_are_writes_of_their_tensors_in_every_grad_mode(one_rank, path, mode):
    # Outside inference mode a collective was no write: broadcast and all_reduce moved no version counter, so
    # the buffer broadcast from torch.empty was not said to hold undefined memory; and gather's list, its second
    # argument, was not protected before the write, so the zeros saved of it were overwritten (inference mode)
    # or dropped with a warning (grad mode).
    with on_path(path), MODES[mode]():
        log = tl.trace(_receives, torch.randn(4))
    ops = {op.func_name: op for op in log.ops if op.kind == "op"}
    assert all(ops[name].is_inplace for name in ("broadcast", "all_reduce", "gather"))
    assert ops["broadcast"].index in uninitialized_ops(log, through_writes=True)
    assert ops["all_reduce"].index not in uninitialized_ops(log, through_writes=True)
    assert torch.equal(ops["zeros"].activation, torch.zeros(4))
    assert torch.equal(ops["gather"].activation, ops["all_reduce"].activation)
    assert log.validate().mismatched == []
