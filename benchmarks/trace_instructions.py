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

``--pure`` adds the two ``tl.trace`` arms (and the baseline's) on the pure-Python path (``capture.accel.use(False)``),
``all-pure`` and ``none-pure``.

Models: a row of ``models.py`` (``mlp3``, ``resnet``, ``gpt2``, ...), ``one-op`` (``x + 1``: a trace's
fixed cost), ``linears:N`` (N ``Linear(64, 64)`` calls in a row), or a prefix of a transformers model of ``transformers_overhead.py`` (``GPT-2``, ``BERT``),
called with its keyword inputs.  Needs valgrind (Debian's ``valgrind``); a worker takes one to four
minutes.  Run:

    python benchmarks/trace_instructions.py [--models one-op,mlp3,resnet,GPT-2,BERT]
        [--baseline /path/to/other/src/torchlens] [--traces 10] [--jobs 2] [--pure]
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
    import importlib
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
        save = arm.removesuffix("-pure")
        if save != arm:  # the pure-Python path, for the whole process (no switch inside the counted calls)
            importlib.import_module(f"{tl.__name__}.capture.accel").use(False)

        def run():
            return tl.trace(model, args, kwargs, save=save)
    with torch.no_grad():
        for _ in range(_WARM_UP):
            run()
        gc.collect()
        gc.freeze()
        gc.disable()
        operator.call(lambda: [run() for _ in range(count)])


def instructions(arguments: list, out: str) -> int:
    """The instructions callgrind counts inside ``operator.call`` while ``python *arguments`` runs (a worker
    that warms up first, then makes its counted calls inside one ``operator.call``), less the idle BLAS
    threads'; ``out`` is where callgrind writes."""
    command = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=_operator_call",
               f"--callgrind-out-file={out}", sys.executable, *arguments]
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
    return total - idle


def _counted(name: str, arm: str, baseline: str | None, count: int, folder: str) -> float:
    """Instructions per call of one arm."""
    out = os.path.join(folder, f"callgrind.{abs(hash((name, arm, baseline)))}.out")
    arguments = [__file__, "--worker", name, "--arm", arm, "--traces", str(count)]
    return instructions(arguments + (["--baseline", baseline] if baseline else []), out) / count


_ARM_NAMES = {"all": 'tl.trace(save="all")', "none": 'tl.trace(save="none")',
              "all-pure": 'pure-Python save="all"', "none-pure": 'pure-Python save="none"'}


def _k(count: float) -> str:
    return f"{count / 1e3:,.1f} k"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another revision's src/torchlens directory")
    parser.add_argument("--models", default="one-op,mlp3,resnet,GPT-2,BERT", help="comma-separated names")
    parser.add_argument("--traces", type=int, default=10, help="calls counted per arm")
    parser.add_argument("--jobs", type=int, default=2, help="workers under valgrind at once")
    parser.add_argument("--pure", action="store_true", help="also count the tl.trace arms on the pure-Python path")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        _worker(options.worker, options.arm, options.baseline, options.traces)
        return
    names = options.models.split(",")
    traced = ["all", "none"] + (["all-pure", "none-pure"] if options.pure else [])
    arms = [("native", None), ("bare", None)] + [(arm, None) for arm in traced]
    if options.baseline:
        arms += [(arm, options.baseline) for arm in traced]
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(options.jobs) as pool:
        jobs = {(name, arm, path): pool.submit(_counted, name, arm, path, options.traces, folder)
                for name in names for arm, path in arms}
        counts = {key: job.result() for key, job in jobs.items()}
    header = ["model", "untraced forward", "bare mode added"] + [f"{_ARM_NAMES[arm]} added" for arm in traced]
    if options.baseline:
        header += [f"baseline {_ARM_NAMES[arm]} added" for arm in traced]
        header += [f"this / baseline, {_ARM_NAMES[arm]}" for arm in traced]
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for name in names:
        native = counts[(name, "native", None)]
        added = {(arm, path): counts[(name, arm, path)] - native for arm, path in arms if arm != "native"}
        cells = [_k(native), _k(added[("bare", None)])] + [_k(added[(arm, None)]) for arm in traced]
        if options.baseline:
            cells += [_k(added[(arm, options.baseline)]) for arm in traced]
            cells += [f"{added[(arm, None)] / added[(arm, options.baseline)]:.3f}" for arm in traced]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nInstructions per call, {options.traces} calls counted per arm after {_WARM_UP} warm-up calls.")


if __name__ == "__main__":
    main()
