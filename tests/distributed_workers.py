"""What each rank runs in tests/test_distributed.py: module-level functions, so that spawn can pickle them.

``launch`` starts ``world`` processes on one host over gloo (a file store in a temporary folder, so no
port can collide), each bounded by timeouts; a rank's return value (or error text) comes back through a
file, so a rank that is killed still lets the others report.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.nn as nn

RANK_TIMEOUT_S = 90


def launch(fn, world: int, workdir, *args, timeout: float = RANK_TIMEOUT_S, group_timeout: float = 60) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; ``[(exit code, result or None), ...]``.
    ``group_timeout``: the process group's timeout, in seconds."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    store = os.path.join(workdir, f"store-{time.time_ns()}")
    procs = [ctx.Process(target=_entry, args=(fn, rank, world, store, workdir, args, group_timeout),
                         daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():  # a hang: fail fast instead of stalling the suite
            p.kill()
            p.join()
    results = []
    for rank, p in enumerate(procs):
        path = os.path.join(workdir, f"result-{rank}.pkl")
        result = pickle.load(open(path, "rb")) if os.path.exists(path) else None
        if os.path.exists(path):
            os.remove(path)
        results.append((p.exitcode, result))
    return results


def _entry(fn, rank, world, store, workdir, args, group_timeout):
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on a shared two-core machine
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=group_timeout))
    try:
        result = {"value": fn(rank, world, *args)}
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which asserts on it
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    with open(os.path.join(workdir, f"result-{rank}.pkl.tmp"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(workdir, f"result-{rank}.pkl.tmp"), os.path.join(workdir, f"result-{rank}.pkl"))
    if "error" not in result:
        dist.destroy_process_group()
    os._exit(0)  # a failed group may hang in teardown; the result is already written


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class WithCollectives(nn.Module):
    """A forward that talks to the other ranks: torch.distributed calls and a functional collective."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        y = self.fc(x)
        dist.all_reduce(y)
        z = funcol.all_reduce(y * 2, "sum", dist.group.WORLD)
        parts = [torch.empty_like(z) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, z)
        return torch.cat(parts) + 1


