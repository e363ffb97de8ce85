"""What each rank runs in the two-rank tests of collectives written through views and received into
``torch.empty`` (tests/test_distributed.py): module-level functions, so that spawn can pickle them."""

from __future__ import annotations

import torch

from distributed_workers import ReducesAView


def collective_on_a_view(rank, world):
    """The op reading a tensor a collective wrote through a view of it, and what it really read."""
    import torch.distributed as dist

    import torchlens as tl

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))  # each rank its own rows
    model = ReducesAView()
    log = tl.trace(model, x)
    with torch.no_grad():  # the same, by hand: reduce a copy of the rows, put them back
        y = model.fc(x)
        rows = y[:2].clone()
        dist.all_reduce(rows)
        reduced = torch.cat([rows, y[2:]])
    (mul,) = [op for op in log.ops if op.func_name == "mul"]
    return {"collective": list(tl.distributed.collectives(log)["label"]), "mul_parents": mul.parents,
            "mul_read_reduced": torch.equal(mul.activation, reduced * 2),
            "fc_saved_before_the_write": torch.equal(log["linear_1_1:1"].activation, y),
            "mismatched": log.validate().mismatched, "undefined_after_broadcast": broadcast_into_empty(rank, world)}


def broadcast_into_empty(rank, world) -> list:
    """Rank 0 sends ones; the others receive into torch.empty, by world rank (src) and by group rank
    (group_src): the ops the trace counts as holding undefined memory."""
    import torch.distributed as dist

    import torchlens as tl
    from torchlens.record.columns import uninitialized_ops

    group = dist.new_group(list(range(world)))

    def receive(x):
        by_world, by_group = (torch.ones(4) if rank == 0 else torch.empty(4) for _ in range(2))
        dist.broadcast(by_world, src=0)
        dist.broadcast(by_group, group=group, group_src=0)
        return x + by_world + by_group

    with torch.inference_mode():  # writes, which the undefined-memory rule reads, in any grad mode
        log = tl.trace(receive, torch.randn(4))
    return sorted(log.ops[i].func_name for i in uninitialized_ops(log, through_writes=True))


def received_late(rank, world) -> dict:
    """Rank 0 sends a NaN late; rank 1 receives it with ``irecv``, always issued async: the finite flag taken at
    the call was read before the NaN arrived.  Rank 1's report and recorded flags."""
    import time

    import torch.distributed as dist

    import torchlens as tl

    def exchange(x):
        buffer = torch.zeros(4)
        if rank == 0:
            time.sleep(0.3)  # the receiver's call returns before the NaN is sent
            dist.send(torch.full((4,), float("nan")), 1)
        else:
            dist.irecv(buffer, 0).wait()
        return x + buffer

    log = tl.trace(exchange, torch.ones(4), save="none", record_finite=True)
    if rank == 0:
        return None
    report = tl.debug.nonfinite_origin(log)
    return {"origin": report.origin_label, "certain": report.certain, "possible": report.possible_origins,
            "flags": {op.func_name: op.finite for op in log.ops if op.kind == "op"},
            "async": list(tl.distributed.collectives(log)["async"])}
