"""Instructions per ``tl.trace``, counted by callgrind: figures that do not move with the load of a shared
host, for comparing two revisions.

For each model and arm (the untraced forward, a bare ``TorchFunctionMode``, this revision's ``tl.trace``
with ``save="all"`` and ``save="none"`` and, with ``--baseline``, another revision's), a worker process
builds the model, runs the arm 40 times to warm up (every code object quickened, every cache filled), then
runs it ``--traces`` times inside one ``operator.call``: callgrind collects only inside that call
(``--collect-atstart=no --toggle-collect=_operator_call``), so import, model building and warm-up are not
counted, and the count over ``--traces`` is what one call executes.  The collector is frozen and disabled
before the counted calls, so that no collection lands among them, and the instructions of idle BLAS worker
threads (``blas_thread_server``, which spin for as long as they like) are left out.  What a trace adds is
its count less the untraced forward's.

Models: a row of ``models.py`` (``mlp3``, ``resnet``, ``gpt2``, ...), ``one-op`` (``x + 1``: a trace's
fixed cost), ``linears:N`` (N ``Linear(64, 64)`` calls in a row), or a prefix of a transformers model of ``transformers_overhead.py`` (``GPT-2``, ``BERT``),
called with its keyword inputs.  Needs valgrind (Debian's ``valgrind``); a worker takes one to four
minutes.  Run:

    python benchmarks/trace_instructions.py [--models one-op,mlp3,resnet,GPT-2,BERT]
        [--baseline /path/to/other/src/torchlens] [--traces 10] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

_HERE = os.path.dirname(os.path.abspath(__file__))
_IDLE = ("blas_thread_server",)  # worker threads of a BLAS library, spinning while idle
_WARM_UP = 40  # calls before counting: 3.11 quickens a code object on its 8th call


def _model(name: str):
    """``(model, args, kwargs)`` for a model name (see the module docstring)."""
    import torch

    sys.path.insert(0, _HERE)
    from models import MODELS, build

    if name == "one-op":
        class OneOp(torch.nn.Module):
            def forward(self, x):
                return x + 1

        return OneOp().eval(), (torch.randn(4),), {}
    if name.startswith("linears:"):  # n Linear(64, 64) calls in a row: what each further module call and op adds
        layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(int(name.split(":")[1])))

        class Linears(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = layers

            def forward(self, x):
                for layer in self.layers:
                    x = layer(x)
                return x

        return Linears().eval(), (torch.randn(8, 64),), {}
    if name in MODELS:
        model, args = build(name)
        return model, args, {}
    from transformers_overhead import _models

    return next(v for k, v in _models().items() if k.startswith(name))


def _worker(name: str, arm: str, baseline: str | None, count: int) -> None:
    """Warm up, then run ``arm`` of model ``name`` ``count`` times inside ``operator.call``."""
    import gc
    import operator

    import torch

    sys.path.insert(0, _HERE)
    from models import BareMode, baseline_package

    torch.set_num_threads(1)
    torch.backends.mha.set_fastpath_enabled(False)
    model, args, kwargs = _model(name)
    if arm == "native":
        def run():
            return model(*args, **kwargs)
    elif arm == "bare":
        def run():
            with BareMode():
                return model(*args, **kwargs)
    else:
        tl = baseline_package(baseline) if baseline else __import__("torchlens")

        def run():
            return tl.trace(model, args, kwargs, save=arm)
    with torch.no_grad():
        for _ in range(_WARM_UP):
            run()
        gc.collect()
        gc.freeze()
        gc.disable()
        operator.call(lambda: [run() for _ in range(count)])


def _counted(name: str, arm: str, baseline: str | None, count: int, folder: str) -> float:
    """Instructions per call of one arm, less the idle BLAS threads'."""
    out = os.path.join(folder, f"callgrind.{abs(hash((name, arm, baseline)))}.out")
    command = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=_operator_call",
               f"--callgrind-out-file={out}", sys.executable, __file__, "--worker", name, "--arm", arm,
               "--traces", str(count)] + (["--baseline", baseline] if baseline else [])
    subprocess.run(command, check=True, capture_output=True)
    listing = subprocess.run(["callgrind_annotate", "--threshold=100", out], check=True, capture_output=True,
                             text=True).stdout
    total, idle = None, 0
    for line in listing.splitlines():
        if line.startswith("-- Auto"):
            break
        found = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S.*)$", line)
        if found is None:
            continue
        n = int(found.group(1).replace(",", ""))
        if "PROGRAM TOTALS" in found.group(2):
            total = n
        elif any(idle_name in found.group(2) for idle_name in _IDLE):
            idle += n
    return (total - idle) / count


def _k(instructions: float) -> str:
    return f"{instructions / 1e3:,.1f} k"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another revision's src/torchlens directory")
    parser.add_argument("--models", default="one-op,mlp3,resnet,GPT-2,BERT", help="comma-separated names")
    parser.add_argument("--traces", type=int, default=10, help="calls counted per arm")
    parser.add_argument("--jobs", type=int, default=2, help="workers under valgrind at once")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        _worker(options.worker, options.arm, options.baseline, options.traces)
        return
    names = options.models.split(",")
    arms = [("native", None), ("bare", None), ("all", None), ("none", None)]
    if options.baseline:
        arms += [("all", options.baseline), ("none", options.baseline)]
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(options.jobs) as pool:
        jobs = {(name, arm, path): pool.submit(_counted, name, arm, path, options.traces, folder)
                for name in names for arm, path in arms}
        counts = {key: job.result() for key, job in jobs.items()}
    header = ["model", "untraced forward", "bare mode added", 'tl.trace(save="all") added',
              'tl.trace(save="none") added']
    if options.baseline:
        header += ['baseline save="all" added', 'baseline save="none" added', "this / baseline, all",
                   "this / baseline, none"]
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for name in names:
        native = counts[(name, "native", None)]
        added = {(arm, path): counts[(name, arm, path)] - native for arm, path in arms if arm != "native"}
        cells = [_k(native), _k(added[("bare", None)]), _k(added[("all", None)]), _k(added[("none", None)])]
        if options.baseline:
            base_all, base_none = added[("all", options.baseline)], added[("none", options.baseline)]
            cells += [_k(base_all), _k(base_none), f"{added[('all', None)] / base_all:.3f}",
                      f"{added[('none', None)] / base_none:.3f}"]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nInstructions per call, {options.traces} calls counted per arm after {_WARM_UP} warm-up calls.")


if __name__ == "__main__":
    main()
