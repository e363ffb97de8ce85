"""What each change to building the record saves: the pieces of ``finalize``, before and after, on one state.

Each row is traced once by the package under test with finalize intercepted (``finalize_cost.py``); then
each piece is timed on that same captured state, by this revision's code and by another revision's
(``--baseline PATH``, a ``src/torchlens`` imported side by side), in alternating blocks, fastest block
of each.  The pieces:

    eager part      what finalize still does when the forward ends (this revision) against the whole
                    eager finalize before (every column, module record and label)
    param addresses parameter addresses per op
    module records  ModuleCall / Module records (now derived on first read)
    op columns      kinds, parents, module calls, in-place flags, metadata (now derived on first read)
    pass groups     ``labels.passes.group_ops``
    names, labels   function names and types; the labels from the groups

Run:  python benchmarks/finalize_levers.py --baseline /path/to/src/torchlens [--rows chain200,gpt2_2]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finalize_cost import build  # noqa: E402
from models import baseline_package  # noqa: E402


def captured_state(package, model, args) -> tuple:
    """The arguments ``tl.trace`` handed ``finalize`` for one trace of ``model``."""
    session = sys.modules[package.__name__ + ".capture.session"]
    real, kept = session.finalize, {}

    def keep(*a):
        kept["a"] = a
        return real(*a)

    session.finalize = keep
    try:
        package.trace(model, args, save="all")
    finally:
        session.finalize = real
    return kept["a"]


def fastest_pair(before, after, n: int, rounds: int = 7) -> tuple:
    """(before us, after us): fastest block of each, blocks alternating ABBA, the collector paused
    within a block (and run between blocks, so that no block inherits another's garbage)."""
    times = {before: [], after: []}
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            for fn in (before, after, after, before):
                gc.collect()
                start = time.perf_counter_ns()
                for _ in range(n):
                    fn()
                times[fn].append((time.perf_counter_ns() - start) / n / 1e3)
    finally:
        if collecting:
            gc.enable()
    return min(times[before]), min(times[after])


def pieces(this, base, state, model, output, name, timings, index) -> dict:
    """name -> (before, after) zero-argument callables over one captured state."""
    fin, old = sys.modules[this.__name__ + ".record.finalize"], sys.modules[base.__name__ + ".record.finalize"]
    calls, records = state.calls, state.records
    trace = fin.finalize(state, model, output, name, timings, index)
    raw = trace._raw
    trace._kind  # the columns, which every later piece reads
    call_col = trace._call
    old_modules = lambda: old._build_modules(state, index)  # noqa: E731
    module_calls, modules = old_modules()
    counts = {id(m._ref): m.num_calls for m in modules}
    objects = [mc.module._ref for mc in module_calls]
    group_args = (call_col, trace._slot, trace._module_call, trace._parents, trace._meta, calls, objects, counts)
    old_groups = sys.modules[base.__name__ + ".labels.passes"].group_ops
    new_groups = sys.modules[this.__name__ + ".labels.passes"].group_ops
    group = new_groups(*group_args)
    types = old._names(trace._kind, call_col, calls)[1]

    def old_columns():  # the eager column passes of the baseline's finalize, as written there
        raw_calls = [r[0] for r in records]
        col = [c if c >= 0 else -1 for c in raw_calls]
        [c for c in raw_calls]
        [r[1] if r[0] >= 0 else None for r in records]
        [calls[c][3] if c >= 0 else () for c in col]
        [calls[c][5] if c >= 0 else -1 for c in col]
        writes = old._receiver_writes()
        [c >= 0 and calls[c][12] and writes(calls[c]) for c in col]
        {i: r[1] for i, r in enumerate(records) if r[0] < 0}
        distinct: dict = {}
        [distinct.get(m) or distinct.setdefault(m, old.OpMeta._make(m)) for m in (r[2:] for r in records)]

    def new_columns():
        raw.records, raw.outputs = records, []
        raw.columns(trace)

    return {
        "eager part": (lambda: old.finalize(state, model, output, name, timings, index),
                       lambda: fin.finalize(state, model, output, name, timings, index)),
        "param addresses": (lambda: old._param_addresses(calls, call_col, index),
                            lambda: fin._param_addresses(calls, index)),
        "module records": (old_modules, lambda: raw.modules(trace)),
        "op columns": (old_columns, new_columns),
        "pass groups": (lambda: old_groups(*group_args), lambda: new_groups(*group_args)),
        "names": (lambda: old._names(trace._kind, call_col, calls),
                  lambda: fin._names(trace._kind, call_col, calls, trace._io)),
        "labels": (lambda: old._label(trace._kind, types, group), lambda: fin._label(trace._kind, types, group)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="one_op,chain200,mlp3,mlp40,gpt2_2,resnet,identity100")
    parser.add_argument("--baseline", required=True, help="another revision's src/torchlens")
    parser.add_argument("--calls", type=int, default=100, help="calls per timed block")
    options = parser.parse_args()
    torch.set_num_threads(1)
    import torchlens

    base = baseline_package(options.baseline)
    table = {}
    for name in options.rows.split(","):
        model, args = build(name)
        captured = captured_state(torchlens, model, args)
        for piece, (before, after) in pieces(torchlens, base, *captured).items():
            table.setdefault(piece, {})[name] = fastest_pair(before, after, options.calls)
        print(f"  {name} done", flush=True)
    rows = options.rows.split(",")
    print("| piece | " + " | ".join(f"{r} before -> after us (saved)" for r in rows) + " |")
    print("|---" * (1 + len(rows)) + "|")
    for piece, cells in table.items():
        print(f"| {piece} | " + " | ".join(f"{b:.1f} -> {a:.1f} ({b - a:.1f})" for b, a in (cells[r] for r in rows))
              + " |")
    print(f"\nFastest of 7 ABBA quartets of {options.calls} calls; torch {torch.__version__}, 1 thread, "
          f"load {tuple(round(v, 2) for v in os.getloadavg())}.")


if __name__ == "__main__":
    main()
