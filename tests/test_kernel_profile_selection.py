"""The backward-only profile of a trace: each op's backward figures are the ones the profile of the whole forward
and backward gives, or, where gradients were selected (``grads=[...]``), unknown, never those of a part of its
nodes."""

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


def test_an_op_handing_on_a_parameter_has_the_whole_profiles_zero_backward():
    # Mamba's A_log.float() returns the float parameter itself, a leaf with no backward node: the backward-only
    # profile called its backward unknown, "not all numbered during capture (left out by grads=[...], or tensor
    # subclasses)", on a trace taken with every gradient, where the whole profile measures 0 for it.
    model, args, kwargs = real_models.build("mamba")
    model.eval()
    whole = tl.report.kernel_profile(model, args, kwargs, backward=_backward)
    alone = tl.report.kernel_profile(tl.trace(model, args, kwargs, grads=True), backward=_backward)
    handed_on = [row["op"] for row in whole.ops if row["type"] == "float" and not whole.trace[row["op"]].parents]
    assert handed_on  # the case under test is there
    assert alone.complete, alone.coverage.problems
    backward_events = {row["op"]: row["bwd_aten_ops"] for row in whole.ops}
    assert {row["op"]: row["bwd_aten_ops"] for row in alone.ops} == backward_events


def test_a_backward_only_profile_after_an_earlier_backward_gives_the_same_figures(llama):
    # After log.backward(..., retain_graph=True) the trace's gradient hooks add each new gradient to the one kept:
    # an aten add run between the engine's range around a node and the node's own event, which cost the range its
    # node number in torch's profiler, so 115 of Llama's ops were short of backward events in a second profile.
    model, args, kwargs = llama
    fresh = tl.report.kernel_profile(tl.trace(model, args, kwargs, grads=True), backward=_backward)
    log = tl.trace(model, args, kwargs, grads=True)
    log.backward(log.output.logits.sum(), retain_graph=True)
    again = tl.report.kernel_profile(log, backward=_backward)
    assert again.complete
    first_figures = {row["op"]: row["bwd_aten_ops"] for row in fresh.ops}
    assert {row["op"]: row["bwd_aten_ops"] for row in again.ops} == first_figures
