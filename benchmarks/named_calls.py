"""Cost of naming the raw call tuples (``record.columns.Call``) beside the trace they belong to.

The hot path appends plain tuples; ``Trace.calls`` names them once, on first read, so a trace nobody
reads per call pays nothing.  This measures, in one process and alternating, the median ``tl.trace``
time of an elementwise chain (the cheapest ops, so the largest share) and the median time of that
first read, and prints the ratio: what converting in finalize instead would add to every trace.
Run:  .venv/bin/python benchmarks/named_calls.py [--ops N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torchlens as tl
from torchlens.record.columns import Call


class Chain(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x):
        for _ in range(self.n):
            x = x * 1.0001 + 0.5
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="loop steps (two torch calls each)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    model, x = Chain(args.ops), torch.randn(8)
    trace_s, convert_s = [], []
    log = calls = None
    for _ in range(args.repeats):
        log = calls = None  # the previous trace is freed here, outside both timings
        t0 = time.perf_counter()
        log = tl.trace(model, x, save="none")
        t1 = time.perf_counter()
        calls = log.calls
        t2 = time.perf_counter()
        trace_s.append(t1 - t0)
        convert_s.append(t2 - t1)
        assert type(calls[0]) is Call
    raw = calls
    t, c = statistics.median(trace_s), statistics.median(convert_s)
    print(f"{len(raw)} calls: trace {t * 1e3:.2f} ms, naming {c * 1e3:.3f} ms "
          f"({c / len(raw) * 1e9:.0f} ns/call), {100 * c / t:.2f}% of the trace (medians of {args.repeats})")


if __name__ == "__main__":
    main()
