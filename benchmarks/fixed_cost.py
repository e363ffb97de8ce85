"""What one ``tl.trace`` costs beyond the forward itself: a 1-op model, this revision beside another.

The model is ``forward: return x + 1`` on ``randn(4)`` (eval, no_grad), so the time a trace adds is
almost all fixed cost per trace: setting capture up, tearing it down and building the ``Trace``.  Per
repeat, the native forward, this package's ``tl.trace`` and (with ``--baseline``) another revision's
are timed in ABBA blocks in one process; each arm keeps its fastest block.  Reported: medians
[quartiles] over repeats of the time per trace, the time added over native, and the ratio of the two
revisions' added times.

``--steps`` also times the driver's set-up steps one by one, each beside the baseline's same step, in
the same process (a step that exists in one revision only is shown for that one).  Run:

    python benchmarks/fixed_cost.py --baseline /path/to/other/src/torchlens [--repeats 15] [--steps]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import MLP, SmallResNet, baseline_package  # noqa: E402


class OneOp(torch.nn.Module):
    def forward(self, x):
        return x + 1


def _block(fn, n: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - start) / n / 1e3


def _quartiles(values: list) -> tuple:
    if len(values) < 2:
        return values[0], values[0], values[0]
    return tuple(statistics.quantiles(values, n=4, method="inclusive"))


def _cell(values: list) -> str:
    q1, q2, q3 = _quartiles(values)
    return f"{q2:.1f} [{q1:.1f}, {q3:.1f}]"


def interleaved(arms: dict, repeats: int, n: int) -> dict:
    """Per arm, the fastest block of each repeat (ABBA order over the arms, twice per repeat)."""
    best = {name: [] for name in arms}
    names = list(arms)
    for _ in range(repeats):
        times = {name: [] for name in names}
        for order in (names, names[::-1], names, names[::-1]):
            for name in order:
                times[name].append(_block(arms[name], n))
        for name in names:
            best[name].append(min(times[name]))
    return best


def trace_arms(model, x, packages: dict) -> dict:
    arms = {"native": lambda: model(x)}
    for label, tl in packages.items():
        arms[label] = lambda tl=tl: tl.trace(model, x)
    return arms


def step_arms(model, x, package, wide, deep) -> dict:
    """The driver's set-up and teardown steps of ``package``, each a zero-argument callable (``wide``: a
    model with many parameters, ``deep`` one with many modules, for the steps whose cost grows with them)."""
    def part(name):
        return sys.modules[f"{package.__name__}.{name}"]

    session, state_mod, teardown = part("capture.session"), part("capture.state"), part("capture.teardown")
    fastpath, progress, model_index = part("capture.fastpath"), part("progress"), part("record.model_index")
    mode_mod, modules, compiled = part("capture.mode"), part("capture.modules"), part("capture.compiled")
    index = model_index.index_of(model)
    wide_index = model_index.index_of(wide)
    model_index.index_of(deep)

    def state():
        return state_mod.CaptureState(save_mode=1, buffers=index.buffers)

    # The input records: capture/inputs.py's add_inputs, or (an older revision) the driver's _add_inputs.
    inputs_mod = sys.modules.get(f"{package.__name__}.capture.inputs")
    add_inputs = getattr(inputs_mod, "add_inputs", None) or session._add_inputs

    def inputs():
        add_inputs(state(), model, (x,), {})

    probe = state()
    frames = session.FrameClassifier(stop_codes=(session._run_forward.__code__,))
    mode = mode_mod.CaptureMode(probe, frames)

    def mode_stack():
        installed = teardown.ModeOnStack(mode)
        installed.__enter__()
        installed.__exit__(None, None, None)

    def shim():
        part = fastpath.FastPathShim(mode)
        part.__enter__()
        part.__exit__(None, None, None)

    def tracker():
        """The module call tracker alone: ``_call_impl`` replaced and restored, no forward."""
        part = modules.ModuleCallTracker(probe, model, frames, module_types=(type(model),))
        part.__enter__()
        part.__exit__(None, None, None)

    def capture_block(traced=model, x=x, index=index):
        """Enter every part, run the forward, tear down: as the driver does it (with a fresh state)."""
        fresh = state_mod.CaptureState(save_mode=1, buffers=index.buffers)
        mode = mode_mod.CaptureMode(fresh, frames)
        parts = (compiled.CompiledSubmodules(traced, "run", None, ()), fastpath.FastPathShim(mode),
                 modules.ModuleCallTracker(fresh, traced, frames), teardown.ModeOnStack(mode))
        if hasattr(teardown, "Capture"):
            with teardown.Capture(parts):
                session._run_forward(traced, (x,), {})
            return
        try:  # the driver before teardown.Capture: a with statement, then every exit once more
            with parts[0], parts[1], parts[2], parts[3]:
                session._run_forward(traced, (x,), {})
        finally:
            session._tear_down(parts)

    def keyword_hop():
        """``tl.trace``'s own call path down to ``_trace`` (stubbed for the measurement)."""
        return session.trace(model, x)

    def finalize_of(traced, x):
        """``finalize`` of one trace of ``traced``, as a zero-argument callable (its arguments kept)."""
        real, kept = session.finalize, []
        session.finalize = lambda *args: kept.append(args) or real(*args)
        try:
            package.trace(traced, x)
        finally:
            session.finalize = real
        return lambda: real(*kept[0])

    deep_index = model_index.index_of(deep)
    deep_buffers = [b for b, _ in deep_index.buffers.values()]
    deep_x = torch.randn(1, 3, 16, 16)

    def deep_forward():
        """The ResNet-like forward alone (the capture block below adds capture to it)."""
        deep(deep_x)

    def buffer_sources():
        """A fresh state, then every buffer of ``deep`` read once (each becomes a source record)."""
        fresh = state_mod.CaptureState(save_mode=1, buffers=deep_index.buffers)
        for b in deep_buffers:
            fresh.producer_of(b)

    save_policy = part("capture.saving").SavePolicy
    # A revision whose policy takes the model's index finds module addresses there; an older one walks.
    with_index = "index" in inspect.signature(save_policy).parameters

    def selection():
        """A save= selection naming modules and an op type, on ``deep`` (as ``_trace`` makes it)."""
        names = ["blocks.0", "conv2d"]
        return save_policy(names, deep, deep_index) if with_index else save_policy(names, deep)

    # The watched parameters: given to the constructor, or (an older revision) by watch_params after it.
    if "params" in inspect.signature(state_mod.CaptureState).parameters:
        def watched_state():
            return state_mod.CaptureState(save_mode=1, params=wide_index.params)
    else:
        def watched_state():
            state_mod.CaptureState(save_mode=1).watch_params(wide_index.params)
    checked = state()
    add_inputs(checked, model, (x,), {})
    # What the driver looks through (torch.compile, DDP): capture/wrappers.py, or (an older revision) the driver's.
    wrappers = sys.modules.get(f"{package.__name__}.capture.wrappers")
    unwrap = wrappers.unwrap if wrappers is not None else session._unwrap
    steps = {
        "trace() down to _trace (stubbed)": keyword_hop,
        "CaptureState() watching 20 parameters": watched_state,
        "capture block: enter, forward, teardown": capture_block,
        "unwrap": lambda: unwrap(model),
        "index_of (cached)": lambda: model_index.index_of(model),
        "index_of (cached), ResNet-like, 43 modules": lambda: model_index.index_of(deep),
        "CaptureState()": state,
        "CaptureState() + add_inputs": inputs,
        "FrameClassifier()": lambda: session.FrameClassifier(stop_codes=(session._run_forward.__code__,)),
        "mode push + pop (ModeOnStack)": mode_stack,
        "fast-path shim enter + exit": shim,
        "module call tracker enter + exit": tracker,
        "check_saved_versions, one saved input": checked.check_saved_versions,
        "SavePolicy('all')": lambda: part("capture.saving").SavePolicy("all", model),
        f"CaptureState() + {len(deep_buffers)} buffer sources, ResNet-like": buffer_sources,
        "SavePolicy(['blocks.0', 'conv2d']), ResNet-like": selection,
        "finalize, the one-op model": finalize_of(model, x),
        "finalize, ResNet-like (52 ops, 42 module calls, 47 parameters)": finalize_of(deep, torch.randn(1, 3, 16, 16)),
        # Capture's effect on the forward itself (a class attribute written per trace would make every
        # module class's attribute lookups miss once, in the forward and after it).
        "forward alone, ResNet-like (7 module classes)": deep_forward,
        "capture block, ResNet-like": lambda: capture_block(deep, deep_x, deep_index),
    }
    if hasattr(compiled, "DynamoCompiles"):  # a revision that watches Dynamo's compiles during a trace
        def compile_watch():
            """The part that steps module-call recording aside while Dynamo compiles (a torch.cond body)."""
            part = compiled.DynamoCompiles(probe)
            part.__enter__()
            part.__exit__(None, None, None)
        steps["Dynamo compile watch enter + exit"] = compile_watch
    accel = sys.modules.get(f"{package.__name__}.capture.accel")
    if accel is not None and accel.compiled("_index") is not None:  # the compiled check is in use: time both
        deep_python, previous = copy.deepcopy(deep), accel.use(False)
        try:
            model_index.index_of(deep_python)
        finally:
            accel.use(previous)
        steps["index_of (cached), ResNet-like, 43 modules, pure-Python check"] = \
            lambda: model_index.index_of(deep_python)
    if hasattr(progress, "shows_bar"):
        steps["progress bar check"] = lambda: progress.shows_bar(None) and progress.bar(None, "x")
    else:
        steps["progress bar check"] = lambda: progress.bar(None, "x")
    return steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="another revision's src/torchlens directory, traced beside this one")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=300, help="traces per timed block")
    parser.add_argument("--steps", action="store_true", help="also time the driver's steps one by one")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    import torchlens

    packages = {"this": torchlens}
    if opts.baseline:
        packages["baseline"] = baseline_package(os.path.abspath(opts.baseline))
    model, x = OneOp().eval(), torch.randn(4)
    with torch.no_grad():
        for tl in packages.values():
            tl.trace(model, x)  # first traces: imports and caches
        best = interleaved(trace_arms(model, x, packages), opts.repeats, opts.calls)
        added = {k: [b - n for b, n in zip(v, best["native"])] for k, v in best.items() if k != "native"}
        print("| arm | us per trace | added over native us |")
        print("|---|---|---|")
        print(f"| native forward | {_cell(best['native'])} | - |")
        for label in added:
            print(f"| tl.trace ({label}) | {_cell(best[label])} | {_cell(added[label])} |")
        if "baseline" in added:
            ratios = [a / b for a, b in zip(added["this"], added["baseline"])]
            q1, q2, q3 = _quartiles(ratios)
            print(f"\nadded time, this / baseline: {q2:.2f} [{q1:.2f}, {q3:.2f}] (median [quartiles])")
        if opts.steps:
            torch.manual_seed(0)
            wide, deep = MLP(10, 8), SmallResNet((8, 16, 32)).eval()
            steps = {label: step_arms(model, x, tl, wide, deep) for label, tl in packages.items()}
            names = list(dict.fromkeys(name for s in steps.values() for name in s))
            print("\n| step | " + " | ".join(f"{label} us" for label in steps) + " |")
            print("|---" * (1 + len(steps)) + "|")
            stubbed = [sys.modules[f"{tl.__name__}.capture.session"] for tl in packages.values()]
            for name in names:
                arms = {label: s[name] for label, s in steps.items() if name in s}
                real = [session._trace for session in stubbed]
                if name.endswith("(stubbed)"):
                    for session in stubbed:
                        session._trace = lambda *args, **kwargs: None
                try:
                    timed = interleaved(arms, opts.repeats, opts.calls * 2)
                finally:
                    for session, run in zip(stubbed, real):
                        session._trace = run
                cells = [_cell(timed[label]) if label in timed else "-" for label in steps]
                print(f"| {name} | " + " | ".join(cells) + " |")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\ntorch {torch.__version__}, 1 torch thread, {os.cpu_count()} CPUs, load "
          f"{tuple(round(v, 2) for v in load) if load else '?'}; medians [quartiles] of {opts.repeats} repeats, "
          "each the fastest of four interleaved blocks per arm.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
