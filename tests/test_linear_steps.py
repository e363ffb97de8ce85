"""What each step after the forward costs grows with the trace, not with its square.

Each test counts the work one step does (the function calls it makes, builtins and generator steps included) on a
model of n and of 4n parts, shaped so that a step doing something per part per part would multiply it: the
counts grow about 4x when the step is linear, far more when it is not.  Work is counted, not timed, so a busy
machine cannot fail a test nor pass a quadratic step.
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch
import torch.nn as nn

import torchlens as tl

GROWTH = 4.6  # a linear step's count grows 4x from n to 4n, plus what is paid once per step


def _calls_made(step) -> int:
    """Function calls made while ``step()`` runs: Python functions (each step of a generator too) and builtins
    (``list.append``, a column's ``__getitem__``), which do the work of a loop over plain lists.  The collector
    is off meanwhile: a collection the step's allocations happen to set off runs the callbacks of ``gc.callbacks``
    (the model index's among them), work of the process's history, not of the step."""
    made = 0

    def count(frame, event, arg):
        nonlocal made
        if event == "call" or event == "c_call":
            made += 1

    collecting = gc.isenabled()
    gc.disable()
    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()
    return made


def _read(log):
    """``log`` with the columns every step reads derived (labels, module calls), so that a step is counted for
    what it derives of its own."""
    log.op_labels, [call.label for call in log.module_calls]  # noqa: B018 - read for what it derives
    return log


def _growth(step_of, n: int) -> float:
    """How much more work ``step_of(4 * n)()`` does than ``step_of(n)()``, each the first read of its trace (what
    a trace derives on first use is part of the step), after a run on a trace of its own has made the imports."""
    step_of(n)()
    small, large = step_of(n), step_of(4 * n)
    return _calls_made(large) / _calls_made(small)


class _Layer:
    """What a key/value cache holds per layer: a plain object with its tensors as attributes."""

    def __init__(self, keys):
        self.keys = keys


class _LayeredOutput(nn.Module):
    """Returns a list of ``n`` objects, each holding one tensor, as a model returning its cache does."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x):
        return [_Layer(x + i) for i in range(self.n)]


def test_saving_an_output_of_many_objects_walks_each_once(tmp_path):
    # Saving a trace keeps the output's structure, and asked of each object whether a tensor lay below it by
    # reading every output tensor's path: a list of n cache layers cost n * n.
    def save_of(n):
        log = tl.trace(_LayeredOutput(n), torch.randn(2, 3))
        return lambda: log.save(tmp_path / f"t{n}", overwrite=True)

    assert _growth(save_of, 300) < GROWTH
    log = tl.trace(_LayeredOutput(3), torch.randn(2, 3))
    loaded = tl.load(log.save(tmp_path / "small"))
    assert all(torch.equal(saved["keys"], layer.keys) for saved, layer in zip(loaded.output, log.output, strict=True))


class _Nest(nn.Module):
    """A module calling a module ``depth`` deep, each adding one op; the innermost then runs ``ops`` more."""

    def __init__(self, depth: int, ops: int = 0):
        super().__init__()
        self.ops = ops
        self.inner = _Nest(depth - 1, ops) if depth > 1 else None

    def forward(self, x):
        x = x + 1
        if self.inner is not None:
            return self.inner(x)
        for _ in range(self.ops):
            x = torch.tanh(x)
        return x


def test_module_call_depths_and_op_modules_read_once_per_record(tmp_path):
    # Each call's depth, and each op's innermost call (op.module), walked the chain of calls up to the root:
    # reading them over a nest of n modules cost n * n, and so did every table and text indenting by depth.
    def reads_of(n):
        log = tl.trace(_Nest(n), torch.randn(2, 3))
        return lambda: ([call.depth for call in log.module_calls], [op.module for op in log.ops])

    assert _growth(reads_of, 20) < GROWTH
    log = tl.trace(_Nest(3), torch.randn(2, 3))
    assert [call.depth for call in log.module_calls] == [0, 1]
    assert [op.module for op in log.ops] == [None, None, "inner:1", "inner.inner:1", None]
    assert [op.module for op in tl.load(log.save(tmp_path / "t")).ops] == [op.module for op in log.ops]


def test_the_module_table_totals_each_call_without_walking_the_calls_inside_it():
    # log.summary() counted each call's ops, bytes and FLOPs over every op inside it, nested calls included:
    # over a nest of n modules each op was counted once per call around it, n * n in all.
    def summary_of(depth):
        log = _read(tl.trace(_Nest(depth, ops=2000), torch.randn(2, 3)))
        return lambda: str(log.summary())

    # 4x the depth over the same 2000 ops: a few more rows, not the 4x of counting each op once per call around it.
    assert _growth(summary_of, 10) < 2
    rows = tl.trace(_Nest(3), torch.randn(2, 3)).summary().rows
    assert [(row["call"], row["ops"], row["flops"], row["activation_bytes"]) for row in rows] == [
        ("_Nest", 3, 18, 72), ("inner:1", 2, 12, 48), ("inner.inner:1", 1, 6, 24)]


def test_module_call_op_counts_are_counted_without_listing_each_calls_ops():
    # A call's op count (its repr, the calls' table, the chrome trace, a collapsed box of the picture) was the
    # length of its list of ops, nested calls included, and making those lists put each op in every call around
    # it: over a nest of n modules, n * n.
    def counts_of(n):
        log = _read(tl.trace(_Nest(n), torch.randn(2, 3)))
        return lambda: [repr(call) for call in log.module_calls]

    assert _growth(counts_of, 20) < GROWTH
    log = tl.trace(_Nest(3, ops=2), torch.randn(2, 3))
    assert [repr(call) for call in log.module_calls] == ["<ModuleCall inner:1 (_Nest, 4 ops)>",
                                                         "<ModuleCall inner.inner:1 (_Nest, 3 ops)>"]
    pytest.importorskip("pandas")
    assert list(log.module_calls.to_pandas()["num_ops"]) == [len(call.ops) for call in log.module_calls] == [4, 3]


def test_a_predicate_at_every_op_of_a_deep_nest_walks_each_module_call_up_once():
    # Resolving sites built the chain of calls open around each op from the chains already built, but first
    # listed the whole chain up to the root for each new call: n * n over a nest of n modules.
    def intervene_of(n):
        model, x = _Nest(n), torch.randn(2, 3)
        reference = tl.trace(model, x)
        every_op = {(lambda op: True): tl.scale(2.0)}
        return lambda: tl.trace(model, x, reference=reference, save="none", intervene=every_op)

    assert _growth(intervene_of, 20) < 4.3  # 4.8 and more before, on either capture path
    model, x = _Nest(3), torch.randn(2, 3)
    log = tl.trace(model, x, intervene={(lambda op: op.module == "inner.inner:1"): tl.scale(2.0)})
    assert [a.label for a in log.interventions] == ["add_3_3:1"] and torch.equal(log.output, (x + 1 + 1 + 1) * 2)


@pytest.mark.parametrize("view", ["unrolled", "rolled"])
def test_drawing_a_deep_nest_walks_each_module_call_up_once(view):
    # Every box of the picture held every item inside it, and each op walked its chain of boxes (to place it, and in
    # the rolled view twice more, over its chain of calls, to find the loops through a box): n * n over n modules.
    def dot_of(n):
        log = _read(tl.trace(_Nest(n), torch.randn(2, 3)))
        return lambda: log.render(view=view)

    assert _growth(dot_of, 20) < GROWTH  # 6.1x unrolled and 11x rolled before
    dot = tl.trace(_Nest(3, ops=2), torch.randn(2, 3)).render(view=view, depth=1)
    assert dot.count("subgraph cluster_") == 1 and "3 ops" in dot  # inner.inner (an add, 2 tanh) collapsed in inner
