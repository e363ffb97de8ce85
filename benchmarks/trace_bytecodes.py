"""Bytecodes and C calls per ``tl.trace``, by Python function: a count that does not move with the load of a
shared host, in seconds (callgrind's ``trace_instructions.py`` takes minutes per arm).

A trace's fixed cost is mostly Python run once per trace (set-up, the capture parts, teardown, finalize), so
the bytecodes it executes, and the C functions those call, say where it goes and how it changed.  Each arm
runs the one-op model (``x + 1``, as ``fixed_cost.py``) 50 times to warm up, then ``--traces`` times under
``sys.settrace`` with opcode events and ``sys.setprofile``: every bytecode and every C call is counted
against the function that executes it.  What runs inside compiled code (torchlens-accel, torch's kernels)
is not counted, so the two paths' totals are not comparable with each other, only with another revision's
same arm (CPython 3.11 only: later versions send sys.settrace opcode events to some frames only).
``--baseline`` counts another revision's tree in the same process (``models.baseline_package``)
and lists the functions whose count changed most.  ``--grads`` traces with ``grads=True`` (an input that
requires grad), ``--read`` counts the first read of the record (``labels``, ``ops``, ``module_calls``,
``modules``) instead of the trace.  Run:

    python benchmarks/trace_bytecodes.py [--baseline /path/to/other/src/torchlens] [--pure] [--grads] [--read]
        [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import baseline_package  # noqa: E402


class OneOp(torch.nn.Module):
    def forward(self, x):
        return x + 1


class Counter:
    """Bytecodes and C calls per function (``file:name``) while it is on."""

    def __init__(self):
        self.bytecodes = collections.Counter()
        self.c_calls = collections.Counter()

    def _trace(self, frame, event, _arg):
        if event == "call":
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
        elif event == "opcode":
            self.bytecodes[_key(frame.f_code)] += 1
        return self._trace

    def _profile(self, frame, event, _arg):
        if event == "c_call":
            self.c_calls[_key(frame.f_code)] += 1

    def __enter__(self):
        self._previous = sys.gettrace(), sys.getprofile()  # a coverage or debugger tracer comes back after
        sys.settrace(self._trace)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._previous[0])
        sys.setprofile(self._previous[1])
        return False


def _key(code) -> str:
    return f"{os.path.basename(code.co_filename)}:{code.co_name}"


def count(tl, pure: bool, grads: bool, read: bool, traces: int) -> Counter:
    """The counts of ``traces`` calls of one arm, each a trace (or a first read) of the one-op model."""
    if sys.version_info[:2] != (3, 11):
        # sys.settrace's opcode events, turned on by a frame in its call event, reach no frame on CPython 3.12.1
        # and miss a function's first calls under the tracer on 3.13: the counts would be zeros or short.
        raise RuntimeError(f"bytecodes are counted on CPython 3.11 only (this is {sys.version.split()[0]}): "
                           "later versions send sys.settrace's opcode events to some frames only")
    previous = importlib.import_module(f"{tl.__name__}.capture.accel").use(not pure)
    model, x = OneOp().eval(), torch.randn(4, requires_grad=grads)
    options = {"grads": True} if grads else {}
    try:
        with torch.enable_grad() if grads else torch.no_grad():
            for _ in range(50):
                _first_read(tl.trace(model, x, **options))
            logs = [tl.trace(model, x, **options) for _ in range(traces)] if read else None
            counter = Counter()
            with counter:
                for k in range(traces):
                    _first_read(logs[k]) if read else tl.trace(model, x, **options)
    finally:
        importlib.import_module(f"{tl.__name__}.capture.accel").use(previous)
    return counter


def _first_read(log) -> None:
    log.labels, log.ops, log.module_calls, log.modules


def table(arms: dict, traces: int, top: int) -> str:
    """Totals per arm, then the functions with the largest counts (or, beside a baseline, changes)."""
    lines = ["| arm | bytecodes per trace | C calls per trace |", "|---|---|---|"]
    for name, counter in arms.items():
        lines.append(f"| {name} | {sum(counter.bytecodes.values()) / traces:.0f} | "
                     f"{sum(counter.c_calls.values()) / traces:.0f} |")
    this = arms["this"]
    other = arms.get("baseline")
    keys = set(this.bytecodes) | (set(other.bytecodes) if other is not None else set())

    def change(key):
        return this.bytecodes[key] - (other.bytecodes[key] if other is not None else 0)

    header = "| function | bytecodes | C calls |" if other is None else \
        "| function | bytecodes this / baseline | C calls this / baseline |"
    lines += ["", header, "|---|---|---|"]
    for key in sorted(keys, key=lambda k: -abs(change(k)))[:top]:
        cells = [f"{counter.bytecodes[key] / traces:.0f}" for counter in arms.values()]
        calls = [f"{counter.c_calls[key] / traces:.0f}" for counter in arms.values()]
        lines.append(f"| {key} | {' / '.join(cells)} | {' / '.join(calls)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another revision's src/torchlens, counted beside this one")
    parser.add_argument("--pure", action="store_true", help="the pure-Python path (TORCHLENS_ACCEL=0)")
    parser.add_argument("--grads", action="store_true", help="trace with grads=True")
    parser.add_argument("--read", action="store_true", help="count the first read of the record, not the trace")
    parser.add_argument("--traces", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    options = parser.parse_args()
    import torchlens

    packages = {"this": torchlens}
    if options.baseline:
        packages["baseline"] = baseline_package(options.baseline)
    arms = {name: count(tl, options.pure, options.grads, options.read, options.traces)
            for name, tl in packages.items()}
    print(table(arms, options.traces, options.top))
    path = "pure-Python" if options.pure else "compiled"
    what = "first read" if options.read else "tl.trace" + (" grads=True" if options.grads else "")
    print(f"\n{what}, {path} path, one-op model, counts per call over {options.traces}; torch {torch.__version__}")


if __name__ == "__main__":
    main()
