"""What each piece of per-op work in the capture handler costs, to size the levers of a handler redesign.

Every lever is timed as the difference between a loop that does the piece of work and the same loop
without it, over the same tensors, in interleaved blocks in one process (each arm keeps its fastest
block per repeat; medians and quartiles over repeats).  The figures are nanoseconds per op on this
host; they bound what removing or deferring that piece can save, not what a trace will show.  Run:

    python benchmarks/handler_levers.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from weakref import ref as weakref

import torch
from torch.overrides import TorchFunctionMode

N = 2000  # tensors per block


def _storage_key(t):
    return t.untyped_storage().data_ptr()


class _Bare(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def levers(tensors: list) -> dict:
    """name -> (loop with the work, loop without it)."""
    def empty():
        for t in tensors:
            pass

    def version():
        for t in tensors:
            t._version

    def weak():
        for t in tensors:
            weakref(t)

    def storage():
        for t in tensors:
            _storage_key(t)

    def meta():
        for t in tensors:
            (t.shape, t.dtype, t.device, t.requires_grad)

    def grad_fn():
        for t in tensors:
            type(t.grad_fn) if t.requires_grad else None

    def clocks():
        clock = time.perf_counter_ns
        for t in tensors:
            clock()
            clock()

    def frame():
        seen = {}
        for t in tensors:
            f = sys._getframe(0)
            seen.get(id(f.f_code))
            f.f_lasti

    def producers():
        table = {}
        for i, t in enumerate(tensors):
            table[id(t)] = (weakref(t), i, t._version)

    table = {id(t): (weakref(t), i, 0) for i, t in enumerate(tensors)}

    def lookup():
        for t in tensors:
            entry = table.get(id(t))
            entry[0]() is t

    def record():
        out = []
        for i, t in enumerate(tensors):
            out.append((i, None, t.shape, t.dtype, t.device, False, None))

    def call_tuple():
        out = []
        for i, t in enumerate(tensors):
            out.append((t, (None,), {}, ((0, i),), (), -1, None, 0, 0, 0, i, 1, False, None))

    def python_call():
        def handler(func, types, args, kwargs):
            return func
        for t in tensors:
            handler(t, None, (), None)

    def made_and_freed():  # an op's output, bound by a strong reference, then freed
        table = {}
        for i, t in enumerate(tensors):
            out = t.neg()
            table[id(out)] = (out, i, 0)
        table.clear()

    def made_bound_weakly_and_freed():  # the same, bound by a weak reference (cleared when it dies)
        table = {}
        for i, t in enumerate(tensors):
            out = t.neg()
            table[id(out)] = (weakref(out), i, 0)
        table.clear()

    def native_op():
        for t in tensors[:200]:
            t.neg()

    def mode_op():
        with _Bare():
            for t in tensors[:200]:
                t.neg()

    return {
        "read _version (arg scan, per tensor argument)": (version, empty, N),
        "weakref per output (producer binding)": (weak, empty, N),
        "storage key per saved output (untyped_storage().data_ptr())": (storage, empty, N),
        "shape, dtype, device, requires_grad per output": (meta, empty, N),
        "grad_fn class per output": (grad_fn, empty, N),
        "two perf_counter_ns per call (op timing)": (clocks, empty, N),
        "caller frame + verdict lookup per call": (frame, empty, N),
        "producer entry per output (weakref, index, version)": (producers, empty, N),
        "weak binding over a strong one, the output's dealloc included": (made_bound_weakly_and_freed,
                                                                          made_and_freed, N),
        "parent lookup per tensor argument (dict + weakref deref)": (lookup, empty, N),
        "raw record tuple per output (with its metadata reads)": (record, empty, N),
        "raw call tuple per call (14 fields)": (call_tuple, empty, N),
        "one Python function call (the handler's own entry)": (python_call, empty, N),
        "TorchFunctionMode dispatch of one op (bare mode - native)": (mode_op, native_op, 200),
    }


def measure(repeats: int) -> dict:
    tensors = [torch.randn(4) for _ in range(N)]
    arms = levers(tensors)
    samples = {name: [] for name in arms}
    for _ in range(repeats):
        for name, (work, base, n) in arms.items():
            with_work, without = [], []
            for _ in range(3):
                for fn, out in ((base, without), (work, with_work), (work, with_work), (base, without)):
                    start = time.perf_counter_ns()
                    fn()
                    out.append(time.perf_counter_ns() - start)
            samples[name].append((min(with_work) - min(without)) / n)
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    with torch.no_grad():
        samples = measure(opts.repeats)
    print("| piece of per-op work | ns per op, median [quartiles] |")
    print("|---|---|")
    for name, values in samples.items():
        q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
        print(f"| {name} | {q2:.0f} [{q1:.0f}, {q3:.0f}] |")
    print(f"\n{opts.repeats} repeats; torch {torch.__version__}, 1 thread; a shared host: read medians.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
