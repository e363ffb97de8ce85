"""Where the 3-layer MLP row's cost beyond the fit goes: its forward written four ways, traced side by side.

The fit (``overhead_fit.py``) predicts a trace's added time from its ops and module calls; the 3-layer
MLP costs more than that.  This times the same three ``Linear(64, 64)`` layers, batch 32, with the
forward as written in ``models.MLP`` (a ``ModuleList`` slice and ``F.relu``), indexing the list instead
of slicing it, ``torch.relu`` in place of ``F.relu`` as well, and the three ``Linear`` calls alone.  Per
variant: the added microseconds per call of a bare mode, the minimal recorder, and ``tl.trace`` with
save="all" and save="none" over the untraced forward (ABBA quartets, ``overhead_fit.abba_added_us``,
median of the repeats).  Run:

    python benchmarks/mlp3_variants.py [--repeats 5]
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
from models import bare_arm, native_arm, recorder_arm, trace_arm  # noqa: E402
from overhead_fit import abba_added_us  # noqa: E402


class Variant(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
        self.how = how

    def forward(self, x):
        layers = self.layers
        if self.how == "as written":
            for layer in layers[:-1]:
                x = F.relu(layer(x))
            return layers[-1](x)
        if self.how == "indexed":
            return layers[2](F.relu(layers[1](F.relu(layers[0](x)))))
        if self.how == "indexed, torch.relu":
            return layers[2](torch.relu(layers[1](torch.relu(layers[0](x)))))
        return layers[2](layers[1](layers[0](x)))  # "Linear calls alone"


VARIANTS = ("as written", "indexed", "indexed, torch.relu", "Linear calls alone")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    print("| forward | bare | recorder | trace all | trace none | trace all over recorder |")
    print("|---|---|---|---|---|---|")
    for how in VARIANTS:
        model = Variant(how).eval()
        native = native_arm(model, (x,))
        arms = {"bare": bare_arm(model, (x,)), "recorder": recorder_arm(model, (x,)),
                "all": trace_arm(model, (x,), save="all"), "none": trace_arm(model, (x,), save="none")}
        added = {name: statistics.median(abba_added_us(native, arm, 200)[1] for _ in range(opts.repeats))
                 for name, arm in arms.items()}
        print(f"| {how} | {added['bare']:.1f} | {added['recorder']:.1f} | {added['all']:.1f} | {added['none']:.1f} "
              f"| {added['all'] - added['recorder']:.1f} |", flush=True)
    print(f"\nAdded us per call over the untraced forward, medians of {opts.repeats} repeats; "
          f"torch {torch.__version__}, 1 torch thread.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
