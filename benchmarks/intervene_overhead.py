"""Cost of interventions: a traced, intervened forward against a native forward with one forward hook
doing the same edit, side by side in one process through the paired-ratio harness.

Per model (small shape), arms against ``hooked``, the untraced forward with a forward hook scaling one
module's output by 0.5:

    module site      ``tl.trace(model, x, intervene={module: tl.scale(0.5)})``
    label site, ref  ``tl.trace(model, x, intervene={label: tl.scale(0.5)}, reference=ref)``: the label of
                     that module's output op, resolved against a trace the caller already holds
    label site       the same without ``reference=``: tl.trace makes a metadata-only pass first, so the
                     baseline here is two hooked forwards (the harness checks both arms make the same
                     module calls); the ratio per hooked forward is twice the printed one
    plain trace      ``tl.trace(model, x)`` against the untraced forward without a hook, for context

and the added cost per intervened op: ``tl.trace(save="none", reference=ref)`` with an identity action at
every op (a predicate site) against ``tl.trace(save="none")`` without interventions, paired median difference / ops.
Every arm returns the edited output, so the harness's output witness checks each did the edit.

Run:  .venv/bin/python benchmarks/intervene_overhead.py [--quick] [--no-docs]

With ``--baseline DIR/src/torchlens`` (another revision's tree, ``git archive REV src accel benchmarks | tar -x
-C DIR``, its compiled modules built in place in ``DIR/accel``) it prints instead, per model, the label-site
(reference given), module-site and plain traces and the identity at every op of the package under test against
that revision, side by side; the last cell's difference is also given per op.  ``--edit`` makes that last arm
``tl.scale(1.0)`` at every op: each value replaced by an equal new tensor, so that it runs what an edit runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import baseline_package, build, native_arm  # noqa: E402
from overhead_matrix import write_section  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.report.overhead import RefusalPredicate, machine_fingerprint, measure_overhead  # noqa: E402

SITES = {"mlp20": "layers.10", "gpt2": "h.1", "resnet": "blocks.3", "loop_rnn": "cell"}


def _module(model, address):
    return dict(model.named_modules())[address]


def hooked_arm(model, args, address, times: int = 1):
    module = _module(model, address)

    def hooked():
        handle = module.register_forward_hook(lambda m, i, o: o * 0.5)
        try:
            for _ in range(times):
                out = model(*args)
            return out
        finally:
            handle.remove()
    return hooked


def site_label(ref, address: str) -> str:
    """The label of the op that makes ``address``'s output in ``ref``; the layer label (every pass) of a module
    called more than once, whose hook edits every call."""
    if hasattr(ref[address], "calls"):
        return ref[f"{address}:1"].layer_label
    return ref[address].label


def row_arms(name: str) -> tuple:
    """The row's arms (name -> zero-argument callable), the label of its site, and its op count."""
    model, args = build(name)
    address = SITES[name]
    ref = tl.trace(model, args, save="none")
    label, ops = site_label(ref, address), sum(1 for op in ref.ops if op.kind == "op")
    arms = {
        "hooked": hooked_arm(model, args, address),
        "hooked x2": hooked_arm(model, args, address, times=2),
        "module site": lambda: tl.trace(model, args, intervene={address: tl.scale(0.5)}).output,
        "label site, ref": lambda: tl.trace(model, args, intervene={label: tl.scale(0.5)}, reference=ref).output,
        "label site": lambda: tl.trace(model, args, intervene={label: tl.scale(0.5)}).output,
        "native": native_arm(model, args),
        "plain trace": lambda: tl.trace(model, args).output,
        # No reference= here: with nothing to resolve, tl.trace refuses it as ignored.
        "trace none": lambda: tl.trace(model, args, save="none").output,
        "every op": lambda: tl.trace(model, args, save="none", reference=ref,
                                     intervene={(lambda op: True): lambda t, op: None}).output,
    }
    return arms, label, ops


def measure_row(name: str, cfg: dict) -> dict:
    arms, label, ops = row_arms(name)
    plan = [("hooked", "module site"), ("hooked", "label site, ref"), ("hooked x2", "label site"),
            ("native", "plain trace"), ("trace none", "every op")]
    results = {}
    for a, b in plan:
        results[(a, b)] = measure_overhead((a, arms[a]), (b, arms[b]), pairs=cfg["pairs"], repeats=cfg["repeats"],
                                           predicate=cfg["predicate"])
        print(f"  {name}: {results[(a, b)]}", flush=True)
    return {"name": name, "address": SITES[name], "label": label, "ops": ops, "results": results}


def _ratio(result) -> str:
    return result.cell()


def per_op_us(result, ops: int) -> str:
    if result.delta_ns is not None:
        return f"{result.delta_ns / ops / 1e3:.2f}"
    if result.delta_floor_ns is not None:
        return f">= {result.delta_floor_ns / ops / 1e3:.2f} (refused)"
    return "refused (witness)"


