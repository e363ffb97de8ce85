"""What ``grads=True`` adds to one traced forward+backward, in microseconds per trace, against another revision.

On one small model (the 3-layer MLP of ``models.py`` by default, where gradient capture's fixed cost
per trace dominates its cost per op), four arms run interleaved in rounds in one process: this tree's
``tl.trace(model, x, save="none", grads=G)`` followed by ``log.backward(out.sum())`` (``G=True``) or
``out.sum().backward()`` (``G=False``), and the same with the revision at ``--baseline`` (its own
compiled modules where built beside it, see ``models.baseline_package``).  Each arm keeps the median
of ``--block`` runs per round; the table gives the medians over rounds of each arm and of what
``grads=True`` adds (the ``G=True`` arm less the ``G=False`` arm of the same round), per trace and per op.

The two packages do not share one position: on a loaded machine the one given as ``--baseline`` has
measured a few us faster per trace than the same code imported as ``torchlens``.  Run it both ways (the
other revision on ``PYTHONPATH`` and this tree as ``--baseline``) and read the two together.

Run:  python benchmarks/grad_fixed_cost.py --baseline OTHER/src/torchlens [--model mlp3] [--rounds 31]
      [--paths both]   (both: also on the pure-Python path, ``accel.use(False)``)
      [--input-no-grad]   (the input does not require grad: no leaf hook)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import baseline_package, build  # noqa: E402


def _arm(tl, model, x, grads: bool, compiled: bool):
    """One traced forward+backward with package ``tl``; parameters' ``.grad`` reset first."""
    accel = sys.modules[tl.__name__ + ".capture.accel"]
    params = list(model.parameters())

    def run():
        for p in params:
            p.grad = None
        x.grad = None
        previous = accel.use(compiled)
        try:
            log = tl.trace(model, x, save="none", grads=grads)
        finally:
            accel.use(previous)
        out = log.output
        if grads:
            log.backward(out.sum())
        else:
            out.sum().backward()
    return run


def _block(fn, n: int) -> float:
    """Median ns of ``n`` runs of ``fn``."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times)


def measure(packages: dict, model, x, rounds: int, block: int, paths) -> dict:
    arms = {(rev, path, g): _arm(tl, model, x, g, path == "compiled")
            for rev, tl in packages.items() for path in paths for g in (False, True)}
    for fn in arms.values():  # warm up every arm
        for _ in range(20):
            fn()
    samples = {key: [] for key in arms}
    keys = list(arms)
    for r in range(rounds):
        for key in (keys if r % 2 == 0 else keys[::-1]):  # alternate the order: no arm always first
            samples[key].append(_block(arms[key], block))
    return samples


def table(samples: dict, ops: int, packages, paths) -> str:
    lines = ["| revision | path | trace+backward us | grads=True us | grads=True adds us/trace | adds us/op |",
             "|---|---|---|---|---|---|"]
    for rev in packages:
        for path in paths:
            off, on = samples[(rev, path, False)], samples[(rev, path, True)]
            added = statistics.median(b - a for a, b in zip(off, on)) / 1e3
            lines.append(f"| {rev} | {path} | {statistics.median(off) / 1e3:.1f} | {statistics.median(on) / 1e3:.1f} "
                         f"| {added:.1f} | {added / ops:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="another revision's src/torchlens directory")
    parser.add_argument("--model", default="mlp3")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--block", type=int, default=25, help="runs per arm per round (their median is kept)")
    parser.add_argument("--input-no-grad", action="store_true", help="the input does not require grad")
    parser.add_argument("--paths", choices=("compiled", "both"), default="compiled")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    import torchlens

    packages = {"this tree": torchlens}
    if opts.baseline:
        packages["baseline"] = baseline_package(os.path.abspath(opts.baseline))
    paths = ("compiled", "python") if opts.paths == "both" else ("compiled",)
    model, args = build(opts.model)
    model.train(False)
    x = args[0].clone().requires_grad_(not opts.input_no_grad)  # as grad_overhead.py: the input's gradient too
    ops = sum(1 for op in torchlens.trace(model, x, save="none") if op.kind == "op")
    samples = measure(packages, model, x, opts.rounds, opts.block, paths)
    print(f"{opts.model}: {ops} ops; medians over {opts.rounds} rounds of {opts.block} runs per arm")
    print(table(samples, ops, packages, paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
