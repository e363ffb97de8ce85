"""The capture handler's added cost per op, one kind of op at a time, beside the recorder floor.

``handler_forward.py`` times whole models; this isolates the shapes of call the compiled handler
(``accel/src/torchlens_accel/_capture.c``) decides differently: one op (an elementwise op, a call with
Parameters, a Python-level torch function, a list of tensors in, several tensors or a structseq out, a
normalisation reading buffers, ...) repeated 50 times in one forward.  Each arm runs that forward under
capture alone (``handler_forward.capture_arm``: the mode and the module hooks, no finalize) and is timed
against the untraced forward in ABBA quartets (``overhead_fit.abba_added_us``); the table gives the added
microseconds per op, medians over repeats, for the minimal recorder mode (the floor), the compiled
handler saving everything and saving nothing, and the pure-Python handler saving everything.  It needs
torchlens-accel built.  Run it from a source tree (another revision's tree measures that revision: the
torchlens imported is the one on ``PYTHONPATH``):

    PYTHONPATH=src:accel/src python benchmarks/handler_by_op.py [--repeats 5] [--ops add,torch.cat list]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from handler_forward import added_per_op, capture_arm, machine_line  # noqa: E402
from models import native_arm, recorder_arm  # noqa: E402
from overhead_fit import quartiles  # noqa: E402

REPEATS_PER_FORWARD = 50
_MASK = torch.ones(4, 16, dtype=torch.bool)  # a tensor no op made: read as unattributed

# name -> the op (one recorded op per call), called with the model (its Linear, LayerNorm, eval BatchNorm,
# and a Parameter and a buffer shaped like the input) and the input (4, 16).
OPS = {
    "add": lambda m, x: x + 1,
    "relu": lambda m, x: torch.relu(x),
    "F.linear params": lambda m, x: F.linear(x, m.lin.weight, m.lin.bias),
    "F.layer_norm (python fn)": lambda m, x: F.layer_norm(x, (16,), m.ln.weight, m.ln.bias),
    "torch.layer_norm": lambda m, x: torch.layer_norm(x, (16,), m.ln.weight, m.ln.bias),
    "view": lambda m, x: x.view(2, 32),
    "transpose": lambda m, x: x.transpose(0, 1),
    "split (tuple out)": lambda m, x: x.split(8, dim=1),
    "torch.cat list": lambda m, x: torch.cat([x, x], 1),
    "torch.stack tuple (param & buffer)": lambda m, x: torch.stack((x, m.weight, m.stat)),
    "where": lambda m, x: torch.where(_MASK, x, 0.0),
    "softmax": lambda m, x: x.softmax(-1),
    "matmul": lambda m, x: x @ m.lin.weight,
    "max(dim) structseq": lambda m, x: x.max(1),
    "topk structseq": lambda m, x: torch.topk(x, 2),
    "batch_norm buffers": lambda m, x: F.batch_norm(x, m.bn.running_mean, m.bn.running_var, m.bn.weight, m.bn.bias),
    "x.shape[0] size": lambda m, x: x.size(0),
}


class Repeated(nn.Module):
    """One op, ``REPEATS_PER_FORWARD`` times per forward."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.lin = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.bn = nn.BatchNorm1d(16)
        self.weight = nn.Parameter(torch.randn(4, 16))
        self.register_buffer("stat", torch.randn(4, 16))

    def forward(self, x):
        for _ in range(REPEATS_PER_FORWARD):
            y = self.op(self, x)
        return y


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ops", help="comma-separated names of OPS (default: all)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    import torchlens

    names = opts.ops.split(",") if opts.ops else list(OPS)
    titles = ["recorder floor", "compiled, save all", "compiled, save none", "pure, save all"]
    lines = ["| op | " + " | ".join(f"{t} +us/op" for t in titles) + " |", "|---" * (1 + len(titles)) + "|"]
    print(f"torchlens from {os.path.dirname(torchlens.__file__)}", flush=True)
    for name in names:
        model, args = Repeated(OPS[name]).eval(), (torch.randn(4, 16),)
        arms = [recorder_arm(model, args), capture_arm(torchlens, model, args, 1, True),
                capture_arm(torchlens, model, args, 0, True), capture_arm(torchlens, model, args, 1, False)]
        added = added_per_op(native_arm(model, args), arms, opts.repeats, REPEATS_PER_FORWARD)
        lines.append(f"| {name} | " + " | ".join(f"{quartiles(v)[1]:.2f}" for v in added) + " |")
        print(lines[-1], flush=True)
    lines += ["", f"Medians of {opts.repeats} repeats. {machine_line()}"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
