"""The (model, shape, tier) overhead matrix, written into docs/overhead.md.

Capture overhead depends on the model, the input shape and what is recorded, so it is published only as
this matrix.  Every cell is one run of the paired-ratio harness, tier arm against the untraced forward:

    bare        a no-op ``TorchFunctionMode`` (the floor of interposition)
    metadata    ``tl.trace(save="none")``: records, no activations kept
    full        ``tl.trace(save="all")``: every activation kept (by reference)
    full+finite ``tl.trace(save="all", record_finite=True)``: plus a NaN/Inf flag per op

With ``--ref-python PATH`` (a python whose environment has the reference torchlens release installed
instead of this package) a worker process under that interpreter adds a column: its default ``tl.trace``
against native forward in the worker's own process.  This package never imports it.

Run:  .venv/bin/python benchmarks/overhead_matrix.py [--quick] [--ref-python /path/to/python]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOC = os.path.join(ROOT, "docs", "overhead.md")
HARNESS = os.path.join(ROOT, "src", "torchlens", "report", "overhead.py")
HARNESS_PACKAGE = "torchlens_checkout_harness"  # this checkout's package folder, in a reference worker
sys.path.insert(0, HERE)
from models import MODELS, bare_arm, build, native_arm, trace_arm  # noqa: E402

TIERS = {
    "bare": lambda m, a: bare_arm(m, a),
    "metadata": lambda m, a: trace_arm(m, a, save="none"),
    "full": lambda m, a: trace_arm(m, a, save="all"),
    "full+finite": lambda m, a: trace_arm(m, a, save="all", record_finite=True),
}


def harness():
    """The harness module: from the package normally; from this checkout's files in a reference-library
    worker, where ``import torchlens`` names the other library.

    There the package's folder is mounted under a private name, so the harness's relative imports (the
    package's argument checks and output walker) resolve to this checkout's files, and ``torchlens`` is never
    imported."""
    if "--ref-worker" not in sys.argv:
        from torchlens.report import overhead

        return overhead
    if HARNESS_PACKAGE not in sys.modules:
        package = types.ModuleType(HARNESS_PACKAGE)
        package.__path__ = [os.path.dirname(os.path.dirname(HARNESS))]  # its __init__ (and torch hooks) never run
        sys.modules[HARNESS_PACKAGE] = package
    return importlib.import_module(f"{HARNESS_PACKAGE}.report.overhead")


def settings(quick: bool, h) -> dict:
    if quick:
        predicate = h.RefusalPredicate(min_pairs=7, max_relative_iqr=0.25, min_ratio=1.0)
        return {"pairs": 7, "repeats": 3, "predicate": predicate}
    predicate = h.RefusalPredicate(min_pairs=10, max_relative_iqr=0.25, min_ratio=1.0)
    return {"pairs": 15, "repeats": 5, "predicate": predicate}


def cells(models: list):
    for name in models:
        for shape in MODELS[name][2]:
            yield name, shape


def count_ops(model, args) -> int:
    import torchlens as tl

    return sum(1 for op in tl.trace(model, args, save="none").ops if op.kind == "op")


def measure_matrix(models: list, cfg: dict, h) -> list:
    rows = []
    for name, shape in cells(models):
        model, args = build(name, shape)
        native = ("native", native_arm(model, args))
        row = {"model": name, "shape": shape, "ops": count_ops(model, args), "tiers": {}}
        for tier, make in TIERS.items():
            result = h.measure_overhead(native, (tier, make(model, args)), pairs=cfg["pairs"],
                                        repeats=cfg["repeats"], predicate=cfg["predicate"])
            row["tiers"][tier] = result
            print(f"  {name} [{shape}] {result}", flush=True)
        rows.append(row)
    return rows


def reference_worker(models: list, pairs: int) -> None:
    """Runs under the reference library's python; prints one JSON line per cell."""
    import torchlens as ref

    h = harness()
    predicate = h.RefusalPredicate(min_pairs=pairs, max_relative_iqr=0.25, min_ratio=1.0)
    for name, shape in cells(models):
        model, args = build(name, shape)

        def ref_trace(model=model, args=args):
            log = ref.trace(model, args)
            return log[log.output_layers[0]].tensor

        result = h.measure_overhead(("native", native_arm(model, args)), ("reference tl.trace", ref_trace),
                                    pairs=pairs, warmup=1, repeats=3, predicate=predicate)
        print(json.dumps({"model": name, "shape": shape, "cell": result.cell(), "line": str(result),
                          "ms_per_call": result.b_ns / 1e6}), flush=True)


def run_reference(python: str, models: list, pairs: int, threads: int) -> dict:
    cmd = [python, os.path.abspath(__file__), "--ref-worker", "--models", ",".join(models),
           "--ref-pairs", str(pairs), "--threads", str(threads)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # keep this package off its path
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE)
    if done.returncode != 0:
        print(f"reference worker failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return {}
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            cell = json.loads(line)
            found[(cell["model"], cell["shape"])] = cell
            print(f"  reference: {cell['line']}")
    return found


def markdown(rows: list, reference: dict, command: str) -> str:
    head = ["model", "shape", "ops", "native ms", "bare mode", "metadata (save none)", "full (save all)",
            "full + finite flags"]
    if reference:
        head.append("reference library tl.trace")
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in rows:
        tiers = row["tiers"]
        cellv = [MODELS[row["model"]][0], row["shape"], str(row["ops"]), f"{tiers['bare'].a_ns / 1e6:.3f}"]
        cellv += [tiers[t].cell() for t in TIERS]
        if reference:
            ref = reference.get((row["model"], row["shape"]))
            full_ms = tiers["full"].b_ns / 1e6
            cellv.append(f"{ref['cell']} ({ref['ms_per_call']:.0f} ms; {ref['ms_per_call'] / full_ms:.0f}x full)"
                         if ref else "-")
        lines.append("| " + " | ".join(cellv) + " |")
    any_result = rows[0]["tiers"]["bare"]
    fp = any_result.fingerprint
    lines += ["", f"Each cell: tier time / native time, median of {any_result.pairs} paired ratios with its 95% "
              f"interval, or `>= floor (refused)`. Predicate: {any_result.predicate.describe()}. Machine: torch "
              f"{fp.get('torch')}, {fp.get('threads')} torch threads, {fp.get('device')}, {fp.get('cpus')} CPUs, "
              f"load {fp.get('load_1_5_15')}; measured {time.strftime('%Y-%m-%d')}."]
    if reference:
        lines += ["", "Reference column: measured in a separate process under the reference release's own "
                  "environment, against native forward in that same process (whose untraced forwards its "
                  "installed wrappers already slow down), with 6 pairs. In parentheses: its milliseconds per "
                  "traced call, and that time over the full tier's per-call time here (an unpaired comparison "
                  "across two processes: indicative only)."]
    lines += ["", "Command:", "", "```text", command, "```"]
    return "\n".join(lines)


_TEMPLATE = """# Overhead

Every overhead figure on this page comes from the paired-ratio harness
(`tl.report.measure_overhead`). It times two zero-argument callables in alternating
pairs (A then B, B then A) after a warm-up. Within a pair each arm runs a few interleaved blocks timed
with `time.perf_counter_ns` (synchronized on CUDA) and keeps its fastest block, so a burst of load
from other processes does not land on one arm only; each pair then gives one ratio. Before any timing
the harness is handed a refusal predicate: a minimum number of pairs, a maximum relative spread
(interquartile range over median) of the paired ratios, and two witnesses that must agree: both arms
return equal outputs in every pair, and both make the same number of `nn.Module` calls. When the
predicate fails there is no point estimate, only a one-sided 95% lower bound on the ratio (the floor);
when a witness disagrees there is no number at all, because the two arms did not run the same work.
Intervals and floors are order statistics of the paired ratios (the sign-test bounds for a median), so
they assume nothing about the shape of the noise.

Overhead belongs to a (model, shape, tier) cell, not to the library: on small inputs the fixed cost
per op and per trace dominates and ratios are large; on large inputs kernel time hides it. Read the row
closest to your model, or measure your own model on your own machine:

```python
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.report import RefusalPredicate, measure_overhead

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
x = torch.randn(32, 64)
with torch.no_grad():
    result = measure_overhead(("native", lambda: model(x)),
                              ("tl.trace", lambda: tl.trace(model, x).output),
                              pairs=9, predicate=RefusalPredicate(min_pairs=9))
print(result)  # one line: the ratio and its interval, or REFUSED with the floor and the reasons
```

All arms below run in eval mode under `torch.no_grad()`, one torch thread, with the fused attention
fast path switched off (`torch.backends.mha.set_fastpath_enabled(False)`) so that the untraced forward
and a plain `TorchFunctionMode` run the same ops (`tl.trace` itself keeps the fast path when it is on).
The figures come from a shared 2-core machine under load from other jobs; expect tighter intervals and
fewer refusals on a quiet one.

## The (model, shape, tier) matrix

Tiers: bare no-op `TorchFunctionMode` (the floor of interposition); metadata only
(`tl.trace(save="none")`); full (`save="all"`, activations kept by reference); full with a NaN/Inf
flag per op (`record_finite=True`). The last column, when present, is the reference torchlens release
2.36.1, which must live in its own virtualenv (it has the same import name) and is run there by a
worker process:

```text
python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 torchlens==2.36.1
python benchmarks/overhead_matrix.py --ref-python /tmp/refvenv/bin/python
```

<!-- matrix:begin -->
(not measured yet: run `python benchmarks/overhead_matrix.py`)
<!-- matrix:end -->

## tl.trace against a bare mode and a minimal recorder

Five arms per model at its small shape: untraced forward; a bare no-op `TorchFunctionMode`; a minimal
recorder mode that keeps the function, output shape and a reference to each output (the least that
keeping every activation can cost: holding every intermediate alive is allocator work no design avoids);
`tl.trace(save="all")`; `tl.trace(save="none")`. "+us/op" is the median paired time difference against
the untraced forward (or the bare mode, last column) divided by the op count, so a trace's fixed cost is
spread over its ops. The checks: `tl.trace` adds at most twice the recorder's cost per op plus 5 us on
every row, at most 15 us per op on the elementwise chain, and with `save="none"` at most 2 us per op
over the bare mode; in a fresh process that has already imported torch, importing torchlens and the
first `tl.trace` add at most 150 ms to what the first untraced forward takes there. A refused
measurement decides a check only when its floor alone already breaks the limit; otherwise the check
reads "not established".

<!-- trace:begin -->
(not measured yet: run `python benchmarks/trace_overhead.py`)
<!-- trace:end -->
"""


def write_section(key: str, text: str, path: str = DOC) -> None:
    """Replace the generated section ``key`` of the overhead page, creating the page if needed."""
    page = open(path).read() if os.path.exists(path) else _TEMPLATE
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    if begin not in page:
        raise ValueError(f"{path} has no {begin} marker; restore it or delete the page to regenerate it")
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    page = pattern.sub(lambda _: f"{begin}\n{text}\n{end}", page)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(page)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="7 pairs of 3 blocks per cell, not 15 of 5")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--ref-python", help="python of a virtualenv with the reference release installed")
    parser.add_argument("--ref-pairs", type=int, default=6)
    parser.add_argument("--ref-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-docs", action="store_true", help=f"print only; do not rewrite {DOC}")
    parser.add_argument("--json", help="also write every measurement as JSON here")
    opts = parser.parse_args(argv)
    models = opts.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    torch.set_num_threads(opts.threads)
    torch.backends.mha.set_fastpath_enabled(False)  # same program in every arm: see the page's preamble
    if opts.ref_worker:
        with torch.no_grad():
            reference_worker(models, opts.ref_pairs)
        return 0
    h = harness()
    with torch.no_grad():
        rows = measure_matrix(models, settings(opts.quick, h), h)
    reference = run_reference(opts.ref_python, models, opts.ref_pairs, opts.threads) if opts.ref_python else {}
    command = "python benchmarks/overhead_matrix.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    text = markdown(rows, reference, command)
    print(text)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"cells": [{"model": r["model"], "shape": r["shape"], "ops": r["ops"],
                                  "tiers": {t: v.to_dict() for t, v in r["tiers"].items()},
                                  "reference": reference.get((r["model"], r["shape"]))} for r in rows]},
                      fh, indent=1)
    if not opts.no_docs:
        write_section("matrix", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
