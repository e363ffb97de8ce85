"""What putting a recorder around every module call costs a forward, by how it is put in place.

Capture replaces ``nn.Module._call_impl`` for the duration of a trace (``capture/call_impl.py``): a write
to a class attribute, which invalidates the attribute caches of ``nn.Module`` and of every subclass, so
that the lookups of the forward that follows (and of the code after the restore) fill them again.
This measures that cost against a design that never writes to the class: the function object
``nn.Module._call_impl`` keeps its identity and gets the recorder's code for the duration (its state read
from a name set in the function's globals, since a swapped code object can have no closure).  It is
not what capture does; it is here to size that design.  Arms, per model, timed in ABBA blocks in one
process, each a minimal recorder (a start and an end time per call) put in place and removed once
per forward:

- ``native``: the forward alone;
- ``class write``: a closure recorder set as the class attribute and restored (what capture does);
- ``code swap``: the same recorder as swapped code, its state in the function's globals.

Reported: medians [quartiles] over repeats of the time per forward.  Run:

    python benchmarks/call_impl_install.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixed_cost import OneOp, _cell, interleaved  # noqa: E402
from models import SmallResNet  # noqa: E402

_STATE = "__call_impl_install_state__"  # the name the swapped code reads its state from
_SWAPPED = f'''
def _call_impl(module, *args, **kwargs):
    calls, clock, impl = {_STATE}
    call = [module, clock()]
    calls.append(call)
    try:
        return impl(module, *args, **kwargs)
    finally:
        call.append(clock())
'''


def _closure_recorder(impl):
    calls, clock = [], time.perf_counter_ns

    def record_call(module, *args, **kwargs):
        call = [module, clock()]
        calls.append(call)
        try:
            return impl(module, *args, **kwargs)
        finally:
            call.append(clock())

    return record_call


def arms(model, x) -> dict:
    owner = torch.nn.Module
    original = owner._call_impl
    code, namespace = original.__code__, original.__globals__
    # torch's own code under another function object: what the swapped code calls.
    impl = types.FunctionType(code, namespace, original.__name__, original.__defaults__, original.__closure__)
    scratch: dict = {}
    exec(compile(_SWAPPED, "<swapped _call_impl>", "exec"), scratch)
    swapped = scratch["_call_impl"].__code__

    def class_write():
        owner._call_impl = _closure_recorder(original)
        try:
            model(x)
        finally:
            owner._call_impl = original

    def code_swap():
        namespace[_STATE] = ([], time.perf_counter_ns, impl)
        original.__code__ = swapped
        try:
            model(x)
        finally:
            original.__code__ = code
            del namespace[_STATE]

    return {"native": lambda: model(x), "class write": class_write, "code swap": code_swap}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = {"1-op model, 1 module call": (OneOp().eval(), torch.randn(4), 2000),
            "ResNet-like, 43 module calls": (SmallResNet((8, 16, 32)).eval(), torch.randn(1, 3, 16, 16), 40)}
    print(f"{len(torch.nn.Module.__subclasses__())} direct subclasses of nn.Module in this process\n")
    print("| model | native us | class write us | code swap us |")
    print("|---|---|---|---|")
    with torch.no_grad():
        for name, (model, x, calls) in rows.items():
            best = interleaved(arms(model, x), opts.repeats, calls)
            print(f"| {name} | "
                  + " | ".join(_cell(best[arm]) for arm in ("native", "class write", "code swap")) + " |")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\ntorch {torch.__version__}, 1 torch thread, load {tuple(round(v, 2) for v in load) if load else '?'}; "
          f"medians [quartiles] of {opts.repeats} repeats, each the fastest of four interleaved blocks per arm.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
