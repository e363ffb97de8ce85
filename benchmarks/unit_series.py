"""What each op and module call of a trace costs, unit by unit: traces of 1 to 20 identical units.

The fit (``overhead_fit.py``) gives one cost per op and one per module call over every row; its module
call cost comes mostly from stacks of ``nn.Identity``, which run no op.  This traces a forward made of
``n`` copies of one unit, for n = 1, 2, 3, 5, 10, 20, and prints tl.trace's added microseconds per trace
over the untraced forward (ABBA quartets, ``overhead_fit.abba_added_us``, median of the repeats) with
the increment per unit between sizes.  The units:

- ``identity``: an ``nn.Identity`` call (a module call, no op);
- ``inline``: ``x * 2`` in the model's own forward (an op, no module call);
- ``op in module``: a module whose forward is ``x * 2`` (a module call with one op inside);
- ``F.relu`` / ``torch.relu``: the same op reached through torch's Python dispatcher
  (``handle_torch_function``) or straight from C, in the model's forward;
- ``F.linear``: ``F.linear(x, weight, bias)`` of a ``Linear``'s parameters, in the model's forward;
- ``Linear``: an ``nn.Linear`` call.

The size-1 column less the increments is what the first unit costs beyond the later ones.  Run:

    python benchmarks/unit_series.py [--repeats 5] [--units identity,inline,...]
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
from models import native_arm, trace_arm  # noqa: E402
from overhead_fit import abba_added_us  # noqa: E402

SIZES = (1, 2, 3, 5, 10, 20)
UNITS = ("identity", "inline", "F.relu", "torch.relu", "op in module", "F.linear", "Linear")


class Doubling(nn.Module):
    def forward(self, x):
        return x * 2


class Series(nn.Module):
    """``n`` copies of one unit in a row."""

    def __init__(self, unit: str, n: int):
        super().__init__()
        torch.manual_seed(0)
        self.unit = unit
        made = {"identity": nn.Identity, "inline": nn.Identity, "F.relu": nn.Identity,
                "torch.relu": nn.Identity, "op in module": Doubling,
                "F.linear": lambda: nn.Linear(64, 64), "Linear": lambda: nn.Linear(64, 64)}[unit]
        self.units = nn.ModuleList(made() for _ in range(n))

    def forward(self, x):
        for unit in self.units:
            if self.unit == "inline":
                x = x * 2
            elif self.unit == "F.relu":
                x = F.relu(x)
            elif self.unit == "torch.relu":
                x = torch.relu(x)
            elif self.unit == "F.linear":
                x = F.linear(x, unit.weight, unit.bias)
            else:
                x = unit(x)
        return x


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--units", default=",".join(UNITS), help="comma-separated subset")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    steps = list(zip(SIZES, SIZES[1:]))
    print("| unit | " + " | ".join(f"n={n}" for n in SIZES) + " | " +
          " | ".join(f"per unit {a}->{b}" for a, b in steps) + " |")
    print("|---" * (1 + len(SIZES) + len(steps)) + "|")
    for unit in opts.units.split(","):
        added = []
        for n in SIZES:
            model = Series(unit, n).eval()
            native, traced = native_arm(model, (x,)), trace_arm(model, (x,))
            added.append(statistics.median(abba_added_us(native, traced, 100)[1] for _ in range(opts.repeats)))
        by_size = dict(zip(SIZES, added))
        increments = [(by_size[b] - by_size[a]) / (b - a) for a, b in steps]
        print(f"| {unit} | " + " | ".join(f"{v:.1f}" for v in added) + " | " +
              " | ".join(f"{v:.1f}" for v in increments) + " |", flush=True)
    print(f"\nAdded us per trace over the untraced forward (save=\"all\"), medians of {opts.repeats} repeats; "
          f"torch {torch.__version__}, 1 torch thread.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
