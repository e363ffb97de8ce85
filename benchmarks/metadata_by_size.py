"""What ``tl.trace(save="none")`` adds over a bare mode, per op, as the tensors grow.

The matrix (``overhead_matrix.py``) shows the metadata tier's added time growing with the input size on the
rows whose ops take Parameters, where a trace does no more work per op at one size than at another.  This
isolates it: 20 calls in a row of one kind (``F.linear`` with Parameters, ``nn.Linear`` modules, ``torch.sin``,
``x + 1``), at batch 32 and 256 of width 256, each timed against the untraced forward in ABBA quartets
(``overhead_fit.abba_added_us``) beside a bare no-op mode.  Per row: the bare mode's and the trace's added
microseconds per op, and their difference, medians over repeats.  Run:

    python benchmarks/metadata_by_size.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from handler_forward import machine_line  # noqa: E402
from models import bare_arm, native_arm, trace_arm  # noqa: E402
from overhead_fit import abba_added_us  # noqa: E402

CALLS = 20
WIDTH = 256


class Repeated(nn.Module):
    """``CALLS`` calls of one kind, each on the previous one's output."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH ** 0.5)
        self.bias = nn.Parameter(torch.randn(WIDTH))
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(CALLS)) if kind == "nn.Linear" else None

    def forward(self, x):
        if self.layers is not None:
            for layer in self.layers:
                x = layer(x)
            return x
        for _ in range(CALLS):
            if self.kind == "F.linear":
                x = F.linear(x, self.weight, self.bias)
            elif self.kind == "torch.sin":
                x = torch.sin(x)
            else:
                x = x + 1
        return x


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", default="32,256")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batches = [int(b) for b in options.batches.split(",")]
    kinds = ("F.linear", "nn.Linear", "torch.sin", "x + 1")
    added: dict = {}
    for _ in range(options.repeats):
        for kind in kinds:
            model = Repeated(kind).eval()
            for batch in batches:
                args = (torch.randn(batch, WIDTH),)
                with torch.no_grad():
                    for arm, fn in (("bare", bare_arm(model, args)), ("none", trace_arm(model, args, save="none"))):
                        _, us = abba_added_us(native_arm(model, args), fn, 20)
                        added.setdefault((kind, batch, arm), []).append(us / CALLS)
    print("| calls | batch | bare mode +us/op | trace(save=\"none\") +us/op | difference us/op |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        for batch in batches:
            bare = statistics.median(added[(kind, batch, "bare")])
            none = statistics.median(added[(kind, batch, "none")])
            print(f"| {kind} x{CALLS} | {batch}x{WIDTH} | {bare:.2f} | {none:.2f} | {none - bare:.2f} |")
    print(f"\nMedians of {options.repeats} repeats; {machine_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
