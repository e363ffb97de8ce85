"""Capture cost of ``tl.trace`` against native forward, a bare no-op mode and a minimal recorder.

Per model (small shape), five arms run in one process, each pair of arms through the paired-ratio
harness (alternating order, refusal predicate, output and module-call witnesses):

    native      untraced ``model(*args)``
    bare        the same under a ``TorchFunctionMode`` that records nothing
    recorder    a mode appending (function, output shape, reference to the output) per op
    trace all   ``tl.trace(model, args, save="all")``
    trace none  ``tl.trace(model, args, save="none")``

It reports ratios to native and to the bare mode, the added microseconds per op of ``tl.trace`` and of
the recorder (paired median difference / ops), checks them against the targets below, and measures the
cold first ``tl.trace`` in fresh processes.  Targets (2-core CPU host):

    trace all added/op <= 2 x recorder added/op + 5 us          (every row)
    trace all added/op <= 15 us on the elementwise chain
    trace none added/op over the bare mode <= 2 us              ("close to bare")
    cold: import torchlens + first tl.trace <= 150 ms beyond import torch (and beyond the model's
          own cold first forward, measured in paired fresh processes)

A refused measurement decides a target only when its floor already breaks it; otherwise the check
reads "not established".  With ``--pure`` the tl.trace arms run on the compiled hot path (torchlens-accel)
and two more on the pure-Python path beside them.  Run:

    .venv/bin/python benchmarks/trace_overhead.py [--quick] [--pure] [--no-cold]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import MODELS, bare_arm, build, machine_footer, native_arm, recorder_arm, trace_arm  # noqa: E402
from overhead_matrix import DOC, write_section  # noqa: E402

from torchlens.report.overhead import RefusalPredicate, measure_overhead  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PER_OP_SLACK_US = 5.0
NONE_OVER_BARE_US = 2.0
CHAIN_LIMIT_US = 15.0
COLD_LIMIT_MS = 150.0


def settings(quick: bool) -> dict:
    if quick:
        predicate = RefusalPredicate(min_pairs=7, max_relative_iqr=0.25, min_ratio=1.0)
        return {"pairs": 7, "repeats": 3, "predicate": predicate}
    predicate = RefusalPredicate(min_pairs=10, max_relative_iqr=0.25, min_ratio=1.0)
    return {"pairs": 15, "repeats": 5, "predicate": predicate}


def count_ops(model, args) -> int:
    import torchlens as tl

    return sum(1 for op in tl.trace(model, args, save="none").ops if op.kind == "op")


def measure_row(name: str, cfg: dict, pure: bool = False) -> dict:
    model, args = build(name)
    compiled = True if pure else None  # with --pure: the compiled path, and the pure-Python path beside it
    arms = {"native": native_arm(model, args), "bare": bare_arm(model, args),
            "recorder": recorder_arm(model, args), "trace all": trace_arm(model, args, compiled=compiled, save="all"),
            "trace none": trace_arm(model, args, compiled=compiled, save="none")}
    plan = [("native", "bare"), ("native", "recorder"), ("native", "trace all"), ("native", "trace none"),
            ("bare", "trace all"), ("bare", "trace none")]
    if pure:
        arms["trace all pure"] = trace_arm(model, args, compiled=False, save="all")
        arms["trace none pure"] = trace_arm(model, args, compiled=False, save="none")
        plan += [("native", "trace all pure"), ("bare", "trace none pure")]
    results = {}
    for a, b in plan:
        results[(a, b)] = measure_overhead((a, arms[a]), (b, arms[b]), pairs=cfg["pairs"],
                                           repeats=cfg["repeats"], predicate=cfg["predicate"])
        print(f"  {name}: {results[(a, b)]}", flush=True)
    return {"name": name, "ops": count_ops(model, args), "results": results, "phases": phases(model, args)}


def phases(model, args, calls: int = 7) -> tuple:
    """(forward, after-forward) seconds of the fastest of ``calls`` traces, from tl.trace's own
    instrumented timings (the fastest, like the harness's blocks, to keep other processes' load out)."""
    import torchlens as tl

    fastest = min((tl.trace(model, args).timings for _ in range(calls)), key=lambda t: t["total"])
    return fastest["forward"], fastest["total"] - fastest["forward"]


def per_op(result, ops: int):
    """(median added us/op or None, floor us/op or None)."""
    median = result.delta_ns / ops / 1e3 if result.delta_ns is not None else None
    floor = result.delta_floor_ns / ops / 1e3 if result.delta_floor_ns is not None else None
    return median, floor


def check(value, floor, limit) -> str:
    """Verdict on "value <= limit" from an admitted median, or from a floor that already breaks it."""
    if value is not None and limit is not None:
        return "met" if value <= limit else "MISSED"
    if floor is not None and limit is not None and floor > limit:
        return "MISSED (floor)"
    return "not established (refused)"


def row_checks(row: dict) -> dict:
    res, ops = row["results"], row["ops"]
    rec, rec_floor = per_op(res[("native", "recorder")], ops)
    trace, trace_floor = per_op(res[("native", "trace all")], ops)
    none_over_bare, none_floor = per_op(res[("bare", "trace none")], ops)
    limit = 2 * rec + PER_OP_SLACK_US if rec is not None else None
    checks = {"recorder_us_per_op": rec, "recorder_floor_us_per_op": rec_floor, "trace_us_per_op": trace,
              "trace_floor_us_per_op": trace_floor, "limit_us_per_op": limit,
              "vs_recorder": check(trace, trace_floor, limit), "none_over_bare_us_per_op": none_over_bare,
              "none_over_bare_floor_us_per_op": none_floor,
              "none_close_to_bare": check(none_over_bare, none_floor, NONE_OVER_BARE_US)}
    if row["name"] == "chain200":
        checks["chain"] = check(trace, trace_floor, CHAIN_LIMIT_US)
    if ("native", "trace all pure") in res:  # --pure: the same two figures on the pure-Python path
        checks["pure_trace_us_per_op"], checks["pure_trace_floor_us_per_op"] = \
            per_op(res[("native", "trace all pure")], ops)
        checks["pure_none_over_bare_us_per_op"], checks["pure_none_over_bare_floor_us_per_op"] = \
            per_op(res[("bare", "trace none pure")], ops)
    return checks


_COLD_CHILD = r"""
import json, sys, time
import torch
sys.path.insert(0, {here!r})
from models import build
torch.set_grad_enabled(False)
torch.set_num_threads({threads!r})
torch.backends.mha.set_fastpath_enabled(False)
model, args = build({name!r})
start = time.perf_counter_ns()
if {traced!r}:
    import torchlens as tl
    out = tl.trace(model, args).output
