"""``record_finite=True`` and collectives whose result arrives after the call: no flag is taken of it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torchlens as tl
from torchlens.debug.nonfinite import OTHER_RANKS
from accel_paths import PATHS, on_path
from collective_workers import received_late
from distributed_workers import launch


def _reduced(x):
    h = x * 2
    dist.all_reduce(h)  # waited for by the call itself: its flag is the result's
    g = h + 1
    dist.all_reduce(g, async_op=True).wait()  # the result arrives at the wait, after the call
    return funcol.all_reduce(g, "sum", dist.group.WORLD) - 1  # likewise, at the first use of the result


@pytest.mark.parametrize("path", PATHS)
def test_a_collective_issued_async_gets_no_finite_flag(path):
    # The flag was read at the call, before the result arrived: a buffer that then held another rank's NaN
    # read finite in to_pandas, the viewer and a saved trace.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with on_path(path):
            log = tl.trace(_reduced, torch.tensor([1.0, 2.0]), save="none", record_finite=True)
    finally:
        dist.destroy_process_group()
    flags = {op.func_name: op.finite for op in log.ops if op.kind == "op"}
    assert flags["mul"] == flags["add"] == flags["sub"] == (False, False)
    unflagged = [op.label for op in log.ops if op.kind == "op" and op.finite is None]
    reduces = [op.label for op in log.ops if op.func_name == "all_reduce"]
    assert len(reduces) == 3 and log[reduces[0]].finite == (False, False)  # the synchronous one keeps its flag
    assert set(reduces[1:]) <= set(unflagged)


def test_a_receive_issued_by_irecv_gets_no_finite_flag_and_names_the_other_rank(tmp_path):
    # irecv takes no async_op= and is always async: its flag was read at the call, while the buffer still held
    # zeros, and the report named the add after the wait as the certain origin of rank 0's NaN.
    _, (code, result) = launch(received_late, 2, str(tmp_path), timeout=45)
    assert result is not None and "error" not in result, (code, result)
    got = result["value"]
    assert got["flags"]["irecv"] is None and got["async"] == [True]
    assert got["origin"].startswith("add") and not got["certain"]
    assert got["possible"] == ("irecv_1_2:1", OTHER_RANKS)
