"""Growth of the steps a user takes with a finished trace, counted in Python function calls, over model shapes.

``scale_steps.py`` times each step on one shape (a chain of distinct blocks); on a loaded machine its ratios
move by more than a quadratic part would add.  Here each step's work is counted instead: the Python function
calls ``cProfile`` sees while it runs, with the cycle collector off (a full collection, and what the trace's
collector callback does in it, is Python's scheduling, not the step's work).  The count is the same from
run to run, so a step whose count grows more than 4x when the trace grows 4x has a part that is not linear.
Work done inside one C call (``list.index``, a ``sorted``) is not counted: confirm a flat count with the
timings of ``scale_steps.py`` at the same sizes.

Shapes, each ``tanh(fc(x)) + x`` blocks (three ops, two module calls each):

    chain      n distinct blocks in an ``nn.Sequential``: every op its own layer
    loop       one block applied n times: three layers of n passes, one module called n times
    branches   n blocks applied to the same input, stacked and summed: one op with n children, one with
               n parents

Run:  .venv/bin/python benchmarks/scale_calls.py [--blocks N] [--shapes chain,loop,branches] [--flag RATIO]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import tempfile

import torch
import torch.nn as nn

import torchlens as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_steps import Block  # noqa: E402  (one block for both scale benchmarks)


class Chain(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(n)))

    def forward(self, x):
        return self.blocks(x)


class Loop(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.n, self.block = n, Block()

    def forward(self, x):
        for _ in range(self.n):
            x = self.block(x)
        return x


class Branches(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.branches = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        return torch.stack([branch(x) for branch in self.branches]).sum(0)


SHAPES = {"chain": Chain, "loop": Loop, "branches": Branches}


def steps(model, x, folder: str) -> dict:
    """``{step name: zero-argument callable}``; the traces they read are made (and first read) here."""
    log = tl.trace(model, x)
    _first_reads(log)
    grad_log = tl.trace(model, x, grads=True)
    grad_log.output.sum().backward()
    labels = list(log.op_labels)
    middle = labels[len(labels) // 2]
    return {
        "trace": lambda: tl.trace(model, x),
        "first read of ops, layers, calls": lambda: _first_reads(tl.trace(model, x, save="none")),
        "str(log), summary(), depth=1": lambda: (str(log), str(log.summary()), str(log.summary(depth=1))),
        "to_pandas of ops, layers, calls": lambda: (log.to_pandas(), log.layers.to_pandas(),
                                                    log.module_calls.to_pandas()),
        "log[label] for every op": lambda: [log[label] for label in labels],
        "parents, children of every op": lambda: [(op.parents, op.children) for op in log.ops],
        "passes, call ops, module calls": lambda: ([layer.ops for layer in log.layers],
                                                   [call.ops for call in log.module_calls],
                                                   [module.calls for module in log.modules]),
        "validate()": lambda: log.validate(progress=False),
        "save + load": lambda: tl.load(log.save(f"{folder}/trace", overwrite=True)),
        "hot_path, every group": lambda: [str(tl.debug.hot_path(log, group=g))
                                          for g in ("op", "layer", "module", "source")],
        "nonfinite_origin, flops": lambda: (tl.debug.nonfinite_origin(log), log.flops),
        "every op's grad, grad hot_path": lambda: ([op.grad for op in grad_log.ops if op.has_grad],
                                                   str(tl.debug.hot_path(grad_log, by="grad_norm"))),
        "intervene at one site": lambda: tl.trace(model, x, save="none", reference=log,
                                                  intervene={middle: tl.scale(1.0)}),
        "intervene at every op": lambda: tl.trace(model, x, save="none",
                                                  intervene={(lambda op: True): tl.scale(1.0)}),
        "chrome trace": lambda: log.to_chrome_trace(f"{folder}/chrome.json"),
    }


def _first_reads(log) -> None:
    len(log), log.ops, log.labels, log.layers, log.module_calls, log.modules


def counted(step) -> int:
    """Python function calls made by ``step()``, with the cycle collector off."""
    gc.collect()
    gc.disable()
    profile = cProfile.Profile()
    try:
        profile.enable()
        step()
        profile.disable()
    finally:
        gc.enable()
    return pstats.Stats(profile).total_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=330, help="blocks of the smallest model (then 4x, 16x)")
    parser.add_argument("--shapes", default="chain,loop,branches", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--flag", type=float, default=4.4, help="flag a step whose count grows more than this")
    args = parser.parse_args()
    sizes = (args.blocks, 4 * args.blocks, 16 * args.blocks)
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as folder:  # imports and first-call caches do not count against n
            for step in steps(SHAPES[shape](2), torch.randn(2, 8), folder).values():
                step()
        results: dict = {}
        for n in sizes:
            torch.manual_seed(0)
            with tempfile.TemporaryDirectory() as folder:
                for name, step in steps(SHAPES[shape](n), torch.randn(2, 8), folder).items():
                    results.setdefault(name, []).append(counted(step))
        print(f"\n{shape}: {'  '.join(f'{n} blocks' for n in sizes)}  (Python calls; growth per 4x)")
        for name, counts in results.items():
            growths = [large / small for small, large in zip(counts, counts[1:])]
            flag = "  <- faster than linear" if max(growths) > args.flag else ""
            print(f"  {name:<34}" + "".join(f"{c:>12,}" for c in counts)
                  + "".join(f"{g:>7.1f}x" for g in growths) + flag)


if __name__ == "__main__":
    main()
