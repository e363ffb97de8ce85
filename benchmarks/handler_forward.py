"""The forward under capture alone (the handler and the module hooks, no finalize), per op, beside the recorder.

``tl.trace``'s own timings put a trace's cost in three parts: set-up, the forward under capture and
building the record.  This isolates the middle one, the part the capture handler (``capture/mode.py``)
decides: each arm runs one forward of a row of ``overhead_fit.py`` inside a fresh ``CaptureState`` with
the ``CaptureMode`` and the ``ModuleCallTracker`` entered, and nothing else.  Per row and repeat, every
arm is timed against the untraced forward in ABBA quartets (``overhead_fit.abba_added_us``: each arm keeps
its fastest block); the table gives the added microseconds per op, medians [quartiles] over repeats, for
the minimal recorder mode (the floor), the handler saving everything and saving nothing, and, with
``--baseline``, the same two arms of another revision's package side by side in this process; with
``--pure``, both arms on the compiled hot path (torchlens-accel) and again on the pure-Python path.  Run:

    python benchmarks/handler_forward.py [--rows chain200,gpt2_2] [--repeats 9] [--baseline DIR] [--pure]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import baseline_package, native_arm, on_path, recorder_arm  # noqa: E402
from overhead_fit import abba_added_us, build, calls_per_block, counts, quartiles  # noqa: E402


def capture_arm(package, model, args, save_mode: int, compiled=None):
    """One forward under ``package``'s capture mode and module hooks, with the inputs bound as sources;
    with ``compiled`` True or False, on the compiled hot path or on the pure-Python path."""
    name = package.__name__
    mode = importlib.import_module(f"{name}.capture.mode")
    state = importlib.import_module(f"{name}.capture.state")
    source = importlib.import_module(f"{name}.capture.source")
    modules = importlib.import_module(f"{name}.capture.modules")
    index = importlib.import_module(f"{name}.record.model_index").index_of(model)
    input_kind = importlib.import_module(f"{name}.record.columns").INPUT

    def forward():
        st = state.CaptureState(save_mode=save_mode, buffers=index.buffers)
        for i, a in enumerate(args):
            st.add_source(a, input_kind, f"input.{i}")
        frames = source.FrameClassifier()
        with modules.ModuleCallTracker(st, model, frames), mode.CaptureMode(st, frames):
            return model(*args)
    return forward if compiled is None else on_path(package, compiled, forward)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="chain200,gpt2_2,mlp40,loop_rnn32")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--baseline", help="another revision's src/torchlens directory, run beside this one")
    parser.add_argument("--pure", action="store_true", help="the package under test on the compiled hot path "
                                                             "and again on the pure-Python path")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    torch.backends.mha.set_fastpath_enabled(False)
    import torchlens

    # suffix -> (package, compiled: True, False or None for as configured)
    packages = {" compiled": (torchlens, True), " pure": (torchlens, False)} if opts.pure else {"": (torchlens, None)}
    if opts.baseline:
        packages[" before"] = (baseline_package(os.path.abspath(opts.baseline)), None)
    titles = ["recorder floor"] + [f"capture, save {s}{suffix}" for suffix in packages for s in ("all", "none")]
    lines = ["| row | ops | module calls | " + " | ".join(f"{t} +us/op" for t in titles) + " |",
             "|---" * (3 + len(titles)) + "|"]
    for name in opts.rows.split(","):
        model, args = build(name)
        ops, calls = counts(model, args)
        arms = [recorder_arm(model, args)] + [capture_arm(p, model, args, save, compiled)
                                              for p, compiled in packages.values() for save in (1, 0)]
        added = added_per_op(native_arm(model, args), arms, opts.repeats, ops)
        cells = []
        for values in added:
            q1, q2, q3 = quartiles(values)
            cells.append(f"{q2:.2f} [{q1:.2f}, {q3:.2f}]")
        lines.append(f"| {name} | {ops} | {calls} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += ["", f"Medians [quartiles] of {opts.repeats} repeats. {machine_line()}"]
    print("\n".join(lines))
    return 0


def added_per_op(native, arms: list, repeats: int, ops: int) -> list:
    """Per arm, the time it adds over ``native`` per op in each repeat (ABBA quartets in one process)."""
    sizes = [calls_per_block(arm) for arm in arms]
    added = [[] for _ in arms]
    for _ in range(repeats):
        for k, arm in enumerate(arms):
            added[k].append(abba_added_us(native, arm, sizes[k])[1] / ops)
    return added


def machine_line() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return (f"torch {torch.__version__}, 1 torch thread, {os.cpu_count()} CPUs, "
            f"load {tuple(round(v, 2) for v in load) if load else '?'}.")


if __name__ == "__main__":
    sys.exit(main())
