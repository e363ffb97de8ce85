"""Helpers of the interrupt tests: a KeyboardInterrupt at every line a trace runs, and what a trace must
look like afterwards."""

from __future__ import annotations

import gc
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl
from untouched import assert_clean_process


def signature(log) -> list:
    return [(op.label, op.func_name, tuple(op.parents), op.module, op.shape) for op in log.ops]


def interrupt_every_line(run, traced, collect=None) -> int:
    """Run ``run()`` once per line event of the code ``traced(code)`` selects, raising KeyboardInterrupt
    at that event; after each, nothing may be left installed and the interrupt must reach the caller
    unchanged.  Returns how many interrupts landed.  ``collect(code)``: whether an interrupt landing in
    ``code`` is followed by a collection (and the same checks again)."""
    if collect is None:
        return _interrupt_every_line(run, traced, None)
    # The objects made before the runs are none of their garbage: frozen, they are left out of each
    # collection, which then scans what the runs made (a whole test process's heap took seconds each).
    gc.freeze()
    try:
        return _interrupt_every_line(run, traced, collect)
    finally:
        gc.unfreeze()


def _interrupt_every_line(run, traced, collect) -> int:
    from torchlens.capture import session

    interrupted = 0
    for target in range(1, 100_000):
        seen, landed_in = [0], [None]

        def local(frame, event, arg):
            if event == "line":
                seen[0] += 1
                if seen[0] == target:
                    landed_in[0] = frame.f_code
                    raise KeyboardInterrupt(f"interrupt at line event {target}")
            return local

        def tracer(frame, event, arg):
            return local if traced(frame.f_code) else None

        collecting, grad, autocast = gc.isenabled(), torch.is_grad_enabled(), torch._C._is_any_autocast_enabled()
        sys.settrace(tracer)
        try:
            run()
        except KeyboardInterrupt as exc:
            assert str(exc) == f"interrupt at line event {target}", repr(exc)  # not "pop from empty stack"
            notes = getattr(exc, "__notes__", [])
            assert all("nothing is left installed" in n for n in notes), notes  # and every note is true
            interrupted += 1
        finally:
            sys.settrace(None)
        assert gc.isenabled() == collecting, f"the collector was left off (line event {target})"
        assert torch.is_grad_enabled() == grad, f"gradients were left {'off' if grad else 'on'} ({target})"
        assert torch._C._is_any_autocast_enabled() == autocast, f"autocast was left {'off' if autocast else 'on'}"
        assert not getattr(session._local, "active", False), f"the thread is left marked as tracing ({target})"
        assert not tl.capture.compiled._installed, f"a compiled submodule is left routed ({target})"
        assert_clean_process()
        if collect and landed_in[0] is not None and collect(landed_in[0]):
            gc.collect()  # a suspended push-back inside torch would put the mode back when collected
            assert_clean_process()
        if seen[0] < target:
            return interrupted
    raise AssertionError("the run never ended")


class Normalized(nn.Module):
    """Python-level torch functions: each call goes through torch's handle_torch_function."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.normalize(self.fc(x)).tanh()
