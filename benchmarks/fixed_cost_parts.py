"""What each part of a trace's fixed cost adds, in instructions: a one-op ``tl.trace`` counted by callgrind
as it is, then once with each part replaced by a no-op.

The difference is what a trace would save if that part cost nothing (an upper bound on what trimming it
can win back).  Instruction counts do not move with the load of a shared host, so two parts a few hundred
instructions apart can be told apart, where timings cannot.  A part replaced is one the one-op model does
not need to trace faithfully (its root call is no module call, and it has no compiled submodule), so the
trace still runs; the figures are not for any other use.  Parts a revision does not have are skipped.
Needs valgrind; each count runs a worker under callgrind (about a minute).  Run:

    python benchmarks/fixed_cost_parts.py [--jobs 2] [--traces 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

_HERE = os.path.dirname(os.path.abspath(__file__))


class _NoPart:
    """A capture part that does nothing (``teardown.Capture`` enters and exits it)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _run_as_given(run, arguments):
    return run(*arguments)


# part name -> (attribute of capture/session.py, its no-op stand-in)
PARTS = {
    "module-call tracker (with the root's call through it)": ("ModuleCallTracker", _NoPart),
    "fast-path shim": ("FastPathShim", _NoPart),
    "Dynamo compile watch": ("DynamoCompiles", _NoPart),
    "thread mark, collector pause and torch-function state around a trace": ("_paused_collector", _run_as_given),
    "caveats, rank and selection checks after finalize": ("_complete", lambda *args: None),
}


def _worker(part: str, count: int) -> None:
    """``trace_instructions``' worker for the one-op model's ``tl.trace``, with ``part`` (or nothing: "")
    replaced by its no-op first."""
    sys.path.insert(0, os.path.join(_HERE, "..", "src"))
    sys.path.insert(0, _HERE)
    from torchlens.capture import session
    from trace_instructions import _worker as counted_worker

    if part:
        name, stand_in = PARTS[part]
        setattr(session, name, stand_in)
    counted_worker("one-op", "all", None, count)


def main() -> None:
    sys.path.insert(0, _HERE)
    from trace_instructions import instructions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=10, help="traces counted per arm")
    parser.add_argument("--jobs", type=int, default=2, help="workers under valgrind at once")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker is not None:
        _worker(options.worker, options.traces)
        return
    sys.path.insert(0, os.path.join(_HERE, "..", "src"))
    from torchlens.capture import session

    os.environ.setdefault("PYTHONHASHSEED", "0")  # the same dict layouts in every worker
    parts = [""] + [part for part, (name, _) in PARTS.items() if hasattr(session, name)]
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(options.jobs) as pool:
        def count(k_part):
            k, part = k_part
            arguments = [__file__, "--worker", part, "--traces", str(options.traces)]
            return instructions(arguments, os.path.join(folder, f"callgrind.{k}.out"))["Ir"] / options.traces

        counts = list(pool.map(count, enumerate(parts)))
    whole = counts[0]
    print(f"A one-op trace, whole: {whole / 1e3:,.1f} k instructions per call (the untraced forward included).\n")
    print("| part replaced by a no-op | instructions saved per trace |")
    print("|---|---|")
    for part, counted in zip(parts[1:], counts[1:]):
        print(f"| {part} | {(whole - counted) / 1e3:,.1f} k |")


if __name__ == "__main__":
    main()
