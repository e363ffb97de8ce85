"""Parent bindings stay exact when tensors die and their ids are reused.

The capture handler binds each output to its record by ``id(tensor)``.  An output ``save="all"`` saves by
reference is held by the binding itself; any other binding is weak.  Python reuses a dead object's id for the next
object of its size, so a binding must never hand a dead op's record to a new tensor that happens to get
its id: such a tensor, made where capture cannot see it, has no parent (an unattributed argument).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

import torchlens as tl

STEPS = 40


class Reallocates(nn.Module):
    """Each step makes an op output, lets it die, then makes a tensor capture does not see (likely at
    the dead output's address) and feeds it to the next op."""

    def __init__(self):
        super().__init__()
        self.reused = 0
        self.made = []  # weak references to the outputs the model made (the test's, not capture's)

    def forward(self, x):
        self.reused = 0
        self.made = []
        for _ in range(STEPS):
            y = x * 2.0
            self.made.append(weakref.ref(y))
            dead = id(y)
            del y  # dies here unless the trace saved it by reference
            with torch._C.DisableTorchFunction():
                hidden = torch.ones(3)
            self.reused += id(hidden) == dead
            x = x + hidden
        return x


def _check(trace, model, x) -> None:
    torch.testing.assert_close(trace.output, model(x))  # the trace changed nothing the model computes
    adds = [op for op in trace.ops if op.kind == "op" and op.func_name == "add"]
    assert len(adds) == STEPS
    previous = "input_1:1"
    for op in adds:
        # One parent, the running sum; the hidden tensor is an unattributed argument, never the dead mul.
        assert op.parents == [previous], (op.label, op.parents)
        assert op.unattributed_args == 1, op.label
        previous = op.label
    assert trace.unattributed == STEPS


@pytest.mark.parametrize("save", ["none", ["add"]])
def test_dead_unsaved_outputs_never_parent_a_reallocated_tensor(save):
    model, x = Reallocates(), torch.randn(3)
    trace = tl.trace(model, x, save=save)
    assert model.reused > 0, "no id was reused: the test did not exercise a stale binding"
    _check(trace, model, x)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_outputs_saved_by_reference_keep_their_ids(requires_grad):
    # save="all" holds every output (a detached alias of one that requires grad, and the output itself
    # in its binding), so no id is reused and every parent is still exact.
    model, x = Reallocates(), torch.randn(3, requires_grad=requires_grad)
    with torch.set_grad_enabled(requires_grad):
        trace = tl.trace(model, x, save="all")
    assert model.reused == 0
    _check(trace, model, x)
    for op in trace.ops:
        if op.kind == "op" and op.func_name == "mul":
            assert op.activation is not None and not op.activation.requires_grad
            assert op.requires_grad == requires_grad


@pytest.mark.parametrize("requires_grad", [False, True])
def test_saved_outputs_are_not_held_after_the_trace(requires_grad):
    model, x = Reallocates(), torch.randn(3, requires_grad=requires_grad)
    with torch.set_grad_enabled(requires_grad):
        trace = tl.trace(model, x, save="all")
    muls = [op for op in trace.ops if op.kind == "op" and op.func_name == "mul"]
    refs = [weakref.ref(op.activation) for op in muls]
    del trace, muls
    gc.collect()
    assert all(r() is None for r in refs)  # nothing but the trace kept the outputs it saved
    assert all(r() is None for r in model.made)  # nor, once it ended, the outputs it bound
