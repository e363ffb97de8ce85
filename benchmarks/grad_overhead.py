"""Cost of gradient capture: traced forward+backward with ``grads=True`` against ``retain_grad()``.

Per model of ``models.py`` (small shape), five arms run in one process, each pair through the
paired-ratio harness (alternating order, refusal predicate, output and module-call witnesses); every
arm runs one forward and one backward of ``output.sum()``, with the parameters' ``.grad`` reset first:

    native          untraced forward + backward
    bare            the forward under a ``TorchFunctionMode`` that records nothing, + backward
    retain_grad     the forward under a mode calling ``retain_grad()`` on every output that requires
                    grad (the untraced way to keep every intermediate's gradient), + backward
    trace           ``tl.trace(model, args, save="none")`` + ``log.backward(loss)``
    trace grads     ``tl.trace(model, args, save="none", grads=True)`` + ``log.backward(loss)``

It reports what ``retain_grad()`` adds per op (retain_grad - bare), what gradient capture adds per op
(trace grads - trace: the tensor hooks and the Python call per op in the backward), the
ratio of a traced forward+backward with gradients to the untraced one with ``retain_grad()``, and
checks the target:

    gradient capture added/op <= retain_grad() added/op + 2 us     (every row)

With ``--paths both`` the traced arms run on each path in the same process: torchlens-accel with its C++
gradient hooks (``_autograd``, ``accel.use(True)``), torchlens-accel with its C hooks alone (``_grads``:
``_autograd`` left out), and the pure-Python path (``accel.use(False)``); a second table sets the three
paths' gradient capture cost per op (median, and the quartiles of the paired ratios) against the target.

Run:  .venv/bin/python benchmarks/grad_overhead.py [--quick] [--models mlp3,gpt2] [--paths both]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import MODELS, BareMode, build, machine_footer  # noqa: E402
from overhead_matrix import DOC, write_section  # noqa: E402

from torchlens.report.overhead import RefusalPredicate, measure_overhead  # noqa: E402

SLACK_US = 2.0


class RetainGradMode(TorchFunctionMode):
    """Untraced reference: ``retain_grad()`` on every tensor a torch call returns that requires grad."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.requires_grad and not t.is_leaf:
                t.retain_grad()
        return out


def _inputs_require_grad(args):
    """Float inputs require grad (a parameter-free model has a backward only through them)."""
    return tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


def _first_output(out):
    return out if isinstance(out, torch.Tensor) else next(t for t in out if isinstance(t, torch.Tensor))


def _reset(model, args):
    for p in model.parameters():
        p.grad = None
    for a in args:
        if isinstance(a, torch.Tensor):
            a.grad = None


def _result(model, args, out):
    """What every arm returns (the output witness): the output and one gradient, both detached."""
    grads = [p.grad for p in model.parameters() if p.grad is not None] or [a.grad for a in args if a.grad is not None]
    return out.detach(), grads[0].detach()


def arms(model, args, paths="current"):
    import torchlens as tl
    from torchlens.capture import accel

    def untraced(mode_cls):
        def run():
            _reset(model, args)
            if mode_cls is None:
                out = _first_output(model(*args))
            else:
                with mode_cls():
                    out = _first_output(model(*args))
            out.sum().backward()
            return _result(model, args, out)
        return run

    def traced(grads, compiled=None, without=()):
        def run():
            _reset(model, args)
            previous = accel.use(compiled) if compiled is not None else None
            try:
                with accel.without(*without):  # e.g. no C++ hooks: the C hooks serve
                    log = tl.trace(model, args, save="none", grads=grads)
            finally:
                if compiled is not None:
                    accel.use(previous)
            out = _first_output(log.output)
            if grads:
                log.backward(out.sum())
            else:
                out.sum().backward()
            return _result(model, args, out)
        return run

    compiled = True if paths == "both" else None
    fns = {"native": untraced(None), "bare": untraced(BareMode), "retain_grad": untraced(RetainGradMode),
           "trace": traced(False, compiled), "trace grads": traced(True, compiled)}
    if paths == "both":
        fns.update({"trace py": traced(False, False), "trace grads py": traced(True, False),
                    "trace c": traced(False, True, ("_autograd",)),
                    "trace grads c": traced(True, True, ("_autograd",))})
    return fns


def count_ops(model, args) -> int:
    import torchlens as tl

    return sum(1 for op in tl.trace(model, args, save="none") if op.kind == "op")


def measure_row(name, cfg) -> dict:
    model, args = build(name)
    model.train(False)
    args = _inputs_require_grad(args)
    fns = arms(model, args, cfg["paths"])
    plan = [("bare", "retain_grad"), ("trace", "trace grads"), ("retain_grad", "trace grads"),
            ("native", "trace grads")]
    if cfg["paths"] == "both":
        plan += [("trace c", "trace grads c"), ("trace py", "trace grads py"), ("trace grads py", "trace grads")]
    results = {}
    for a, b in plan:
        results[(a, b)] = measure_overhead((a, fns[a]), (b, fns[b]), pairs=cfg["pairs"], repeats=cfg["repeats"],
                                           predicate=cfg["predicate"])
        print(f"  {name}: {results[(a, b)]}", flush=True)
    return {"name": name, "ops": count_ops(model, args), "results": results}


