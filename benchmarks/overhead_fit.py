"""Split ``tl.trace``'s added time into a fixed cost, a cost per op and a cost per module call.

Each row is a model at a small input shape (kernels cheap, so interposition cost dominates), in sizes
that grow in ops and in module calls separately: elementwise chains (ops, no module calls), stacks of
``nn.Identity`` (module calls, no ops), and MLPs, Python-loop RNNs, GPT-2-style stacks, a ResNet-like CNN
and a TransformerEncoder of growing depth (both).  Per repeat, every row is timed in ABBA order in one
process (three quartets of native block, traced block, traced block, native block; each block a few
calls), its added time per trace is the traced arm's fastest block minus the native arm's fastest, and the
repeat's added times over all rows are fitted by least squares, weighted by each row's traced time
(relative residuals), as

    added_us = fixed + per_op * ops + per_call * module_calls

The coefficients are reported as medians with quartiles over repeats; each arm keeps its fastest block of a
repeat.  The machine is shared and noisy, so only those medians (and the per-row medians beside them) mean
anything.  The minimal recorder mode of ``models.py`` is fitted the same way, as the floor of recording.  Run:

    python benchmarks/overhead_fit.py [--repeats 15] [--arms trace,none,read,recorder] [--no-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import (GPT2Stack, LoopRNN, MLP, ElementwiseChain, SmallResNet, baseline_package,  # noqa: E402
                    native_arm, recorder_arm, trace_arm)
from overhead_matrix import write_section  # noqa: E402

BLOCK_S = 0.0015  # target length of one timed block of the traced arm
QUARTETS = 3  # ABBA quartets per row, arm and repeat


def _transformer(layers: int):
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _identities(n: int):
    return nn.Sequential(*[nn.Identity() for _ in range(n)])


def _randn(*shape):
    return lambda g: (torch.randn(*shape, generator=g),)


# name -> (builder, input factory).  Sizes grow so that ops and module calls vary independently, but
# every traced call stays under about 3 ms: on a loaded host a longer call is always preempted once
# (a 4 ms scheduler slice) and its fastest block no longer shows its own cost.
ROWS = {
    "chain8": (lambda: ElementwiseChain(2), _randn(64)),
    "chain50": (lambda: ElementwiseChain(12), _randn(64)),
    "chain100": (lambda: ElementwiseChain(25), _randn(64)),
    "chain200": (lambda: ElementwiseChain(50), _randn(64)),
    "identity10": (lambda: _identities(10), _randn(64)),
    "identity100": (lambda: _identities(100), _randn(64)),
    "mlp3": (lambda: MLP(3, 64), _randn(32, 64)),
    "mlp10": (lambda: MLP(10, 64), _randn(32, 64)),
    "mlp40": (lambda: MLP(40, 64), _randn(32, 64)),
    "loop_rnn4": (lambda: LoopRNN(64, 4), _randn(1, 64)),
    "loop_rnn32": (lambda: LoopRNN(64, 32), _randn(1, 64)),
    "resnet": (lambda: SmallResNet((8, 16, 32)), _randn(1, 3, 16, 16)),
    "transformer1": (lambda: _transformer(1), _randn(1, 16, 64)),
    "transformer2": (lambda: _transformer(2), _randn(1, 16, 64)),
    "gpt2_1": (lambda: GPT2Stack(512, 64, 4, 1, 32), lambda g: (torch.randint(0, 512, (1, 16), generator=g),)),
    "gpt2_2": (lambda: GPT2Stack(512, 64, 4, 2, 32), lambda g: (torch.randint(0, 512, (1, 16), generator=g),)),
}
def read_arm(model, args, package=None):
    """``tl.trace(save="all")`` and a first read of every derived column (labels, ops, module calls): the
    record is built on first read, so this arm shows what a trace costs once it is looked at."""
    if package is None:
        import torchlens as package
    tl = package

    def traced_and_read():
        log = tl.trace(model, args)
        log.labels, log.ops, log.module_calls, log.modules
        return log.output
    return traced_and_read


ARMS = {"trace": lambda m, a: trace_arm(m, a, save="all"), "none": lambda m, a: trace_arm(m, a, save="none"),
        "read": read_arm, "recorder": recorder_arm}
ARM_TITLES = {"trace": 'tl.trace (save="all")', "none": 'tl.trace (save="none")',
              "read": 'tl.trace (save="all") + first read', "recorder": "recorder floor"}


def add_pure_arms() -> None:
    """The package under test on the compiled hot path (``trace``, ``none``) and on the pure-Python path
    (``trace_pure``, ``none_pure``), side by side in this process."""
    import torchlens

    ARMS["trace"] = lambda m, a: trace_arm(m, a, compiled=True, save="all")
    ARMS["none"] = lambda m, a: trace_arm(m, a, compiled=True, save="none")
    ARMS["trace_pure"] = lambda m, a: trace_arm(m, a, package=torchlens, compiled=False, save="all")
    ARMS["none_pure"] = lambda m, a: trace_arm(m, a, package=torchlens, compiled=False, save="none")
    ARM_TITLES["trace"], ARM_TITLES["none"] = ARM_TITLES["trace"] + " compiled", ARM_TITLES["none"] + " compiled"
    ARM_TITLES["trace_pure"] = 'tl.trace (save="all") pure Python'
    ARM_TITLES["none_pure"] = 'tl.trace (save="none") pure Python'


def add_baseline_arms(path: str) -> None:
    """Arms tracing with another revision's package (``models.baseline_package``), beside this one's."""
    base = baseline_package(path)
    ARMS["trace_base"] = lambda m, a: trace_arm(m, a, package=base, save="all")
    ARMS["none_base"] = lambda m, a: trace_arm(m, a, package=base, save="none")
    ARMS["read_base"] = lambda m, a: read_arm(m, a, package=base)
    ARM_TITLES["read_base"] = ARM_TITLES["read"] + " before"
    ARM_TITLES["trace_base"] = 'tl.trace (save="all") before'
    ARM_TITLES["none_base"] = 'tl.trace (save="none") before'
    # Picked only with --pure (its arms are then listed): the baseline on its pure-Python path too.
    ARMS["trace_pure_base"] = lambda m, a: trace_arm(m, a, package=base, compiled=False, save="all")
    ARMS["none_pure_base"] = lambda m, a: trace_arm(m, a, package=base, compiled=False, save="none")
    ARM_TITLES["trace_pure_base"] = 'tl.trace (save="all") pure Python before'
    ARM_TITLES["none_pure_base"] = 'tl.trace (save="none") pure Python before'


def build(name: str):
    builder, inputs = ROWS[name]
    torch.manual_seed(0)
    return builder().eval(), inputs(torch.Generator().manual_seed(1))


def counts(model, args) -> tuple:
    """(ops, module calls) of one trace of the row."""
    import torchlens as tl

    t = tl.trace(model, args, save="none")
    return sum(1 for op in t.ops if op.kind == "op"), len(t.module_calls)


def _block(fn, n: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - start) / n / 1e3


def calls_per_block(fn) -> int:
    fn()
    one = min(_block(fn, 1) for _ in range(3))
    return max(1, int(BLOCK_S * 1e6 / max(one, 1.0)))


def abba_added_us(native, arm, n: int, quartets: int = QUARTETS) -> tuple:
    """(native us, added us) per call from ``quartets`` ABBA quartets of blocks of ``n`` calls.

    Each arm keeps its fastest block: a burst of load from other processes lengthens some blocks of
    either arm, never shortens one, so the fastest blocks of interleaved arms are the fair pair."""
    natives, arms = [], []
    for _ in range(quartets):
        natives.append(_block(native, n))
        arms.append(_block(arm, n))
        arms.append(_block(arm, n))
        natives.append(_block(native, n))
    base = min(natives)
    return base, min(arms) - base


def fit(rows: list, added: list, scale: list) -> tuple:
    """Weighted least-squares (fixed, per_op, per_call) of ``added`` over rows' (ops, calls).

    Each row's equation is divided by ``scale`` (its traced time): noise grows with a row's length, and
    unweighted, the longest rows would decide the fixed cost that only the shortest can show."""
    design = torch.tensor([[1.0 / w, ops / w, calls / w] for (ops, calls), w in zip(rows, scale)],
                          dtype=torch.float64)
    target = torch.tensor([y / w for y, w in zip(added, scale)], dtype=torch.float64).unsqueeze(1)
    solution = torch.linalg.lstsq(design, target).solution.squeeze(1)
    return tuple(float(v) for v in solution)


def quartiles(values: list) -> tuple:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def measure(names: list, arms: list, repeats: int) -> dict:
    built = {name: build(name) for name in names}
    shape = {name: counts(*built[name]) for name in names}
    natives = {name: native_arm(*built[name]) for name in names}
    armed = {(arm, name): ARMS[arm](*built[name]) for arm in arms for name in names}
    sizes = {key: calls_per_block(fn) for key, fn in armed.items()}
    added = {key: [] for key in armed}
    native_us = {name: [] for name in names}
    for r in range(repeats):
        for name in names:
            for arm in arms:
                base, extra = abba_added_us(natives[name], armed[(arm, name)], sizes[(arm, name)])
                added[(arm, name)].append(extra)
                native_us[name].append(base)
        print(f"  repeat {r + 1}/{repeats} done", flush=True)
    fits = {}
    for arm in arms:
        scale = [statistics.median(native_us[n]) + max(statistics.median(added[(arm, n)]), 0.0) for n in names]
        fits[arm] = [fit([shape[n] for n in names], [added[(arm, n)][r] for n in names], scale)
                     for r in range(repeats)]
    return {"names": names, "arms": arms, "shape": shape, "added": added, "native": native_us, "fits": fits,
            "repeats": repeats}


def markdown(result: dict, command: str) -> str:
    names, arms, shape = result["names"], result["arms"], result["shape"]
    lines = ["| arm | fixed us per trace | per op us | per module call us |", "|---|---|---|---|"]
    for arm in arms:
        cells = []
        for k in range(3):
            q1, q2, q3 = quartiles([f[k] for f in result["fits"][arm]])
            cells.append(f"{q2:.1f} [{q1:.1f}, {q3:.1f}]")
        lines.append(f"| {ARM_TITLES[arm]} | " + " | ".join(cells) + " |")
    lines += ["", "| row | ops | module calls | native us | "
              + " | ".join(f"{ARM_TITLES[a]} added us (per op)" for a in arms) + " |",
              "|---" * (4 + len(arms)) + "|"]
    for name in names:
        ops, calls = shape[name]
        cells = []
        for arm in arms:
            median = statistics.median(result["added"][(arm, name)])
            cells.append(f"{median:.0f} ({median / max(ops, 1):.1f})")
        lines.append(f"| {name} | {ops} | {calls} | {statistics.median(result['native'][name]):.0f} | "
                     + " | ".join(cells) + " |")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    lines += ["", f"Fit per repeat over all rows, medians [quartiles] of {result['repeats']} repeats; per-row "
              "cells are medians of the added time per trace over native (added per op in parentheses). "
              f"torch {torch.__version__}, {torch.get_num_threads()} torch thread(s), {os.cpu_count()} CPUs, "
              f"load {tuple(round(v, 2) for v in load) if load else '?'}; measured {time.strftime('%Y-%m-%d')}. "
              "The host is shared with other jobs: read medians and ratios, not single figures.",
              "", "Command:", "", "```text", command, "```"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset")
    parser.add_argument("--arms", default="trace,none,read,recorder", help=f"comma-separated subset of {list(ARMS)}")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline", help="another revision's src/torchlens directory: adds its tl.trace "
                                           "arms (trace_base, none_base), side by side in this process")
    parser.add_argument("--pure", action="store_true", help="time the trace and none arms on the compiled "
                                                             "hot path and again on the pure-Python path")
    parser.add_argument("--section", default="fit", help="the generated section of docs/overhead.md to rewrite")
    parser.add_argument("--no-docs", action="store_true")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    torch.backends.mha.set_fastpath_enabled(False)  # same ops natively and under a mode
    arms = opts.arms.split(",")
    if opts.pure:
        add_pure_arms()
        arms = [a for arm in arms for a in (arm, f"{arm}_pure") if a in ARMS]
    if opts.baseline:
        add_baseline_arms(os.path.abspath(opts.baseline))
        arms = [a for arm in arms for a in (arm, f"{arm}_base") if a in ARMS]
    with torch.no_grad():
        result = measure(opts.rows.split(","), arms, opts.repeats)
    command = "python benchmarks/overhead_fit.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    text = markdown(result, command)
    print(text)
    if not opts.no_docs:
        write_section(opts.section, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
