"""What building the record costs: ``record.finalize`` timed alone, per trace and per op.

``tl.trace`` runs the forward, then ``finalize`` turns the raw tuples capture appended into a ``Trace``.
Here each row is traced once with finalize intercepted, so the captured state, model, output and model
index are kept; then that very finalize call is repeated on them, with the collector paused as
``tl.trace`` pauses it.  With ``--baseline PATH`` another revision's package (``models.baseline_package``)
captures and finalizes its own state in the same process, timed in alternating blocks, so the two are
compared side by side.  The per-row medians are fitted as ``fixed + per_op * ops + per_call * module
calls`` over the rows
(weighted by each row's time, like ``overhead_fit.py``).  Target (issue: capture at the floor):
finalize at most 2 us per op.  Run:

    python benchmarks/finalize_cost.py [--rows chain8,chain200,...] [--baseline /path/to/src/torchlens]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import baseline_package  # noqa: E402
from overhead_fit import ROWS, fit, quartiles  # noqa: E402

BLOCK_S = 0.002  # target length of one timed block


class OneOp(nn.Module):
    """A single torch call: what finalize costs when there is almost nothing to build."""

    def forward(self, x):
        return torch.sin(x)


EXTRA_ROWS = {"one_op": (OneOp, lambda g: (torch.randn(64, generator=g),))}


def build(name: str):
    builder, inputs = EXTRA_ROWS.get(name) or ROWS[name]
    torch.manual_seed(0)
    return builder().eval(), inputs(torch.Generator().manual_seed(1))


def captured_finalize(package, model, args):
    """Zero-argument callables repeating the finalize of one trace of ``model`` by ``package`` (alone,
    and followed by the first read of every label and module call, which derives the columns a lazy
    finalize left for later), and the trace it made."""
    session = sys.modules[package.__name__ + ".capture.session"]
    real = session.finalize
    kept = {}

    def keep(*a, **k):
        kept["call"] = (a, k)
        return real(*a, **k)

    session.finalize = keep
    try:
        trace = package.trace(model, args, save="all")
    finally:
        session.finalize = real
    a, k = kept["call"]

    def again():
        return real(*a, **k)

    def read():  # what a reader first touches: every op's label and the module calls
        built = real(*a, **k)
        built.labels, built.module_calls
        return built

    return again, read, trace


def block_us(fn, n: int) -> float:
    collecting = gc.isenabled()
    gc.disable()  # as tl.trace runs finalize
    try:
        start = time.perf_counter_ns()
        for _ in range(n):
            fn()
        return (time.perf_counter_ns() - start) / n / 1e3
    finally:
        if collecting:
            gc.enable()


def measure(names: list, packages: dict, repeats: int) -> dict:
    """``{(package, row): [us per finalize, one per repeat]}`` (fastest block of each repeat) and op counts."""
    arms, ops = {}, {}
    for name in names:
        model, args = build(name)
        for label, package in packages.items():
            arms[(label, name)], arms[(label + " + read", name)], trace = captured_finalize(package, model, args)
            ops[name] = (sum(1 for k in trace.kinds if k == 0), len(trace.module_calls))
    sizes = {}
    for key, fn in arms.items():
        fn()
        sizes[key] = max(1, int(BLOCK_S * 1e6 / max(min(block_us(fn, 1) for _ in range(3)), 1.0)))
    times = {key: [] for key in arms}
    labels = list(dict.fromkeys(label for label, _ in arms))
    for r in range(repeats):
        for name in names:
            blocks = {label: [] for label in labels}
            for order in (labels, labels[::-1], labels, labels[::-1]):  # ABBA
                for label in order:
                    blocks[label].append(block_us(arms[(label, name)], sizes[(label, name)]))
            for label in labels:
                times[(label, name)].append(min(blocks[label]))
        print(f"  repeat {r + 1}/{repeats} done", flush=True)
    return {"times": times, "ops": ops, "labels": labels, "names": names, "repeats": repeats}


def report(result: dict) -> str:
    names, labels, ops, times = result["names"], result["labels"], result["ops"], result["times"]
    lines = ["| row | ops | module calls | " + " | ".join(f"{label} us (per op)" for label in labels)
             + (" | ratio | ratio + read" if len(labels) == 4 else "") + " |",
             "|---" * (3 + len(labels) + 2 * (len(labels) == 4)) + "|"]
    for name in names:
        medians = [statistics.median(times[(label, name)]) for label in labels]
        cells = [f"{m:.1f} ({m / max(ops[name][0], 1):.2f})" for m in medians]
        ratio = [f"{medians[0] / medians[2]:.2f}", f"{medians[1] / medians[3]:.2f}"] if len(labels) == 4 else []
        lines.append(f"| {name} | {ops[name][0]} | {ops[name][1]} | " + " | ".join(cells + ratio) + " |")
    lines += ["", "| package | fixed us | per op us | per module call us |", "|---|---|---|---|"]
    for label in labels:
        fits = []
        for r in range(result["repeats"]):
            ys = [times[(label, n)][r] for n in names]
            fits.append(fit([ops[n] for n in names], ys, ys))
        cells = []
        for k in range(3):
            q1, q2, q3 = quartiles([f[k] for f in fits])
            cells.append(f"{q2:.1f} [{q1:.1f}, {q3:.1f}]")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"Fastest block per repeat, medians over {result['repeats']} repeats (fit: medians "
              f"[quartiles]); torch {torch.__version__}, {torch.get_num_threads()} thread(s), load "
              f"{tuple(round(v, 2) for v in os.getloadavg())}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="one_op,chain8,chain50,chain200,identity100,mlp3,mlp40,gpt2_2,resnet")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", default=None, help="another revision's src/torchlens, finalized beside")
    options = parser.parse_args()
    torch.set_num_threads(1)
    import torchlens

    packages = {"this": torchlens}
    if options.baseline:
        packages["baseline"] = baseline_package(options.baseline)
    result = measure(options.rows.split(","), packages, options.repeats)
    print(report(result))


if __name__ == "__main__":
    main()
