"""Where gradient capture's cost per op goes: adding a hook, calling it in the backward, removing it.

Outside any trace, a chain of ``N`` differentiable ops (``x * 1.0001``, outputs not kept: as with
``save="none"``) is run with one arm per way of keeping every output's gradient, and the forward, the
backward and the clean-up are timed apart, in interleaved rounds in one process (each arm keeps its
fastest of ``--blocks`` runs per round, part by part):

    none          nothing (the reference every other arm is a difference to)
    retain_grad   ``t.retain_grad()`` per output (keeps nothing here: the outputs die in the forward)
    noop hook     a C callable returning None in each tensor's hook dict (torch's own cost of a
                  Python tensor hook: the hook dict, its registration and the call per backward)
    python        ``GradCapture`` on the pure-Python path (``accel.use(False)``)
    c hooks       ``GradCapture`` with torchlens-accel's ``_grads`` (C callables torch calls as Python hooks)
    c++ hooks     ``GradCapture`` with torchlens-accel's ``_autograd`` (autograd C++ hooks, as retain_grad's)

Reported per op, in microseconds over ``none``: medians over rounds and their quartiles.  Run:

    python benchmarks/grad_hooks.py [--rounds 21] [--blocks 3] [--ops 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import OrderedDict

import torch


def _chain(x, n: int, per_output) -> torch.Tensor:
    for i in range(n):
        x = x * 1.0001
        per_output(i, x)
    return x


def _arm(name: str, n: int):
    """A callable timing one round: (forward, backward, clean-up) in ns per op."""
    from torchlens.capture import accel
    from torchlens.capture.grads import GradCapture

    x0 = torch.randn(4, requires_grad=True)
    noop = set().discard  # a C callable returning None

    def noop_hook(i, t):
        hooks = t._backward_hooks = OrderedDict()
        t.grad_fn._register_hook_dict(t)
        hooks[-1 - i] = noop

    def run():
        capture = None
        if name == "none":
            per_output = lambda i, t: None  # noqa: E731
        elif name == "retain_grad":
            per_output = lambda i, t: t.retain_grad()  # noqa: E731
        elif name == "noop hook":
            per_output = noop_hook
        else:
            previous = accel.use(name != "python")
            try:
                with accel.without(*(("_autograd",) if name == "c hooks" else ())):  # the C hooks serve
                    capture = GradCapture()
            finally:
                accel.use(previous)
            per_output = capture.watch
        t0 = time.perf_counter_ns()
        y = _chain(x0, n, per_output)
        t1 = time.perf_counter_ns()
        y.sum().backward()
        t2 = time.perf_counter_ns()
        if capture is not None:
            capture.remove_hooks()
            capture.release_grads()
        del y
        t3 = time.perf_counter_ns()
        return (t1 - t0) / n, (t2 - t1) / n, (t3 - t2) / n

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--blocks", type=int, default=3, help="runs per arm per round (the fastest is kept)")
    parser.add_argument("--ops", type=int, default=2000)
    opts = parser.parse_args(argv)
    from torchlens.capture import accel

    names = ["none", "retain_grad", "noop hook", "python"]
    previous = accel.use(True)
    for module, arm in (("_grads", "c hooks"), ("_autograd", "c++ hooks")):
        if accel.compiled(module) is not None:
            names.append(arm)
        else:
            print(f"torchlens-accel's {module} is not built: the {arm} arm is left out", file=sys.stderr)
    accel.use(previous)
    torch.set_num_threads(1)
    arms = {name: _arm(name, opts.ops) for name in names}
    rounds = {name: [] for name in names}
    for r in range(opts.rounds + 2):
        for name in (names if r % 2 else names[::-1]):
            runs = [arms[name]() for _ in range(opts.blocks)]
            times = tuple(min(run[part] for run in runs) for part in range(3))
            if r >= 2:  # two warm-up rounds
                rounds[name].append(times)
    base = rounds["none"]
    print(f"{opts.ops} ops, {opts.rounds} rounds; us per op over 'none': median [Q1, Q3]\n")
    print("| arm | forward | backward | clean-up | total |")
    print("|---|---|---|---|---|")
    for name in names[1:]:
        cells = []
        for part in range(4):
            deltas = [(sum(t[:3]) - sum(b[:3])) / 1e3 if part == 3 else (t[part] - b[part]) / 1e3
                      for t, b in zip(rounds[name], base)]
            q1, med, q3 = statistics.quantiles(deltas, n=4)
            cells.append(f"{med:.2f} [{q1:.2f}, {q3:.2f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
