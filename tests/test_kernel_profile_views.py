"""tl.report.kernel_profile on writes into views: the backward nodes such a write makes besides its own (the base's
``CopySlices``, the view's regenerated node) have numbers no aten op records, and land on the op that made them,
as the backward-only profile of a ``grads=True`` trace puts them."""

import os
import sys
from collections import Counter

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.report.profile_events import Event
from torchlens.report.profile_join import join

sys.path.insert(0, os.path.dirname(__file__))
import real_models  # noqa: E402

_NODE = "autograd::engine::evaluate_function: "


def _nodes_by_op(kp) -> Counter:
    """``{(op label or None, backward node name): evaluations}`` read from the profiler's own events."""
    joined, _, _, serial_of_call = kp._join()
    call_of = {serial: call for call, serial in serial_of_call.items()}
    found = Counter()
    for e in kp.profiler.profiler.kineto_results.events():
        if e.name().startswith(_NODE):
            target = joined.external_ids.get(e.correlation_id())
            label = None
            if target is not None and target.kind == "op":
                label = kp.trace.labels[kp.trace.calls[call_of[target.key]].first_record]
            found[(label, e.name()[len(_NODE):])] += 1
    return found


class WriteIntoView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        v = h[:, :2]
        v.mul_(2)  # MulBackward0, and CopySlices on h
        return (h.sum(1) + (v * 3).sum(1)).tanh()  # reading v's grad_fn makes a new node for v


@pytest.fixture(scope="module")
def funnel():
    torch.manual_seed(0)
    model, args, kwargs = real_models.build("funnel")  # its attention writes into views of its scores
    return model.eval(), args, kwargs


def test_a_write_into_a_view_keeps_its_backward_on_the_op():
    kp = tl.report.kernel_profile(WriteIntoView(), torch.randn(2, 4), backward=True)
    nodes = _nodes_by_op(kp)
    assert nodes[("mul_1_3:1", "torch::autograd::CopySlices")] == 1
    assert "backward_without_op" not in kp.coverage.host_unattributed
    write, product = [row for row in kp.ops if row["type"] == "mul"]
    assert write["op"] == "mul_1_3:1" and write["bwd_aten_ops"] > product["bwd_aten_ops"]  # the copies are its own


def test_a_real_models_view_writes_land_where_the_backward_only_profile_puts_them(funnel):
    model, args, kwargs = funnel
    forward_and_backward = tl.report.kernel_profile(model, args, kwargs, backward=True)
    log = tl.trace(model, args, kwargs, grads=True)
    backward_only = tl.report.kernel_profile(log, backward=True)
    nodes = _nodes_by_op(forward_and_backward)
    assert any("CopySlices" in name and label for label, name in nodes)
    assert not [name for label, name in nodes if label is None and "AccumulateGrad" not in name]
    assert nodes == _nodes_by_op(backward_only)
    assert "backward_without_op" not in forward_and_backward.coverage.host_unattributed


def _host(name, start, end, seq=-1, backward=False, thread=1):
    return Event(name, "cpu_op", start, end, thread, seq=seq, backward=backward)


def test_an_unrecorded_node_number_goes_to_the_op_below_it_only_inside_the_forwards_numbers():
    run = 79
    events = [
        _host(f"torchlens::op::{run}.0", 0, 100),
        _host("aten::mul_", 10, 90, seq=5),  # makes node 5 and, unrecorded, node 6
        _host(f"torchlens::op::{run}.1", 100, 200),
        _host("aten::mul", 110, 190, seq=7),
        _host("evaluate_function: CopySlices", 500, 520, seq=6, backward=True, thread=3),
        _host("evaluate_function: Recomputed", 520, 560, seq=9, backward=True, thread=3),
        _host("aten::mm", 530, 550, seq=10, thread=3),  # an op run inside a node records 10: 9 may be its
        _host("evaluate_function: AfterEverything", 560, 580, seq=11, backward=True, thread=3),
    ]
    joined = join(events, run)
    assert joined.op_backward[0][0] == 20
    assert joined.host_unattributed["backward_without_op"] == [3, 20 + 20 + 20]


def test_a_custom_functions_backward_lands_on_its_output_op_in_both_profiles():
    # Its node is numbered inside apply, outside every op's range: the forward-and-backward profile listed its
    # backward under no op, while the backward-only profile of a grads=True trace put it on the op whose output
    # the node differentiates.
    torch.manual_seed(0)
    model, args, kwargs = real_models.build("bloom")  # its GeLU is a custom autograd.Function
    model.eval()
    forward_and_backward = _nodes_by_op(tl.report.kernel_profile(model, args, kwargs, backward=True))
    log = tl.trace(model, args, kwargs, grads=True)
    backward_only = _nodes_by_op(tl.report.kernel_profile(log, backward=True))
    holders = [label for label, name in forward_and_backward if name == "GeLUFunctionBackward"]
    assert len(holders) == 2 and all(log[label].grad_fn == "GeLUFunctionBackward" for label in holders)
    assert forward_and_backward == backward_only


def test_a_torchscript_modules_backward_is_unknown_not_a_measured_zero():
    # Its backward nodes are no captured op's (capture cannot see inside it), so its module row read 0 backward
    # time and 0 aten ops as if measured, while the work sat under "a grad node no captured op created".
    import warnings

    torch.manual_seed(0)
    scripted = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    model = nn.Sequential(nn.Linear(8, 8), scripted, nn.Linear(8, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trace's TorchScript caveat
        profile = tl.report.kernel_profile(model, torch.randn(2, 8), backward=True)
    rows = {row["module_call"]: row for row in profile.to_pandas("module").to_dict("records")}
    assert rows["0:1"]["bwd_aten_ops"] > 0 and rows["2:1"]["bwd_aten_ops"] > 0
    assert all(rows["1:1"][k] is None or rows["1:1"][k] != rows["1:1"][k]  # None or NaN in pandas
               for k in ("bwd_cpu_ns", "bwd_aten_ops", "self_bwd_cpu_ns"))
    assert rows["1:1"]["cpu_ns"] > 0  # its forward, inside its own range, stays measured
