"""Rendering the HTML view with SVG pictures laid out in batches, against one Graphviz process per picture.

The viewer lays out one picture per module call and one for the whole forward.  ``viz.layout.layout``
hands each worker's share of the pictures to one ``dot`` process; the other arm starts a process per
picture, as the viewer did before.  Both arms render the same trace (a chain of ``Linear`` calls, each
its own picture), alternating, and the figure is the ratio of their medians.  Run:

    python benchmarks/layout_batches.py [--calls 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn

import torchlens as tl
from torchlens.viz import html, layout


class Chain(nn.Module):
    def __init__(self, calls: int):
        super().__init__()
        self.calls = calls
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(10))

    def forward(self, x):
        for i in range(self.calls):
            x = self.layers[i % 10](x).relu() + 1
        return x


def one_process_per_picture(dot_texts, fmt="svg", engine=None):
    engine = engine or layout.find_engine()
    texts = list(dot_texts)
    with ThreadPoolExecutor(max_workers=max(1, min(len(texts), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda text: layout._run(engine, text, fmt), texts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    with torch.no_grad():
        log = tl.trace(Chain(options.calls), torch.randn(2, 8))
    arms = {"batched": layout.layout, "one process each": one_process_per_picture}
    seconds: dict = {name: [] for name in arms}
    try:
        for _ in range(options.repeats):
            for name, arm in arms.items():
                html.layout = arm
                start = time.perf_counter()
                log.render(tempfile.mkdtemp() + "/graph.html")
                seconds[name].append(time.perf_counter() - start)
    finally:
        html.layout = layout.layout
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"{len(log)} ops, {options.calls} module calls; render seconds, median of {options.repeats}:")
    for name, median in medians.items():
        print(f"  {name:>17}: {median:.2f}  ({', '.join(f'{s:.2f}' for s in seconds[name])})")
    print(f"  one process each / batched: {medians['one process each'] / medians['batched']:.2f}x")


if __name__ == "__main__":
    main()
