"""End-to-end check of ``tl.report.kernel_profile`` on a CUDA device (under two minutes).

Profiles a small CNN forward + backward on ``cuda`` and checks:

1. the join is complete and device activity was recorded;
2. kernels land on the right ops: every conv2d and linear op has at least one kernel, forward and
   backward;
3. at least 95% of device busy time is attributed to ops or module calls;
4. per-op device time equals a second route over the same profiler data: torch's own
   ``FunctionEvent.kernels`` of the events under each op marker (within 1 us per kernel);
5. every id in the sidecar exists in the native chrome trace, which has kernels with External ids and
   ``ac2g`` flows.

Usage: ``python scripts/check_cuda_profile.py [--out DIR]``.  Writes ``run.json``, its id map and
``check.json`` (the figures) to DIR; exits 1 when a check fails, 2 when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn

import torchlens as tl
from torchlens.report.markers import parse_marker


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.head(self.features(x))


def second_route(kp) -> dict:
    """Device ns per op marker from torch's FunctionEvent.kernels, walking parents up to the marker."""
    totals: dict = {}
    for event in kp.profiler.events():
        if not event.kernels:
            continue
        parent = event
        while parent is not None and (parse_marker(parent.name) or ("",))[0] != "op":
            parent = parent.cpu_parent
        if parent is not None:
            totals[parent.name] = totals.get(parent.name, 0.0) + sum(k.duration for k in event.kernels)
    return totals


def check(out_dir: str) -> dict:
    torch.manual_seed(0)
    model = SmallCNN().cuda().train()
    x = torch.randn(16, 3, 32, 32, device="cuda")
    model(x).sum().backward()  # warm up: cuDNN handles, lazy module loading
    torch.cuda.synchronize()

    started = time.perf_counter()
    path = os.path.join(out_dir, "run.json")
    kp = tl.report.kernel_profile(model, x, backward=True, chrome_trace=path)
    failures = []
    cov = kp.coverage
    if not kp.has_device:
        failures.append("no device activity recorded")
    if not kp.complete:
        failures.append(f"join incomplete: {cov.problems}")
    for row in kp.ops:
        if row["type"] in ("conv2d", "linear"):
            if not row["kernels"]:
                failures.append(f"{row['op']}: no forward kernel")
            if not row["bwd_kernels"]:
                failures.append(f"{row['op']}: no backward kernel")
    fraction = cov.device_fraction or 0.0
    if fraction < 0.95:
        failures.append(f"device busy time attributed {fraction:.3f} < 0.95")

    route = second_route(kp)
    serial_of_call = {c: s for s, c in kp.markers.resolve_calls(len(kp.trace._calls)).items()}
    mismatches = []
    for c, row in enumerate(kp.ops):
        theirs_us = route.get(kp.markers.op_name(serial_of_call[c]), 0.0)
        if abs((row["device_ns"] or 0) / 1000 - theirs_us) > 1.0 * max(row["kernels"] or 0, 1) + 0.01:
            mismatches.append((row["op"], row["device_ns"], theirs_us))
    if mismatches:
        failures.append(f"per-op device time differs from FunctionEvent.kernels: {mismatches[:5]}")

    with open(path) as f:
        native = json.load(f)
    with open(path + ".torchlens.json") as f:
        sidecar = json.load(f)
    xs = [e for e in native["traceEvents"] if e.get("ph") == "X"]
    names = {e["name"] for e in xs}
    host_ids = {e["args"].get("External id") for e in xs if e.get("cat") in ("cpu_op", "user_annotation")}
    correlations = {e["args"].get("correlation") for e in xs if "correlation" in e.get("args", {})}
    missing = [k for k in sidecar["markers"] if k not in names]
    missing += [k for k in sidecar["external_ids"] if int(k) not in host_ids]
    missing += [k for k in sidecar["correlations"] if int(k) not in correlations]
    if missing:
        failures.append(f"{len(missing)} sidecar ids not in the native trace: {missing[:5]}")
    kernels = [e for e in xs if e.get("cat") == "kernel"]
    if not kernels or not all("External id" in e["args"] for e in kernels):
        failures.append("native trace kernels lack External ids")
    if not any(e.get("cat") == "ac2g" for e in native["traceEvents"]):
        failures.append("native trace has no ac2g flows")

    figures = {
        "seconds": round(time.perf_counter() - started, 2),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "ops": len(kp.ops),
        "coverage": cov.to_dict(),
        "device_fraction": fraction,
        "kernels_in_trace": len(kernels),
        "sidecar_ids": {k: len(sidecar[k]) for k in ("markers", "external_ids", "correlations")},
        "failures": failures,
    }
    print(kp)
    print(json.dumps({k: v for k, v in figures.items() if k != "coverage"}, indent=1))
    with open(os.path.join(out_dir, "check.json"), "w") as f:
        json.dump(figures, f, indent=1)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="cuda_profile_check")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs one")
        return 2
    os.makedirs(args.out, exist_ok=True)
    figures = check(args.out)
    print("FAILED:\n  " + "\n  ".join(figures["failures"]) if figures["failures"] else "all checks passed")
    return 1 if figures["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