class EveryCollective(nn.Module):
    """One call of each torch.distributed collective docs/distributed.md lists as recorded, on two ranks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        import torch.distributed as dist

        rank, y = dist.get_rank(), self.fc(x)  # 4 rows: two per rank where a collective splits them
        dist.broadcast(y, src=0)
        dist.all_reduce_coalesced([y])
        dist.reduce(y, dst=0)
        half, whole, part = torch.empty(2, 4), torch.empty(4, 4), torch.empty(2, 4)
        dist.reduce_scatter_tensor(half, y)
        dist.all_gather_into_tensor(whole, half)
        dist.reduce_scatter(part, list(y.chunk(2)))
        swapped, pieces = torch.empty_like(whole), [torch.empty(2, 4), torch.empty(2, 4)]
        dist.all_to_all_single(swapped, whole)
        dist.all_to_all(pieces, list(swapped.chunk(2)))
        got = torch.empty(2, 4)
        dist.scatter(got, list(y.chunk(2)) if rank == 0 else None, src=0)
        gathered = [torch.empty(2, 4), torch.empty(2, 4)] if rank == 0 else None
        dist.gather(got, gathered, dst=0)  # written on rank 0 alone
        dist.all_reduce(part, async_op=True).wait()
        if rank == 0:
            dist.send(got, 1)  # writes nothing: no op
        else:
            dist.recv(got, 0)
        return torch.cat([half, part, got, *pieces, *(gathered or [])]) * 2


def traces(rank, world, workdir):
    """DDP, FSDP2 and collective-issuing forwards traced on each rank, and replicas compared."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torchlens as tl

    out = {}
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))  # each rank its own batch
    ddp = DDP(MLP())
    with torch.no_grad():
        expected = ddp(x)
    log = tl.trace(ddp, x)
    out["ddp"] = {"equal": torch.equal(log.output, expected), "addresses": [m.address for m in log.modules],
                  "rank": log.rank, "world_size": log.world_size}
    with warnings.catch_warnings(record=True) as caught:  # a backward through the trace: no all-reduce
        warnings.simplefilter("always")
        log = tl.trace(ddp, x, grads=True)
        log.backward(log.output.sum())
    local = MLP()  # this rank's own gradient, without DDP
    local(x).sum().backward()
    out["ddp"]["grads_warned"] = [str(w.message) for w in caught if "all-reduce" in str(w.message)]
    out["ddp"]["grads_are_local"] = all(torch.equal(p.grad, q.grad) for p, q in zip(ddp.module.parameters(),
                                                                                 local.parameters()))
    ddp.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught, ddp.no_sync():  # local gradients are what was asked for
        warnings.simplefilter("always")
        log = tl.trace(ddp, x, grads=True)
        log.backward(log.output.sum())
    out["ddp"]["no_sync_warned"] = [str(w.message) for w in caught if "all-reduce" in str(w.message)]
    ddp.zero_grad(set_to_none=True)

    fsdp = MLP()
    fully_shard(fsdp.fc1)
    fully_shard(fsdp.fc2)
    fully_shard(fsdp)
    with torch.no_grad():
        expected = fsdp(x)
    log = tl.trace(fsdp, x)
    table = tl.distributed.collectives(log)
    out["fsdp"] = {"equal": torch.equal(log.output, expected), "addresses": [m.address for m in log.modules],
                   "collectives": list(table["collective"]), "modules": list(table["module"]),
                   "linear_inputs": [op.parents for op in log.ops if op.func_name == "linear"],
                   "linear_params": [op.params for op in log.ops if op.func_name == "linear"],
                   "param_users": [(p.address, [log[label].func_name for label in p.op_labels]) for p in log.params]}
    untraced = MLP()  # FSDP2's gradient reduce-scatter runs from its autograd hooks, traced forward or not
    for module in (untraced.fc1, untraced.fc2, untraced):
        fully_shard(module)
    untraced(x).sum().backward()
    log = tl.trace(fsdp, x, grads=True)
    log.backward(log.output.sum())
    out["fsdp"]["grads_equal"] = all(torch.equal(p.grad.to_local(), q.grad.to_local())
                                     for p, q in zip(fsdp.parameters(), untraced.parameters()))
    out["fsdp"]["grad_types"] = sorted({type(p.grad).__name__ for p in fsdp.parameters()})

    fresh = MLP()  # no forward yet: an op-label site resolves against the first forward, which runs more ops
    for module in (fresh.fc1, fresh.fc2, fresh):
        fully_shard(module)
    (relu,) = [op.label for op in tl.trace(fresh, x).ops if op.func_name == "relu"]
    fresh = MLP()
    for module in (fresh.fc1, fresh.fc2, fresh):
        fully_shard(module)
    try:
        tl.trace(fresh, x, intervene={relu: tl.zero_ablate()})
        out["fsdp"]["first_forward_site"] = None
    except tl.InterventionError as exc:
        out["fsdp"]["first_forward_site"] = str(exc)
    out["fsdp"]["module_site_zeroed"] = torch.equal(tl.trace(fresh, x, intervene={"act": tl.zero_ablate()}).output,
                                                    fresh.fc2(torch.zeros(3, 16)).detach())
    first = MLP()
    fully_shard(first.fc1)
    fully_shard(first.fc2)
    fully_shard(first)
    log = tl.trace(first, x)  # its first forward makes the unsharded parameters (as_strided views), then frees them
    out["fsdp"]["freed"] = [op.func_name for op in log.ops if not op.has_activation
                            and "memory was freed" in log.dropped_activations.get(op.index, "")]
    log = tl.trace(first, x)  # a later forward: the unsharded parameters exist, and are freed again after it
    result = log.validate()  # it reads the parameters each linear ran with: freed, so not read
    out["fsdp"]["splits"] = [op.label for op in log.ops if op.func_name == "split_with_sizes_copy"]
    out["fsdp"]["validate"] = (result.passed, result.mismatched, [why for label, why in result.not_replayed
                                                                  if label.startswith("linear")])

    model = WithCollectives()
    expected = model(x)
    log = tl.trace(model, x)
    table = tl.distributed.collectives(log)
    reduced = table["label"][0]
    out["collectives"] = {
        "equal": torch.equal(log.output, expected), "names": list(table["collective"]),
        "groups": [list(r) for r in table["group_ranks"]],
        "reduced_is_parent_of_mul": [op.parents for op in log.ops if op.func_name == "mul"] == [[reduced]],
        "reduced_value_saved": torch.equal(log[reduced].activation, _all_reduced(model, x)),
    }
    saved = tl.load(log.save(os.path.join(workdir, f"collectives-{rank}")))
    out["collectives"]["loaded_names"] = list(tl.distributed.collectives(saved)["collective"])
    result = log.validate()  # on one rank alone: collectives must not be replayed (they would block)
    out["collectives"]["validate_not_replayed"] = sorted(
        label for label, reason in result.not_replayed if reason.startswith("a collective"))
    out["collectives"]["validate_mismatched"] = result.mismatched
    out["collectives"]["labels"] = list(table["label"])
    with torch.no_grad(), warnings.catch_warnings():  # gloo's all_gather_into_tensor fails with grad mode on
        warnings.simplefilter("ignore", FutureWarning)  # all_reduce_coalesced is deprecated
        model, rows = EveryCollective(), torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
        expected = model(rows)
        log = tl.trace(model, rows)
    table = tl.distributed.collectives(log)
    out["every"] = {"equal": torch.equal(log.output, expected), "names": list(table["collective"]),
                    "async": list(table["async"]), "groups": [list(r) for r in table["group_ranks"]]}

    # Replicas that should agree: the same batch on every rank, one weight nudged on rank 1.
    same = torch.randn(3, 8, generator=torch.Generator().manual_seed(7))
    replica = MLP()
    gathered = tl.distributed.gather(tl.trace(replica, same), dst=0, activations=True)
    out["agree"] = gathered and tl.distributed.compare(gathered).to_dict("records")
    if rank == 1:
        with torch.no_grad():
            replica.fc2.weight[0, 0] += 1e-3
    planted = tl.trace(replica, same)
    planted.save(os.path.join(workdir, f"saved-{rank}"))  # per-rank saves, compared after loading
    gathered = tl.distributed.gather(planted, dst=0, activations=True)
    if rank == 0:
        out["planted"] = tl.distributed.compare(gathered).to_dict("records")
        out["tolerated"] = tl.distributed.compare(gathered, atol=1e-2).to_dict("records")
        out["labels"] = [row["label"] for row in gathered[0].ops]
        out["metadata_only"] = len(tl.distributed.gather(tl.trace(replica, same), dst=0)[1].activations)
    else:
        tl.distributed.gather(tl.trace(replica, same), dst=0)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    sharded = parallelize_module(MLP(), init_device_mesh("cpu", (world,)),
                                 {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    gathered = tl.distributed.gather(tl.trace(sharded, same), dst=0, activations=True)
    if rank == 0:  # compared on one rank: a DTensor activation compared as one waited for the others
        out["tensor_parallel"] = {"types": sorted({type(t).__name__ for g in gathered for t in g.activations.values()}),
                                  "compare": tl.distributed.compare(gathered).to_dict("records")}
    poisoned = x.clone()
    poisoned[0, 0] = float("nan") if rank == 1 else poisoned[0, 0]  # rank 1's NaN reaches rank 0 by all_reduce
    report = tl.debug.nonfinite_origin(tl.trace(ReducesAView(), poisoned, save="none", record_finite=True))
    out["nonfinite"] = {"origin": report.origin_label, "kind": report.origin_kind, "certain": report.certain,
                        "possible": report.possible_origins, "text": str(report)}
    late = tl.trace(ReducesLate(), poisoned, save="none", record_finite=True)
    report = tl.debug.nonfinite_origin(late)
    out["nonfinite_async"] = {"origin": report.origin_label, "certain": report.certain,
                              "possible": report.possible_origins,
                              "finite": {op.label: op.finite for op in late.ops if op.kind == "op"}}
    dist.barrier()
    return out


def _all_reduced(model, x):
    import torch.distributed as dist

    with torch.no_grad():
        y = model.fc(x)
        dist.all_reduce(y)
    return y


class ReducesLate(nn.Module):
    """An async ``dist.all_reduce`` that rank 1 joins late: rank 0's result arrives at the wait, after the issue."""

    def forward(self, x):
        import torch.distributed as dist

        h = x * 2
        time.sleep(0.3 * dist.get_rank())
        dist.all_reduce(h, async_op=True).wait()
        return h + 1


class ReducesAView(nn.Module):
    """``dist.all_reduce`` on rows of ``fc``'s output, then the whole output read (a bucketed flat buffer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        import torch.distributed as dist

        y = self.fc(x)
        dist.all_reduce(y[:2])
        return y * 2


def extract_fsdp2(rank, world, out, n, batch_size):
    """This rank's part of a distributed extraction of an FSDP2-sharded model (its parameters DTensors), run twice:
    the second returns at once."""
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler

    import torchlens as tl

    ds, model = dataset(n), KilledAfter(0).eval()
    fully_shard(model.inner.fc1)
    fully_shard(model.inner.fc2)
    fully_shard(model)
    loader = DataLoader(ds, batch_size=batch_size, sampler=DistributedSampler(ds, shuffle=False))
    for _ in range(2):
        tl.extract(model, loader, LAYERS, out, args_of=lambda b: b[0], progress=False)
    return model.forwards


def extract_tensor_parallel(rank, world, out):
    """A distributed extraction of a tensor-parallel model (whose ranks must see the same batch): the error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import torchlens as tl

    model = MLP()
    parallelize_module(model, init_device_mesh("cpu", (world,)), {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    batches = [x for (x,) in dataset(8)]
    try:
        tl.extract(model, [b[None] for b in batches], ["fc2"], out, progress=False)
    except ValueError as exc:
        return str(exc)
    return None


def save_to_one_path(rank, world, path):
    """Every rank saves its trace to the same folder at once, then again with overwrite=True: what each gets."""
    import torch.distributed as dist

    import torchlens as tl

    log = tl.trace(MLP(), torch.full((2, 8), float(rank)))
    got = {}
    for attempt, overwrite in (("first", False), ("overwrite", True)):
        dist.barrier()  # the ranks save at the same moment
        try:
            log.save(path, overwrite=overwrite)
            got[attempt] = "saved"
        except tl.io.TraceFileError as exc:
            got[attempt] = str(exc)
        dist.barrier()
        got[f"{attempt} holds"] = tl.load(path).rank
    return got


class ReluOnRankZero(MLP):
    """The MLP, its ReLU applied on rank 0 only: rank 0's graph has an op (``relu_1_2:1``) rank 1's lacks."""

    def __init__(self, rank):
        super().__init__()
        self.relu = rank == 0

    def forward(self, x):
        y = self.fc1(x)
        return self.fc2(torch.relu(y) if self.relu else y)


def gather_labels_some_ranks_lack(rank, world):
    """``gather`` asked for an op only rank 0 has, then for one no rank has: what each rank gets."""
    import torchlens as tl

    log = tl.trace(ReluOnRankZero(rank), torch.randn(3, 8, generator=torch.Generator().manual_seed(0)))
    got = tl.distributed.gather(log, dst=0, activations=["relu_1_2:1", "linear_1_1:1"])
    result = {"labels": [op.label for op in log.ops]}
    if got is not None:
        result["gathered"] = [sorted(t.activations) for t in got]
        result["compare"] = tl.distributed.compare(got).to_dict("records")
    try:
        result["mistyped"] = tl.distributed.gather(log, dst=0, activations=["relu_9_9:1"])
    except KeyError as exc:
        result["mistyped"] = str(exc)
    return result


class KilledAfter(nn.Module):
    """MLP that SIGKILLs its own process at forward number ``kill_at`` (0: never)."""

    def __init__(self, kill_at: int):
        super().__init__()
        self.inner = MLP()
        self.kill_at = kill_at
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        if self.forwards == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(x)


def dataset(n: int):
    from torch.utils.data import TensorDataset

    return TensorDataset(torch.randn(n, 8, generator=torch.Generator().manual_seed(3)))


LAYERS = ["inner.fc1", "inner.act", "inner"]


def extract_through_ddp(rank, world, out, n, batch_size):
    """This rank's part of a distributed extraction of a DDP-wrapped model, its layers named as in the plain one."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    import torchlens as tl

    ds, model = dataset(n), KilledAfter(0).eval()
    shuffled = DistributedSampler(ds, shuffle=True, seed=5)  # each rank's rows in another order than the dataset's
    shuffled.set_epoch(1)
    tl.extract(DDP(model), DataLoader(ds, batch_size=batch_size, sampler=shuffled), LAYERS, out,
               args_of=lambda b: b[0], progress=False)
    return model.forwards


def extract_share(rank, world, out, n, batch_size, kill_rank=-1, kill_at=0, barrier_timeout=30.0,
                  round_robin=None):
    """This rank's part of one distributed extraction; returns how many forwards it ran."""
    from torch.utils.data import DataLoader, DistributedSampler

    import torchlens as tl

    ds = dataset(n)
    model = KilledAfter(kill_at if rank == kill_rank else 0).eval()
    loader = DataLoader(ds, batch_size=batch_size, sampler=DistributedSampler(ds, shuffle=False))
    tl.extract(model, loader, LAYERS, out, args_of=lambda b: b[0], shard_bytes=200, progress=False,
               barrier_timeout=barrier_timeout)
    result = {"forwards": model.forwards}
    if round_robin is not None:  # a plain list of batches, sharded batch by batch, given as keyword arguments
        batches = [ds.tensors[0][i:i + batch_size] for i in range(0, n, batch_size)]
        model = KilledAfter(0).eval()
        tl.extract(model, [{"x": b} for b in batches], LAYERS, round_robin, kwargs_of=dict, shard_bytes=200,
                   progress=False)
        result["round_robin_forwards"] = model.forwards
        mine = [b + rank for b in batches]  # each rank its own stream: not shardable batch by batch
        try:
            tl.extract(KilledAfter(0).eval(), mine, LAYERS, round_robin + "-per-rank", progress=False)
        except ValueError as exc:
            result["per_rank_error"] = str(exc)
    import torch.distributed as dist

    result["process_groups"] = len(dist.distributed_c10d._world.pg_map)  # the world's, and none of tl.extract's
    return result


def gather_skipped_by_one_rank(rank, world, absent, timeout):
    """Every rank but ``absent`` calls ``gather``: what each of them gets (``absent`` waits it out, then returns)."""
    import torchlens as tl

    if rank == absent:
        time.sleep(timeout + 2)
        return None
    log = tl.trace(MLP(), torch.randn(3, 8))
    try:
        tl.distributed.gather(log, dst=0, timeout=timeout)
    except tl.distributed.RankFailedError as exc:
        return str(exc)
    return "gathered"


def extract_fsdp2_uneven(rank, world, out, n_batches):
    """A distributed extraction of an FSDP2 model from a stream of ``n_batches``, shared batch by batch: with a
    count that is not a multiple of the world size, one rank has a forward more than another."""
    from torch.distributed.fsdp import fully_shard

    import torchlens as tl

    model = KilledAfter(0).eval()
    for module in (model.inner.fc1, model.inner.fc2, model):
        fully_shard(module)
    batches = [rows for (rows,) in torch.utils.data.DataLoader(dataset(4 * n_batches), batch_size=4)]
    try:
        tl.extract(model, batches, LAYERS, out, progress=False)
    except ValueError as exc:
        return {"error": str(exc), "forwards": model.forwards}
    return {"error": None, "forwards": model.forwards}


def rerun_joined(rank, world, out, round_robin, n, batch_size):
    """Calls into joined extractions: the same calls (which return at once), then other ones (refused)."""
    from torch.utils.data import DataLoader, DistributedSampler

    import torchlens as tl

    ds = dataset(n)
    loader = DataLoader(ds, batch_size=batch_size, sampler=DistributedSampler(ds, shuffle=False))
    batches = [{"x": ds.tensors[0][i:i + batch_size]} for i in range(0, n, batch_size)]
    got = {}
    calls = (("same", LAYERS, 0, loader, out), ("other layers", LAYERS[:1], 0, loader, out),
             ("other weights", LAYERS, 1, loader, out), ("same stream", LAYERS, 0, batches, round_robin))
    for name, layers, nudge, inputs, folder in calls:
        model = KilledAfter(0).eval()
        with torch.no_grad():
            model.inner.fc1.bias += nudge
        try:
            tl.extract(model, inputs, layers, folder, args_of=None if inputs is batches else lambda b: b[0],
                       kwargs_of=dict if inputs is batches else None, shard_bytes=200, progress=False)
            got[name] = model.forwards
        except tl.io.ResumeMismatchError as exc:
            got[name] = str(exc)
    return got


def extract_with_slow_ranks(rank, world, workdir, *runs):
    """``extract_with_a_slow_rank`` for each ``(slow_rank, delay, barrier_timeout)`` of ``runs`` in turn, each into
    a folder of its own: what each rank got from each."""
    return [extract_with_a_slow_rank(rank, world, os.path.join(workdir, f"slow-{i}"), *run)
            for i, run in enumerate(runs)]


def extract_with_a_slow_rank(rank, world, out, slow_rank, delay, barrier_timeout, calls=True):
    """A distributed extraction whose ``slow_rank`` sleeps ``delay`` seconds in its first forward (or, with
    ``calls=False``, never calls tl.extract): what each rank gets."""
    from torch.utils.data import DataLoader, DistributedSampler

    import torchlens as tl

    class Slow(KilledAfter):
        def forward(self, x):
            if rank == slow_rank and self.forwards == 0:
                time.sleep(delay)
            return super().forward(x)

    if rank == slow_rank and not calls:
        return None
    ds = dataset(16)
    loader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=False))
    try:
        tl.extract(Slow(0).eval(), loader, LAYERS, out, args_of=lambda b: b[0], progress=False,
                   barrier_timeout=barrier_timeout)
    except tl.distributed.RankFailedError as exc:
        return str(exc)
    return "extracted"


def extract_streams(rank, world, out, batch_dim):
    """This rank's share of batches of 2 of test_extract_batch_dim's two-stream model, shared batch by batch."""
    import torchlens as tl
    from test_extract_batch_dim import AltUp, rows

    tl.extract(AltUp().eval(), rows([2, 2, 2, 2]), ["streams"], out, batch_dim=batch_dim, progress=False)
    return "extracted"


def extract_batch_sampled(rank, world, out, n, batch_size):
    """This rank's part of a distributed extraction from a DataLoader given ``batch_sampler=`` batching a shuffling
    DistributedSampler (the loader's own ``sampler`` is then a default one)."""
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

    import torchlens as tl

    ds = dataset(n)
    batches = BatchSampler(DistributedSampler(ds, shuffle=True, seed=5), batch_size, drop_last=False)
    tl.extract(KilledAfter(0).eval(), DataLoader(ds, batch_sampler=batches), LAYERS, out, args_of=lambda b: b[0],
               progress=False)
    return "extracted"
