"""Distributed extraction: two gloo ranks against one rank, same model, same data, same layers.

Each arm launches its ranks with ``torch.multiprocessing`` spawn on this host (a file store, gloo) and
times ``tl.extract`` inside the ranks, from the first batch to the joined, manifest-checked result (rank
0's join of every rank's rows in dataset order included); process start-up and imports are not timed.
The one-rank arm runs the same code in a one-process group, so the ratio isolates sharding (and the
join it needs), not the launcher.  Each rank uses ``torch.set_num_threads(cores // ranks)`` so the arms
get the same CPU: on a two-core machine the two-rank arm has one core per rank.  ``--threads-per-rank 1``
instead gives every rank one thread in both arms (the two-rank arm then uses twice the cores), which
separates the gain of sharding from the cost of intra-op threading on a busy machine.  Arms alternate
across repeats; medians are reported with the ratio.

Run:  .venv/bin/python benchmarks/distributed_extract.py [--samples 4096] [--batch-size 64] [--repeats 3]
      [--threads-per-rank N]
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import SmallResNet  # noqa: E402

LAYERS = ["stem", "blocks.1", "blocks.3", "head"]


def _rank(rank, world, store, out, samples, batch_size, threads, result):
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import torchlens as tl

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    data = TensorDataset(torch.randn(samples, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    loader = DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data, shuffle=False))
    torch.manual_seed(0)  # the same weights on every rank
    model = SmallResNet().eval()
    dist.barrier()
    start = time.perf_counter()
    tl.extract(model, loader, LAYERS, out, args_of=lambda b: b[0], progress=False)
    seconds = time.perf_counter() - start
    if rank == 0:
        rows = tl.load_extracted(out)["head"].shape[0]
        with open(result, "wb") as f:
            pickle.dump({"seconds": seconds, "rows": rows}, f)
    dist.destroy_process_group()


def run(world, samples, batch_size, workdir, threads_per_rank=None) -> float:
    import torch.multiprocessing as mp

    out = os.path.join(workdir, f"out-{world}")
    shutil.rmtree(out, ignore_errors=True)
    store, result = os.path.join(workdir, f"store-{time.time_ns()}"), os.path.join(workdir, "result.pkl")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world)
    mp.start_processes(_rank, args=(world, store, out, samples, batch_size, threads, result), nprocs=world,
                       start_method="spawn")
    got = pickle.load(open(result, "rb"))
    assert got["rows"] == samples, got
    return got["seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="intra-op threads of every rank (default: the cores split evenly between the ranks)")
    a = p.parse_args()
    times = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(a.repeats):
            for world in ((1, 2) if repeat % 2 == 0 else (2, 1)):
                times[world].append(run(world, a.samples, a.batch_size, workdir, a.threads_per_rank))
                print(f"repeat {repeat}: {world} rank(s) {times[world][-1]:.2f}s", flush=True)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    threads = a.threads_per_rank or "cores / ranks"
    print(f"\n{a.samples} samples, batch {a.batch_size}, layers {LAYERS}, {os.cpu_count()} cores, "
          f"threads per rank: {threads}")
    print(f"one rank : {one:.2f}s (median of {a.repeats})")
    print(f"two ranks: {two:.2f}s (median of {a.repeats})")
    print(f"two-rank time / one-rank time: {two / one:.2f}x (speed-up {one / two:.2f}x)")


if __name__ == "__main__":
    main()
