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
``all-pure`` and ``none-pure``.  ``--cache`` also simulates the caches (``--cache-sim=yes``, the host's L1
sizes) and adds a table of the first-level instruction- and data-cache misses each arm adds: work that an
instruction count does not show, since a miss costs cycles without costing instructions.

Models: a row of ``models.py`` (``mlp3``, ``resnet``, ``gpt2``, ...), ``one-op`` (``x + 1``: a trace's
fixed cost), ``linears:N`` (N ``Linear(64, 64)`` calls in a row), or a prefix of a transformers model of
``transformers_overhead.py`` (``GPT-2``, ``BERT``), called with its keyword inputs.  Needs valgrind
(Debian's ``valgrind``); a worker takes one to four minutes.  Run:

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


def instructions(arguments: list, out: str, cache: bool = False) -> dict:
    """The events callgrind counts inside ``operator.call`` while ``python *arguments`` runs (a worker that
    warms up first, then makes its counted calls inside one ``operator.call``), less the idle BLAS threads':
    ``{"Ir": instructions}``, and with ``cache`` the simulated cache misses too (``I1mr``, ``D1mr``,
    ``D1mw``, ...).  ``out`` is where callgrind writes."""
    command = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=_operator_call",
               *(["--cache-sim=yes"] if cache else []), f"--callgrind-out-file={out}", sys.executable, *arguments]
    subprocess.run(command, check=True, capture_output=True)
    listing = subprocess.run(["callgrind_annotate", "--threshold=100", out], check=True, capture_output=True,
                             text=True).stdout
    events, total, idle = None, None, None
    for line in listing.splitlines():
        if line.startswith("Events shown:"):
            events = line.split(":", 1)[1].split()
            idle = [0] * len(events)
        if line.startswith("-- Auto"):
            break
        found = re.match(r"\s*((?:(?:[\d,]+ \([^)]*\)|\.)\s+)+)(\S.*)$", line)
        if found is None or events is None:
            continue
        counts = [0 if c == "." else int(c.replace(",", ""))
                  for c in re.findall(r"([\d,]+|\.)(?: \([^)]*\))?\s+", found.group(1))]
        if "PROGRAM TOTALS" in found.group(2):
            total = counts
        elif any(idle_name in found.group(2) for idle_name in _IDLE):
            idle = [a + b for a, b in zip(idle, counts)]
    return {event: t - i for event, t, i in zip(events, total, idle)}


def _counted(name: str, arm: str, baseline: str | None, count: int, folder: str, cache: bool = False) -> dict:
    """Events per call of one arm (see ``instructions``)."""
    out = os.path.join(folder, f"callgrind.{abs(hash((name, arm, baseline)))}.out")
    arguments = [__file__, "--worker", name, "--arm", arm, "--traces", str(count)]
    counted = instructions(arguments + (["--baseline", baseline] if baseline else []), out, cache)
    return {event: n / count for event, n in counted.items()}


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
    parser.add_argument("--cache", action="store_true", help="also simulate the caches and count first-level misses")
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
        jobs = {(name, arm, path): pool.submit(_counted, name, arm, path, options.traces, folder, options.cache)
                for name in names for arm, path in arms}
        events = {key: job.result() for key, job in jobs.items()}
    counts = {key: counted["Ir"] for key, counted in events.items()}
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
    if options.cache:
        _print_misses(names, arms, events)


def _print_misses(names: list, arms: list, events: dict) -> None:
    """First-level cache misses per call that each arm adds over the untraced forward (simulated)."""
    def misses(key):
        counted = events[key]
        return counted["I1mr"], counted["D1mr"] + counted["D1mw"]

    shown = [(arm, path) for arm, path in arms if arm != "native"]
    header = ["model", "untraced forward I1 / D1 misses"] + [
        f"{'baseline ' if path else ''}{'bare mode' if arm == 'bare' else _ARM_NAMES[arm]} added I1 / D1"
        for arm, path in shown]
    print("\n| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for name in names:
        i1, d1 = misses((name, "native", None))
        cells = [f"{_k(i1)} / {_k(d1)}"]
        for arm, path in shown:
            a1, b1 = misses((name, arm, path))
            cells.append(f"{_k(a1 - i1)} / {_k(b1 - d1)}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nFirst-level instruction (I1) and data (D1, reads and writes) cache misses per call, simulated by "
          "callgrind with the host's cache sizes.")


if __name__ == "__main__":
    main()
