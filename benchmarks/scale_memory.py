"""Metadata memory per op of a 100,000-op trace that saves no activations.

Two model shapes, each about 100,000 ops traced with ``save="none"``:

    recurrent      50 residual blocks (linear, tanh, mul, add) applied for 500 rounds: few layers,
                   many passes, 25,000 module calls
    feed-forward   25,000 distinct blocks called once each: every op its own layer

For each it reports the Python heap the finished ``Trace`` retains (``tracemalloc``, measured with the
model and input already built, after a collection) divided by the number of ops, the peak heap while
tracing and finalizing, and the growth of the process's resident set.  Tensors are tiny (1 x 16), so the
figures are the trace's bookkeeping, not activation data.  Target: under 1 KiB retained per op.

Run:  .venv/bin/python benchmarks/scale_memory.py [--ops N] [--breakdown K]
"""

from __future__ import annotations

import argparse
import gc
import os
import tracemalloc

import torch
import torch.nn as nn

import torchlens as tl

TARGET_BYTES_PER_OP = 1024
OPS_PER_BLOCK = 4


class Block(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x)) * 0.5 + x


class Rounds(nn.Module):
    """``len(blocks) * rounds`` block calls: the same blocks again and again."""

    def __init__(self, n_blocks: int, rounds: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.rounds = rounds

    def forward(self, x):
        for _ in range(self.rounds):
            for block in self.blocks:
                x = block(x)
        return x


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model, x, breakdown: int = 0) -> dict:
    model(x)  # warm caches (dispatch, frame verdicts) so that they do not count as trace memory
    tl.trace(model, x, save="none")
    gc.collect()
    rss_before = resident_bytes()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    first = tracemalloc.take_snapshot() if breakdown else None
    log = tl.trace(model, x, save="none")
    gc.collect()
    retained, peak = tracemalloc.get_traced_memory()
    sites = tracemalloc.take_snapshot().compare_to(first, "lineno")[:breakdown] if breakdown else []
    tracemalloc.stop()
    rss_growth = resident_bytes() - rss_before
    n = len(log)
    del log
    return {"ops": n, "retained_per_op": (retained - base) / n, "peak_per_op": (peak - base) / n,
            "rss_growth_per_op": rss_growth / n,
            "sites": [(stat.size_diff / n, str(stat.traceback[0])) for stat in sites]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100_000, help="approximate ops per model")
    parser.add_argument("--breakdown", type=int, default=0, metavar="K",
                        help="also list the K source lines whose allocations the trace retains most")
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(1, 16)
    calls = max(args.ops // OPS_PER_BLOCK, 1)
    models = {"recurrent": Rounds(50, max(calls // 50, 1)), "feed-forward": Rounds(calls, 1)}
    print(f"{'model':<14}{'ops':>9}{'retained B/op':>15}{'peak B/op':>11}{'RSS growth B/op':>17}")
    worst = 0.0
    for name, model in models.items():
        with torch.no_grad():
            row = measure(model, x, args.breakdown)
        worst = max(worst, row["retained_per_op"])
        print(f"{name:<14}{row['ops']:>9}{row['retained_per_op']:>15.0f}{row['peak_per_op']:>11.0f}"
              f"{row['rss_growth_per_op']:>17.0f}")
        for per_op, site in row["sites"]:
            print(f"    {per_op:7.0f} B/op  {site}")
    verdict = "meets" if worst < TARGET_BYTES_PER_OP else "MISSES"
    print(f"worst retained metadata: {worst:.0f} B/op; {verdict} the {TARGET_BYTES_PER_OP} B/op target")


if __name__ == "__main__":
    main()
