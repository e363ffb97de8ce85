"""What a forward may return: a result, or a value held in it, whose tensors a trace could not name as outputs
(a generator, an iterator, a set, a dict view, a future, a coroutine, a function) is refused after the forward,
rather than traced with no outputs and compared by identity; values kept as data beside the tensors stay."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from untouched import assert_clean_process


@pytest.mark.parametrize("lazy", ["map", "filter", "zip", "chain"])
def test_a_forward_returning_a_lazy_iterator_is_refused_rather_than_traced_with_no_outputs(lazy):
    # A forward returning map(...) gave a trace with no outputs; the mapped function ran later, untraced.
    import itertools

    class ReturnsLazily(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            made = {"map": lambda: map(lambda t: t * 2, [h]), "filter": lambda: filter(None, [h]),
                    "zip": lambda: zip([h], [h]), "chain": lambda: itertools.chain([h], [h])}
            return made[lazy]()

    with pytest.raises(TypeError, match=f"returned a {lazy}, an iterator whose items .* after tracing ended"):
        tl.trace(ReturnsLazily(), torch.randn(2, 4))
    assert_clean_process()


@pytest.mark.parametrize("returned, says", [
    ("set", r"returned a set, whose tensors have no order and no path .*\(return them in a tuple or a list\)"),
    ("frozenset", r"returned a frozenset, whose tensors have no order"),
    ("values", r"returned a dict_values, a view of a dict, .*\(return the dict itself, or list\(d.values\(\)\)\)"),
    ("items", r"returned a dict_items, a view of a dict"),
    ("future", r"returned a Future, whose value is read with .wait\(\).*lambda x: model\(x\).wait\(\)"),
    ("coroutine", r"returned a coroutine, whose body runs only when awaited, .*asyncio.run\(model\(x\)\)"),
    ("closure", r"returned a function, which computes only when called, after tracing ended.* "
                r"lambda x: model\(x\)\(\)"),
    ("tensor keys", r"returned a dict, keyed by tensors, .*\(key it by names or positions"),
])
def test_a_forward_returning_a_set_of_tensors_or_a_function_is_refused_rather_than_traced_with_no_outputs(
        returned, says):
    # Each was traced with no outputs, and tl.validate passed it comparing the results by identity (a dict view
    # compares by identity too).
    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return {"set": lambda: {h, h * 2}, "frozenset": lambda: frozenset([h]), "closure": lambda: lambda: h * 3,
                    "values": lambda: {"h": h}.values(), "items": lambda: {"h": h}.items(),
                    "coroutine": lambda: asyncio.sleep(0, h),
                    "future": lambda: torch.jit.fork(torch.relu, h), "tensor keys": lambda: {h: 1}}[returned]()

    for run in (tl.trace, tl.validate):
        with pytest.raises(TypeError, match=says):
            run(Returns(), torch.randn(2, 4))
    assert_clean_process()
    assert tl.trace(lambda x: {"words"}, torch.randn(2)).output == {"words"}  # a set holding no tensor is a value
    assert list(tl.trace(lambda x: {"words": 1}.keys(), torch.randn(2)).output) == ["words"]


@pytest.mark.parametrize("held, says", [
    ("generator", r"returned a generator at output.1, whose body runs only when iterated.*"
                  r"\(make output.1 a list or a tuple of its values inside the forward\)"),
    ("set", r"returned a set at output.extra.0, whose tensors have no order"),
    ("future", r"returned a Future at output.1, whose value is read with .wait\(\).*\(make output.1 the value it "
               r"holds \(.wait\(\)\) inside the forward\)"),
    ("tensor keys", r"returned a dict at output.1, keyed by tensors, .*\(key it by names or positions"),
])
def test_an_output_holding_a_value_no_trace_can_record_is_refused_naming_where_it_is(held, says):
    # Each was traced with the output's other tensors alone, and tl.validate said the outputs were not compared
    # because the forward drew from a source it could not put back (the held value compares by identity).
    class Holds(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return {"generator": lambda: (h, (t * 2 for t in [h])), "set": lambda: {"h": h, "extra": [{h * 2}]},
                    "future": lambda: (h, torch.jit.fork(torch.relu, h)),
                    "tensor keys": lambda: (h, {h * 2: "doubled"})}[held]()

    for run in (tl.trace, tl.validate):
        with pytest.raises(TypeError, match=says):
            run(Holds(), torch.randn(2, 4))
    assert_clean_process()
    kept = tl.trace(lambda x: (x * 2, print, iter([1]), {"words"}), torch.randn(2))  # kept as data: no tensor hidden
    assert [op.type for op in kept.ops] == ["input", "mul", "output"]


def test_an_output_nesting_its_tensors_deeper_than_a_trace_looks_is_refused_naming_where():
    # A chain of (step, rest) pairs kept step by step put the first steps' tensors below the 32 levels a walk of
    # outputs looks into: the trace listed the last 32 steps' outputs alone, and said nothing of the others.
    class KeepsSteps(nn.Module):
        def __init__(self, steps):
            super().__init__()
            self.steps = steps
            self.cell = nn.Linear(4, 4)

        def forward(self, x):
            kept = None
            for _ in range(self.steps):
                x = torch.tanh(self.cell(x))
                kept = (x, kept)
            return kept

    assert len(tl.trace(KeepsSteps(8), torch.randn(2, 4)).outputs) == 8
    says = r"returned a tuple at output(\.1){32}, which holds tensors more than 32 levels deep.*\(return them less"
    for run in (tl.trace, tl.validate):
        with pytest.raises(TypeError, match=says):
            run(KeepsSteps(40), torch.randn(2, 4))
    assert_clean_process()
