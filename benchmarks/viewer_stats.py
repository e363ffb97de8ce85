"""What the HTML viewer's activation statistics cost on a realistic trace, this revision beside another.

The viewer embeds, per saved activation, its NaN/Inf counts and min/max/mean/std (``viz/records.py``'s
``activation_stats``); on a full-width model these reductions are most of ``log.render(format="html")``.
This traces transformers GPT-2 (12 layers, width 768, random weights, 64 tokens), then times the statistics
of every saved activation with this revision's function and, with ``--baseline``, another revision's,
in alternating order in one process, and checks both give the same statistics.  Run:

    python benchmarks/viewer_stats.py [--baseline DIR/src/torchlens] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import baseline_package  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.viz.records import activation_stats  # noqa: E402


def gpt2_activations() -> list:
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12)).eval()
    with torch.no_grad():
        log = tl.trace(model, torch.randint(0, 50257, (1, 64)))
    return [a for a in log.saved_activations.values() if a is not None]


def seconds(stats, activations) -> float:
    start = time.perf_counter()
    for a in activations:
        stats(a)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another revision's src/torchlens directory")
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    activations = gpt2_activations()
    arms = {"this": activation_stats}
    if opts.baseline:
        baseline = baseline_package(os.path.abspath(opts.baseline))
        import importlib

        arms["baseline"] = importlib.import_module(f"{baseline.__name__}.viz.records").activation_stats
        assert [arms["this"](a) for a in activations] == [arms["baseline"](a) for a in activations]
    times = {name: [] for name in arms}
    for r in range(opts.repeats):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for name in order:
            times[name].append(seconds(arms[name], activations))
    numel = sum(a.numel() for a in activations)
    print(f"{len(activations)} saved activations, {numel / 1e6:.1f} M values")
    for name, values in times.items():
        print(f"{name}: {statistics.median(values):.2f} s (median of {opts.repeats})")
    if "baseline" in times:
        ratios = sorted(a / b for a, b in zip(times["this"], times["baseline"]))
        print(f"this / baseline: {statistics.median(ratios):.2f} [{ratios[0]:.2f}, {ratios[-1]:.2f}] (median [range])")


if __name__ == "__main__":
    main()
