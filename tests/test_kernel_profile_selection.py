"""The backward-only profile of a trace whose gradients were selected (``grads=[...]``): each op's backward
figures are the ones the whole trace's profile gives, or unknown, never those of a part of its nodes."""

import os
import sys

import pytest

import torchlens as tl

sys.path.insert(0, os.path.dirname(__file__))
import real_models  # noqa: E402


def _backward(out):
    out.logits.sum().backward()


@pytest.fixture(scope="module")
def llama():
    model, args, kwargs = real_models.build("llama")
    return model.eval(), args, kwargs


def test_a_selected_ops_backward_is_all_its_nodes_or_unknown(llama):
    # A selected linear of the MLP read 4 backward aten ops (its output's reshape node alone) where the trace
    # with every gradient gives 31: the nodes it made before its output's were left to no op.
    model, args, kwargs = llama
    whole = tl.report.kernel_profile(tl.trace(model, args, kwargs, grads=True), backward=_backward)
    selected = tl.report.kernel_profile(tl.trace(model, args, kwargs, save="none",
                                                 grads=["model.layers.0.mlp", "silu"]), backward=_backward)
    every = {row["op"]: row["bwd_aten_ops"] for row in whole.ops}
    measured = {row["op"]: row["bwd_aten_ops"] for row in selected.ops if row["bwd_aten_ops"] is not None}
    mlp = [row["op"] for row in selected.ops if (row["module"] or "").startswith("model.layers.0.mlp.")]
    assert measured == {op: every[op] for op in measured}
    # gate_proj follows the unselected norm, whose nodes end where its own begin: unknown; up_proj and down_proj
    # follow selected ops, so all their nodes are known.
    assert [op in measured for op in mlp if op.startswith("linear")] == [False, True, True]
    assert not selected.complete and "not all numbered" in selected.coverage.problems[0]