def per_op(result, ops):
    median = result.delta_ns / ops / 1e3 if result.delta_ns is not None else None
    floor = result.delta_floor_ns / ops / 1e3 if result.delta_floor_ns is not None else None
    return median, floor


def verdict(value, floor, limit) -> str:
    if value is not None and limit is not None:
        return "met" if value <= limit else "MISSED"
    if floor is not None and limit is not None and floor > limit:
        return "MISSED (floor)"
    return "not established (refused)"


def _us(value, floor) -> str:
    if value is not None:
        return f"{value:.1f}"
    return f">= {floor:.1f}" if floor is not None else "-"


def markdown(rows, command) -> str:
    lines = ["| model | ops | native fwd+bwd us | retain_grad / bare | trace grads / trace | "
             "trace grads / retain_grad | trace grads / native | retain_grad +us/op | grad capture +us/op | "
             "target retain_grad + 2 |",
             "|---" * 10 + "|"]
    for row in rows:
        r, ops = row["results"], row["ops"]
        retain, retain_floor = per_op(r[("bare", "retain_grad")], ops)
        grads, grads_floor = per_op(r[("trace", "trace grads")], ops)
        limit = retain + SLACK_US if retain is not None else None
        lines.append(
            f"| {MODELS[row['name']][0]} | {ops} | {r[('native', 'trace grads')].a_ns / 1e3:.0f} | "
            + " | ".join(r[k].cell() for k in [("bare", "retain_grad"), ("trace", "trace grads"),
                                                 ("retain_grad", "trace grads"), ("native", "trace grads")])
            + f" | {_us(retain, retain_floor)} | {_us(grads, grads_floor)} | {verdict(grads, grads_floor, limit)}"
            + (f" (<= {limit:.1f})" if limit is not None else "") + " |")
    fp = rows[0]["results"][("bare", "retain_grad")].fingerprint if rows else {}
    lines += machine_footer(fp, command)
    return "\n".join(lines)


def _quartiles_us(result, ops) -> str:
    """The paired ratios' quartiles as added us/op (against the A arm's median time)."""
    if len(result.ratios) < 4:
        return "-"
    q1, _, q3 = statistics.quantiles(result.ratios, n=4)
    return f"[{(q1 - 1) * result.a_ns / ops / 1e3:.1f}, {(q3 - 1) * result.a_ns / ops / 1e3:.1f}]"


def paths_markdown(rows) -> str:
    """Gradient capture's added cost per op on each path, side by side (``--paths both``)."""
    lines = ["| model | ops | retain_grad +us/op | grad capture +us/op, C++ hooks [Q1, Q3] | "
             "grad capture +us/op, C hooks [Q1, Q3] | grad capture +us/op, pure Python [Q1, Q3] | "
             "trace grads C++ hooks / pure | target retain_grad + 2 |",
             "|---" * 8 + "|"]
    for row in rows:
        r, ops = row["results"], row["ops"]
        retain, retain_floor = per_op(r[("bare", "retain_grad")], ops)
        limit = retain + SLACK_US if retain is not None else None
        cells = []
        for key in [("trace", "trace grads"), ("trace c", "trace grads c"), ("trace py", "trace grads py")]:
            value, floor = per_op(r[key], ops)
            cells.append(f"{_us(value, floor)} {_quartiles_us(r[key], ops)} {verdict(value, floor, limit)}")
        lines.append(f"| {MODELS[row['name']][0]} | {ops} | {_us(retain, retain_floor)} | " + " | ".join(cells)
                     + f" | {r[('trace grads py', 'trace grads')].cell()} | "
                     + (f"<= {limit:.1f}" if limit is not None else "-") + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="7 pairs of 3 blocks per cell, not 15 of 5")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--no-docs", action="store_true", help=f"print only; do not rewrite {DOC}")
    parser.add_argument("--json", help="also write every measurement as JSON here")
    parser.add_argument("--paths", choices=("current", "both"), default="current",
                        help="both: the traced arms on the compiled and on the pure-Python path, side by side")
    opts = parser.parse_args(argv)
    if opts.paths == "both":
        from torchlens.capture import accel

        if accel.compiled("_grads") is None:
            parser.error("--paths both needs torchlens-accel built (accel/) and TORCHLENS_ACCEL unset")
    torch.set_num_threads(opts.threads)
    pairs, repeats = (7, 3) if opts.quick else (15, 5)
    cfg = {"pairs": pairs, "repeats": repeats, "paths": opts.paths,
           "predicate": RefusalPredicate(min_pairs=pairs, max_relative_iqr=0.25)}
    rows = [measure_row(name, cfg) for name in opts.models.split(",")]
    command = "python benchmarks/grad_overhead.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    text = markdown(rows, command)
    if opts.paths == "both":
        text += "\n\nGradient capture per op on each path:\n\n" + paths_markdown(rows)
    print(text)
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump([{"name": r["name"], "ops": r["ops"],
                        "results": {f"{a} -> {b}": v.to_dict() for (a, b), v in r["results"].items()}}
                       for r in rows], fh, indent=1)
    if not opts.no_docs:
        write_section("grads", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