else:
    out = model(*args)
print(json.dumps({{"ns": time.perf_counter_ns() - start, "sum": float(out.double().sum())}}))
"""


def cold_start(name: str, pairs: int) -> dict:
    """Fresh processes, paired: the first native forward vs import torchlens + the first tl.trace.

    Both processes have imported torch and built the model before their clock starts."""
    own = {"native": [], "traced": []}

    def child(traced: bool):
        code = _COLD_CHILD.format(here=HERE, name=name, traced=traced, threads=torch.get_num_threads())
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        report = json.loads(done.stdout.strip().splitlines()[-1])
        own["traced" if traced else "native"].append(report["ns"])
        return report["sum"]

    predicate = RefusalPredicate(min_pairs=pairs, max_relative_iqr=0.25)
    result = measure_overhead(("fresh process, first forward", lambda: child(False)),
                              ("fresh process, import torchlens + first tl.trace", lambda: child(True)),
                              pairs=pairs, warmup=1, repeats=1, min_sample_s=0, predicate=predicate)
    traced_ms = statistics.median(own["traced"]) / 1e6
    native_ms = statistics.median(own["native"]) / 1e6
    # The model's own cold first forward (lazy kernel set-up) is not torchlens's cost: judge the excess.
    added_ms = traced_ms - native_ms
    return {"model": name, "result": result, "traced_ms": traced_ms, "native_ms": native_ms,
            "added_ms": added_ms, "check": "met" if added_ms <= COLD_LIMIT_MS else "MISSED"}


def fmt(value, digits=1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def us_cell(value, floor) -> str:
    """The median when admitted, else the floor marked as a lower bound."""
    if value is not None:
        return fmt(value)
    return f">= {fmt(floor)}" if floor is not None else "-"


def markdown(rows: list, cold: list, command: str) -> str:
    lines = ["| model | ops | native us | bare / native | recorder / native | trace all / native | "
             "trace none / native | trace all / bare | trace none / bare | recorder +us/op | "
             "trace all +us/op | target 2x rec + 5 | trace none +us/op over bare |",
             "|---" * 13 + "|"]
    for row in rows:
        r, c = row["results"], row["checks"]
        lines.append(
            f"| {MODELS[row['name']][0]} | {row['ops']} | {r[('native', 'bare')].a_ns / 1e3:.0f} | "
            + " | ".join(r[k].cell() for k in [("native", "bare"), ("native", "recorder"),
                                                 ("native", "trace all"), ("native", "trace none"),
                                                 ("bare", "trace all"), ("bare", "trace none")])
            + f" | {us_cell(c['recorder_us_per_op'], c['recorder_floor_us_per_op'])}"
            f" | {us_cell(c['trace_us_per_op'], c['trace_floor_us_per_op'])} | {c['vs_recorder']}"
            + (f" (<= {fmt(c['limit_us_per_op'])})" if c["limit_us_per_op"] is not None else "")
            + f" | {us_cell(c['none_over_bare_us_per_op'], c['none_over_bare_floor_us_per_op'])}"
            f" ({c['none_close_to_bare']}) |")
    lines.append("")
    if rows and "pure_trace_us_per_op" in rows[0]["checks"]:
        lines += ["| model | trace all +us/op compiled | trace all +us/op pure Python | trace none +us/op over bare "
                  "compiled | trace none +us/op over bare pure Python |", "|---" * 5 + "|"]
        for row in rows:
            c = row["checks"]
            lines.append(f"| {MODELS[row['name']][0]} | {us_cell(c['trace_us_per_op'], c['trace_floor_us_per_op'])} | "
                         f"{us_cell(c['pure_trace_us_per_op'], c['pure_trace_floor_us_per_op'])} | "
                         f"{us_cell(c['none_over_bare_us_per_op'], c['none_over_bare_floor_us_per_op'])} | "
                         f"{us_cell(c['pure_none_over_bare_us_per_op'], c['pure_none_over_bare_floor_us_per_op'])} |")
        lines.append("")
    chain = next((row for row in rows if row["name"] == "chain200"), None)
    if chain is not None:
        c = chain["checks"]
        added = us_cell(c["trace_us_per_op"], c["trace_floor_us_per_op"])
        lines.append(f"- Elementwise chain: tl.trace adds {added} us per op "
                     f"(target <= {CHAIN_LIMIT_US:g}): {chain['checks']['chain']}.")
    lines.append("- Where a tl.trace call spends its time (its own instrumented timings, fastest of 7 calls; "
                 "for locating cost, not quoting it): " + "; ".join(
                     f"{row['name']} {row['phases'][0] * 1e3:.2f} ms set-up and forward under capture + "
                     f"{row['phases'][1] * 1e3:.2f} ms building the record" for row in rows) + ".")
    for entry in cold:
        lines.append(f"- Cold start ({MODELS[entry['model']][0]}): in fresh processes that had imported torch and "
                     f"built the model, import torchlens + the first tl.trace took {entry['traced_ms']:.0f} ms "
                     f"and the first untraced forward {entry['native_ms']:.0f} ms (medians of "
                     f"{len(entry['result'].ratios)} pairs): torchlens adds {entry['added_ms']:.0f} ms; target "
                     f"<= {COLD_LIMIT_MS:g} ms: {entry['check']}. Whole processes, paired: `{entry['result']}`")
    fp = rows[0]["results"][("native", "bare")].fingerprint if rows else {}
    lines += machine_footer(fp, command)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer pairs, one cold-start model")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--cold-pairs", type=int, default=6)
    parser.add_argument("--no-docs", action="store_true", help=f"do not rewrite the section of {DOC}")
    parser.add_argument("--json", help="also write every measurement as JSON here")
    parser.add_argument("--pure", action="store_true", help="trace on the compiled hot path and, beside it, on "
                                                             "the pure-Python path (needs torchlens-accel)")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-start processes")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    # Every arm must run the same program: without this, eval-mode attention takes a fused fast path
    # natively but not under a plain TorchFunctionMode, and the output witness would refuse the row.
    torch.backends.mha.set_fastpath_enabled(False)
    cfg = settings(opts.quick)
    rows = []
    with torch.no_grad():
        for name in opts.models.split(","):
            row = measure_row(name, cfg, pure=opts.pure)
            row["checks"] = row_checks(row)
            rows.append(row)
    cold_models = ["mlp3"] if opts.quick else ["mlp3", "transformer"]
    cold = [] if opts.no_cold else [cold_start(name, opts.cold_pairs) for name in cold_models]
    command = "python benchmarks/trace_overhead.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    text = markdown(rows, cold, command)
    print(text)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump({"rows": [{"name": r["name"], "ops": r["ops"], "checks": r["checks"], "phases": r["phases"],
                                 "results": {f"{a} -> {b}": v.to_dict() for (a, b), v in r["results"].items()}}
                                for r in rows],
                       "cold": [{**c, "result": c["result"].to_dict()} for c in cold]}, fh, indent=1)
    if not opts.no_docs:
        write_section("trace", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