def section(rows: list, cfg: dict, command: str) -> str:
    lines = ["One module-site or label-site intervention (scale one module's output by 0.5) against an untraced "
             "forward with one forward hook doing the same edit; ratios are medians of paired runs with 95% "
             "intervals (`refused` rows give only the floor). Every arm returns the edited output and the "
             "harness checks the outputs agree pair by pair.", "",
             "| model | site | ops | module site / hooked | label site (reference given) / hooked | "
             "label site (first pass included) / two hooked forwards | plain trace / native | added us per "
             "intervened op |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        res = row["results"]
        lines.append(f"| {row['name']} | `{row['address']}` / `{row['label']}` | {row['ops']} | "
                     f"{_ratio(res[('hooked', 'module site')])} | {_ratio(res[('hooked', 'label site, ref')])} | "
                     f"{_ratio(res[('hooked x2', 'label site')])} | {_ratio(res[('native', 'plain trace')])} | "
                     f"{per_op_us(res[('trace none', 'every op')], row['ops'])} |")
    fp = machine_fingerprint()
    lines += ["", "Reading it: an intervened trace should cost about what a plain trace costs (compare the "
              "plain-trace column; on a loaded machine the cells move by more than their intervals between runs): "
              "a module site adds two hooks' worth of work per call of its module, a label site one set "
              "lookup per op plus the action at its op. Without `reference=` a label site also runs one "
              "metadata-only pass to resolve its label, so it costs about two traces (the label-site column is "
              "against two hooked forwards). The last column is the identity action applied at every op of the "
              "model (a predicate site accepting every op), over the same trace without interventions, divided by "
              "the number of ops: it includes resolving each op's site against the reference, the check that the "
              "forward reached the same op, calling the action and recording what was applied.", "",
              f"Machine: torch {fp.get('torch')}, {torch.get_num_threads()} torch threads, "
              f"{os.cpu_count()} CPUs, load {tuple(round(x, 2) for x in os.getloadavg())}; measured "
              f"{time.strftime('%Y-%m-%d')}; {cfg['pairs']} pairs per cell.", "", "Command:", "", "```text",
              command, "```"]
    return "\n".join(lines)


def before_after(models: list, baseline: str, cfg: dict, edit: bool = False) -> str:
    """``--baseline``: a label site (reference given), a module site, a plain trace and the identity at every op,
    each by the package under test against another revision's source tree (``models.baseline_package``) in
    alternating pairs."""
    before = baseline_package(os.path.abspath(baseline))
    # The identity keeps each value (None); ``--edit`` returns a new tensor of equal values at every op
    # (tl.scale(1.0)), which runs what an edit runs: the checks that no checkpoint region or custom
    # autograd.Function around the op would miss it, and the new value's binding.
    every_action = (lambda p: p.scale(1.0)) if edit else (lambda p: lambda t, op: None)
    lines = ["| model | ops | label site, ref: after / before | module site: after / before | "
             f"plain trace: after / before | {'tl.scale(1.0)' if edit else 'identity'} at every op: after / before |",
             "|---|---|---|---|---|---|"]
    for name in models:
        model, args = build(name)
        address = SITES[name]
        refs = {package: package.trace(model, args, save="none") for package in (before, tl)}
        label, ops = site_label(refs[tl], address), sum(1 for op in refs[tl].ops if op.kind == "op")
        arms = {
            "label site, ref": lambda p: lambda: p.trace(model, args, intervene={label: p.scale(0.5)},
                                                          reference=refs[p]).output,
            "module site": lambda p: lambda: p.trace(model, args, intervene={address: p.scale(0.5)}).output,
            "plain trace": lambda p: lambda: p.trace(model, args).output,
            "every op": lambda p: lambda: p.trace(model, args, save="none", reference=refs[p],
                                                   intervene={(lambda op: True): every_action(p)}).output,
        }
        cells = []
        for arm, make in arms.items():
            result = measure_overhead(("before", make(before)), ("after", make(tl)), pairs=cfg["pairs"],
                                      repeats=cfg["repeats"], predicate=cfg["predicate"])
            print(f"  {name} {arm}: {result}", flush=True)
            delta = "" if result.delta_ns is None else f" ({result.delta_ns / 1e3:+.0f} us)"
            if arm == "every op" and result.delta_ns is not None:
                delta = f" ({result.delta_ns / 1e3 / ops:+.1f} us per op)"
            cells.append(result.cell() + delta)
        lines.append(f"| {name} (`{label}`) | {ops} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", f"Median of {cfg['pairs']} paired ratios [95% interval] (median paired "
                                   f"difference); torch {torch.__version__}, {torch.get_num_threads()} torch "
                                   f"thread(s), load {tuple(round(x, 2) for x in os.getloadavg())}."])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pairs and models (a smoke run)")
    parser.add_argument("--models", default=",".join(SITES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-docs", action="store_true", help="print only; do not rewrite docs/overhead.md")
    parser.add_argument("--baseline", help="another revision's src/torchlens: print after / before instead")
    parser.add_argument("--edit", action="store_true", help="with --baseline: tl.scale(1.0) at every op, not the "
                        "identity (every op's value replaced by an equal new tensor)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    torch.backends.mha.set_fastpath_enabled(False)
    pairs = 7 if opts.quick else 15
    cfg = {"pairs": pairs, "repeats": 2 if opts.quick else 3, "predicate": RefusalPredicate(min_pairs=pairs)}
    models = opts.models.split(",")[:2] if opts.quick else opts.models.split(",")
    if opts.baseline:
        with torch.no_grad():
            print(before_after(models, opts.baseline, cfg, opts.edit))
        return
    rows = []
    with torch.no_grad():
        for name in models:
            rows.append(measure_row(name, cfg))
    command = "python benchmarks/intervene_overhead.py" + (" --quick" if opts.quick else "")
    text = section(rows, cfg, command)
    print(text)
    if not opts.no_docs:
        write_section("interventions", text)


if __name__ == "__main__":
    main()
