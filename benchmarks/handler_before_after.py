"""``tl.trace`` of the package under test against another revision of it, side by side in one process.

Each model of ``models.py`` at its small shape is traced by both packages in alternating pairs
(``measure_overhead``: outputs and module calls must agree), once with ``save="all"`` and once with
``save="none"``.  The baseline is another revision's source tree, imported under another name
(``models.baseline_package``), so both run in the same process, on the same models and tensors, under
the same load.  Each cell: time after / time before, median of the paired ratios with its 95% interval,
and the median paired difference per op in microseconds.  Run:

    git archive REV src/torchlens | tar -x -C /tmp/base
    python benchmarks/handler_before_after.py --baseline /tmp/base/src/torchlens [--pairs 15]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import MODELS, baseline_package, build, trace_arm  # noqa: E402
from trace_overhead import count_ops  # noqa: E402

from torchlens.report.overhead import RefusalPredicate, measure_overhead  # noqa: E402


def cell(result, ops: int) -> str:
    if result.delta_ns is None:
        return result.cell()
    return f"{result.cell()} ({result.delta_ns / ops / 1e3:+.1f} us/op)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="the other revision's src/torchlens directory")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    torch.set_grad_enabled(False)
    torch.backends.mha.set_fastpath_enabled(False)
    before = baseline_package(os.path.abspath(opts.baseline))
    predicate = RefusalPredicate(min_pairs=opts.pairs, max_relative_iqr=0.25)
    lines = ['| model | ops | save="all": after / before | save="none": after / before |', "|---|---|---|---|"]
    for name in opts.models.split(","):
        model, args = build(name)
        ops = count_ops(model, args)
        cells = []
        for save in ("all", "none"):
            result = measure_overhead(("before", trace_arm(model, args, package=before, save=save)),
                                      ("after", trace_arm(model, args, save=save)),
                                      pairs=opts.pairs, predicate=predicate)
            print(f"  {name} save={save}: {result}", flush=True)
            cells.append(cell(result, ops))
        lines.append(f"| {MODELS[name][0]} | {ops} | " + " | ".join(cells) + " |")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    lines += ["", f"Median of {opts.pairs} paired ratios [95% interval] (median paired difference per op). "
              f"torch {torch.__version__}, {torch.get_num_threads()} torch thread(s), {os.cpu_count()} CPUs, "
              f"load {tuple(round(v, 2) for v in load) if load else '?'}."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
