"""Ranks meeting before ``tl.distributed.gather`` and a distributed ``tl.extract``: a rank that arrives after the
others stopped waiting for it is told so at once, instead of entering the collective after the meeting alone."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import torchlens as tl
from distributed_workers import LAYERS, MLP, KilledAfter, dataset, launch
from test_distributed import values

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo"),
              pytest.mark.path_independent]  # ranks meeting and waiting, not what capture records

WAIT_S = 2.0


def arrive_late(rank, world, out):
    """Rank 1 calls gather, then tl.extract, each after the others' wait has passed: what each call says on each
    rank."""
    from torch.utils.data import DataLoader, DistributedSampler

    log = tl.trace(MLP(), torch.randn(3, 8))
    ds = dataset(8)
    loader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=False))
    calls = {"gather": lambda: tl.distributed.gather(log, dst=0, timeout=WAIT_S),
             "extract": lambda: tl.extract(KilledAfter(0).eval(), loader, LAYERS, out, args_of=lambda b: b[0],
                                           progress=False, barrier_timeout=WAIT_S)}
    said = {}
    for name, call in calls.items():
        if rank == 1:
            time.sleep(2 * WAIT_S)
        try:
            call()
            said[name] = "returned"
        except tl.distributed.RankFailedError as exc:
            said[name] = str(exc)
    return said


def test_a_rank_arriving_after_the_others_stopped_waiting_is_told_so_at_once(tmp_path):
    # It passed the meeting (every mark was there) and waited alone in the collective after it until the process
    # group's timeout, to fail there naming no one ("Timed out waiting 20000ms for send operation to complete"), or
    # was killed first.
    on_time, late = values(launch(arrive_late, 2, str(tmp_path), str(tmp_path / "out"), timeout=50, group_timeout=20))
    assert on_time["gather"].startswith("rank 1 did not call tl.distributed.gather within 2s of this rank")
    assert on_time["extract"].startswith("rank 1 did not call tl.extract within 2s of this rank")
    for call in ("gather", "extract"):
        assert late[call].startswith(f"this rank called {'tl.distributed.' if call == 'gather' else 'tl.'}{call} "
                                     "after rank 0 had stopped waiting for it")


def refuse_then_call_again(rank, world, out):
    """Rank 1 gives gather a dst, then tl.extract a shard_bytes, of its own that they refuse, and every rank calls
    each again with good ones: what each call says on each rank."""
    from torch.utils.data import DataLoader, DistributedSampler

    log = tl.trace(MLP(), torch.randn(3, 8))
    ds = dataset(8)
    loader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=False))

    def gather(dst):
        got = tl.distributed.gather(log, dst=dst, timeout=20)
        return len(got) if got is not None else "returned"

    def extract(shard_bytes):
        tl.extract(KilledAfter(0).eval(), loader, LAYERS, out, args_of=lambda b: b[0], shard_bytes=shard_bytes,
                   progress=False, barrier_timeout=20)
        return "returned"

    said = {}
    for name, call, refused, good in (("gather", gather, 5, 0), ("extract", extract, -1, 1 << 20)):
        for attempt, argument in (("refused", refused if rank == 1 else good), ("again", good)):
            try:
                said[name, attempt] = call(argument)
            except (ValueError, tl.distributed.RankFailedError) as exc:
                said[name, attempt] = str(exc)
    return said


def test_a_call_one_rank_refused_leaves_every_rank_meeting_at_the_next(tmp_path):
    # Rank 1 refused its argument before counting its call, rank 0 counted its own: every later call on the group
    # waited for a call number the other rank was not at, and failed, naming it absent or late.
    on_time, refusing = values(launch(refuse_then_call_again, 2, str(tmp_path), str(tmp_path / "out"), timeout=50))
    assert on_time["gather", "again"] == 2 and refusing["gather", "again"] == "returned"
    assert on_time["extract", "again"] == refusing["extract", "again"] == "returned"
    # and the rank that waited was told at once which rank refused, and why, instead of waiting its 20 s for it
    assert refusing["gather", "refused"].startswith("gather: dst=5 is not a rank of the process group")
    assert on_time["gather", "refused"].startswith("rank 1 refused its arguments to tl.distributed.gather (ValueError: "
                                                   "gather: dst=5 is not a rank")
    assert refusing["extract", "refused"].startswith("tl.extract: shard_bytes=-1")
    assert on_time["extract", "refused"].startswith("rank 1 refused its arguments to tl.extract (ValueError: "
                                                    "tl.extract: shard_bytes=-1")
