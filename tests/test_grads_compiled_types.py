"""The compiled gradient stores on their own: torchlens-accel's C hook and sink (``_grads``) and its C++
sink and hook adder (``_autograd``), called directly rather than through a trace.

A hook keeps the gradient by reference, accumulates a later backward out of place, counts each backward
once, and drops a graph handed to it; the hook adder places C++ hooks (a leaf's in its own hook list),
hands what it cannot hook to the Python fallback, and stops writing once removed.  Skipped, saying so, when
the compiled modules are not built; ``TORCHLENS_REQUIRE_ACCEL=1`` makes that a failure instead.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from accel_paths import compiled_or_skip

NATIVE = compiled_or_skip("_grads")
CPP = compiled_or_skip("_autograd")


def test_compiled_hook_accumulates_without_writing_in_place_and_counts_tasks():
    tasks = iter([7, 7, 8, 8])
    sink = NATIVE.Sink(lambda: next(tasks))
    first, second = NATIVE.Hook(sink, 3), NATIVE.Hook(sink, 5)
    g = torch.ones(2)
    first(None)  # an output the backward did not reach: nothing kept, no backward counted
    assert not sink.grads and sink.order == [] and sink.backwards == 0
    first(g)
    assert sink.grads[3] is g and sink.order == [3] and sink.backwards == 1  # kept by reference
    second(torch.full((2,), 2.0))
    first(torch.full((2,), 4.0))  # a second backward (task 8): accumulated out of place
    assert torch.equal(g, torch.ones(2)) and torch.equal(sink.grads[3], torch.full((2,), 5.0))
    assert sink.order == [3, 5] and sink.backwards == 2
    with_graph = torch.ones(2, requires_grad=True) * 3  # create_graph=True hands over a grad with a graph
    second(with_graph)
    assert not sink.grads[5].requires_grad and torch.equal(sink.grads[5], torch.full((2,), 5.0))
    next_task_fails = NATIVE.Hook(sink, 9)
    with pytest.raises(StopIteration):
        next_task_fails(g)  # the task reader's error reaches autograd, not a wrong record
    with pytest.raises(TypeError, match="one argument"):
        first(g, g)
    assert repr(first) == "<torchlens gradient hook of record 3>"
    with pytest.raises(TypeError, match="must be a list"):
        sink.order = (1, 2)


def test_cpp_sink_accumulates_without_writing_in_place_and_counts_each_backward_once():
    sink = CPP.Sink()
    first, second = sink.hook(3), sink.hook(5)
    g = torch.ones(2)
    first(None)  # an output the backward did not reach: nothing kept, no backward counted
    assert not sink.grads and sink.order == [] and sink.backwards == 0
    first(g)  # called outside any backward: one "task" for every call
    assert sink.grads[3] is g and sink.order == [3] and sink.backwards == 1  # kept by reference
    second(torch.full((2,), 2.0))
    first(torch.full((2,), 4.0))
    assert torch.equal(g, torch.ones(2)) and torch.equal(sink.grads[3], torch.full((2,), 5.0))  # out of place
    assert sink.order == [3, 5] and sink.backwards == 1
    second(torch.ones(2, requires_grad=True) * 3)  # create_graph=True hands over a grad with a graph
    assert not sink.grads[5].requires_grad and torch.equal(sink.grads[5], torch.full((2,), 5.0))
    with pytest.raises(TypeError, match="one argument"):
        first(g, g)
    with pytest.raises(TypeError, match="must be a list"):
        sink.order = (1, 2)
    sink.order, sink.backwards = [5, 3], 4  # what a loaded trace sets
    assert sink.order == [5, 3] and sink.backwards == 4
    kept = weakref.ref(sink.grads[5])
    sink.clear()
    assert not sink.grads and kept() is None and sink.order == [5, 3]


def test_cpp_hooks_count_backwards_by_graph_task_and_stop_when_removed():
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    z = y.tanh()
    sink = CPP.Sink()
    handles, numbers = {}, {}
    fallback_calls = []
    made = []  # the fallback is made on the first call that needs it, once
    adder = CPP.HookAdder(sink, handles, numbers, {}, -1, lambda: None, torch.Tensor,
                          lambda *a: made.append(a) or (lambda *b: fallback_calls.append(b[0])), lambda *a: None)
    adder(0, x)  # a leaf: a C++ hook in the tensor's own hook list, no sequence number (it has no node)
    adder(1, y)
    adder(2, z)
    adder(3, torch.randn(2))  # needs no grad: the fallback says what register_hook says
    adder(4, torch.randn(2))
    assert fallback_calls == [3, 4] and adder.placed() == 3 and set(handles) == {0, 1, 2}
    assert len(made) == 1 and made[0][:3] == (sink, handles, numbers)
    assert numbers == {1: y.grad_fn._sequence_nr(), 2: z.grad_fn._sequence_nr()}
    assert x._backward_hooks is None  # no Python hook dict: the backward calls no Python for the leaf
    z.sum().backward(retain_graph=True)
    assert sink.backwards == 1 and sink.order == [2, 1, 0]
    # d sum(z) / dy as autograd computes it on a twin graph, bit for bit: 1 - z**2 written out rounds otherwise where
    # tanh nears 1 (the difference cancels), so a random x failed allclose about once in twenty draws.
    twin = x.detach().requires_grad_() * 2
    expected = torch.autograd.grad(twin.tanh().sum(), twin)[0]
    assert torch.equal(sink.grads[2], torch.ones(3)) and torch.equal(sink.grads[1], expected)
    assert torch.equal(sink.grads[0], x.grad) and sink.grads[0] is not x.grad  # x.grad is its own copy
    z.sum().backward(retain_graph=True)
    assert sink.backwards == 2 and torch.equal(sink.grads[2], torch.full((3,), 2.0))
    assert torch.equal(sink.grads[0], x.grad)  # accumulated as x.grad accumulates
    adder.remove([2, 0])
    assert adder.placed() == 1
    leaf_before = sink.grads[0].clone()
    z.sum().backward(retain_graph=True)
    assert torch.equal(sink.grads[2], torch.full((3,), 2.0)) and sink.backwards == 3  # only record 1 wrote
    assert torch.equal(sink.grads[0], leaf_before) and not sink.incomplete  # removed by the capture: not lost
    del adder  # removes the rest
    before = sink.grads[1].clone()
    z.sum().backward()
    assert torch.equal(sink.grads[1], before) and sink.backwards == 3
