"""What one module call costs inside a trace, above the same call untraced, split into its two parts.

The model is a stack of ``nn.Identity`` (module calls and no ops).  Per round, interleaved in one process:

- ``native``: the untraced forward;
- ``tracker``: the forward with only ``capture.modules.ModuleCallTracker`` entered (no capture mode), so
  its difference from native is what recording a module call costs during the forward;
- ``trace``: the whole ``tl.trace(save="none")``, at two depths; the slope between them is the added cost
  per module call of the whole trace (forward and finalize), the figure ``overhead_fit.py`` fits as
  ``per_call``.

With ``--baseline DIR`` (another revision's ``src/torchlens``) the tracker and trace arms are run for that
revision too, side by side.  Each figure is the fastest block of its arm over the rounds (the machine is
shared: read the medians over repeated runs and the ratios).  Run:

    python benchmarks/module_call_cost.py [--rounds 200] [--baseline /path/to/src/torchlens]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import baseline_package  # noqa: E402

SMALL, LARGE = 10, 100
BLOCK = 2  # calls per timed block: short blocks, many rounds, so that the fastest escaped preemption


def _stack(n: int):
    return nn.Sequential(*[nn.Identity() for _ in range(n)]).eval()


def _tracker_arm(package, model, x):
    from importlib import import_module

    state_module = import_module(f"{package.__name__}.capture.state")
    modules = import_module(f"{package.__name__}.capture.modules")
    source = import_module(f"{package.__name__}.capture.source")

    def run():
        state = state_module.CaptureState(save_mode=0, save_device=None, record_finite=False, buffers={},
                                          max_saved_bytes=None)
        with modules.ModuleCallTracker(state, model, source.FrameClassifier()):
            model(x)
    return run


def _time(fn, n: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - start) / n / 1e3


def measure(packages: dict, rounds: int) -> dict:
    x = torch.randn(64)
    small, large = _stack(SMALL), _stack(LARGE)
    arms = {"native": lambda: large(x)}
    for name, package in packages.items():
        arms[f"tracker {name}"] = _tracker_arm(package, large, x)
        arms[f"trace {name} {SMALL}"] = lambda p=package: p.trace(small, x, save="none")
        arms[f"trace {name} {LARGE}"] = lambda p=package: p.trace(large, x, save="none")
    best = {k: float("inf") for k in arms}
    for fn in arms.values():
        fn()
    for _ in range(rounds):
        for key, fn in arms.items():
            best[key] = min(best[key], _time(fn, BLOCK))
    native_small = min(_time(lambda: small(x), BLOCK) for _ in range(rounds))
    out = {}
    per_native = best["native"] / LARGE
    for name in packages:
        out[name] = {
            "forward us per call": (best[f"tracker {name}"] - best["native"]) / LARGE,
            "trace us per call": ((best[f"trace {name} {LARGE}"] - best["native"])
                                  - (best[f"trace {name} {SMALL}"] - native_small)) / (LARGE - SMALL),
        }
    out["native us per call"] = per_native
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--baseline", help="another revision's src/torchlens directory, measured beside this one")
    options = parser.parse_args()
    torch.set_num_threads(1)
    import torchlens

    packages = {"this": torchlens}
    if options.baseline:
        packages["baseline"] = baseline_package(options.baseline)
    collecting = gc.isenabled()
    gc.disable()  # as during a trace
    try:
        result = measure(packages, options.rounds)
    finally:
        if collecting:
            gc.enable()
    print(f"untraced nn.Identity call: {result['native us per call']:.2f} us")
    print("| revision | added per module call, forward (us) | added per module call, whole trace (us) |")
    print("|---|---|---|")
    for name in packages:
        row = result[name]
        print(f"| {name} | {row['forward us per call']:.2f} | {row['trace us per call']:.2f} |")


if __name__ == "__main__":
    main()
