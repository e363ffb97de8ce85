"""Growth of every user-facing step with model size: each step timed on a model of n blocks and of 4n.

A step whose work is linear in the trace takes about 4x as long on the larger model; one that grows much
faster (the default flag is above 6x) has a quadratic part, which cProfile on the two sizes finds.  Blocks
are ``tanh(fc(x)) + x`` (three ops and two module calls each), so n blocks make about 3n ops, 2n module calls
and 2n parameters.  The steps that take sites or layers take one per block: a module call site per block, a
saved module per block, an extracted layer per block.

Each step is timed with the cycle collector off (its full passes over a large heap are not the step's own
work), and the median of ``--repeat`` runs is kept.  On a shared machine read the ratios, not the times.

Run:  .venv/bin/python benchmarks/scale_steps.py [--blocks N] [--repeat K] [--flag RATIO]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import torch
import torch.nn as nn

import torchlens as tl


class Block(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + x


class Blocks(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def steps(model, x, folder: str) -> dict:
    """``{step name: zero-argument callable}`` for one model; the traces they read are made here."""
    n = len(model.blocks)
    log = tl.trace(model, x, grads=True)
    log.output.sum().backward()
    labels = list(log.op_labels)
    tanh_labels = [op.label for op in log.ops if op.type == "tanh"]
    blocks = [f"blocks.{i}" for i in range(n)]
    call_sites = {f"blocks.{i}:1": tl.scale(1.0) for i in range(n)}
    return {
        "trace save=all": lambda: tl.trace(model, x),
        "trace save=none": lambda: tl.trace(model, x, save="none"),
        "trace grads=True": lambda: tl.trace(model, x, grads=True),
        "first read of ops, layers, calls": lambda: _first_reads(tl.trace(model, x, save="none")),
        "log[label] for every op": lambda: [log[label] for label in labels],
        "str(log), summary()": lambda: (str(log), str(log.summary())),
        "to_pandas()": log.to_pandas,
        "render .dot": lambda: log.render(f"{folder}/model.dot"),
        "render .dot rolled": lambda: log.render(f"{folder}/rolled.dot", view="rolled"),
        "save + load": lambda: tl.load(log.save(f"{folder}/trace", overwrite=True)),
        "validate()": log.validate,
        "every op's and param's grad": lambda: ([op.grad for op in log.ops if op.has_grad],
                                               [p.grad for p in log.params]),
        "save= a module per block": lambda: tl.trace(model, x, save=blocks),
        "a module call site per block": lambda: tl.trace(model, x, save="none", intervene=call_sites),
        "extract a layer per block": lambda: tl.extract(model, [x], layers=tanh_labels, out=f"{folder}/extract",
                                                        progress=False),
        "flops_vs_dispatch": lambda: tl.report.flops_vs_dispatch(model, x),
    }


def _first_reads(log) -> None:
    len(log), log.ops, log.layers, log.module_calls, log.modules


def timed(step, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=500, help="blocks of the smaller model (the larger has 4x)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per step and size; the median is kept")
    parser.add_argument("--flag", type=float, default=6.0, help="flag a step whose time grows more than this")
    args = parser.parse_args()
    torch.manual_seed(0)
    sizes = (args.blocks, 4 * args.blocks)
    with tempfile.TemporaryDirectory() as folder:  # imports and first-call caches do not count against n
        for step in steps(Blocks(4), torch.randn(2, 8), folder).values():
            step()
    results: dict = {}
    for n in sizes:
        model, x = Blocks(n), torch.randn(2, 8)
        with tempfile.TemporaryDirectory() as folder:
            for name, step in steps(model, x, folder).items():
                results.setdefault(name, []).append(timed(step, args.repeat))
    print(f"{'step':<36}{sizes[0]:>9} blocks{sizes[1]:>9} blocks{'growth':>9}")
    for name, (small, large) in results.items():
        growth = large / small
        flag = "  <- faster than linear" if growth > args.flag else ""
        print(f"{name:<36}{small * 1e3:>13.1f} ms{large * 1e3:>13.1f} ms{growth:>8.1f}x{flag}")


if __name__ == "__main__":
    main()
