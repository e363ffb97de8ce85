"""A forward that runs a backward itself (``torch.autograd.grad`` of its output with respect to its input, as a
physics-informed loss does): the grad nodes it evaluates run inside that call, so kernel_profile credits them to
the op that ran them, not to the backward of the ops that made the nodes, which a profile without a backward has
no column for."""

import torch
import torch.nn as nn

import torchlens as tl


class Residual(nn.Module):
    """u(x) plus the sum of its own slopes d u / d x, taken in the forward with create_graph=True."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        x = x.detach().requires_grad_()
        u = self.net(x)
        slope, = torch.autograd.grad(u.sum(), x, create_graph=True)
        return u + slope.sum(-1, keepdim=True)


def _rows_and_reasons(kp, columns) -> int:
    """Self CPU time on the op rows (their ``columns``), plus the time listed as on no op: the profile's host total."""
    on_ops = sum(row[name] for row in kp.ops for name in columns)
    return on_ops + sum(ns for _, ns in kp.coverage.host_unattributed.values())


def test_a_backward_run_by_the_forward_is_the_work_of_the_op_that_ran_it():
    # Without backward=True, the grad nodes autograd.grad evaluated were credited to the backward of the linear and
    # tanh ops, which such a profile has no column for: a fifth of the host time sat on no row, while the coverage
    # called it all attributed.
    kp = tl.report.kernel_profile(Residual(), torch.randn(4, 2))
    assert kp.complete
    assert _rows_and_reasons(kp, ["cpu_ns"]) == kp.coverage.host_ns
    grad = next(row for row in kp.ops if row["type"] == "grad")
    assert any(name.startswith("autograd::engine::evaluate_function") for name in grad["aten"])


def test_the_nodes_a_backward_in_the_forward_makes_are_its_ops():
    # With create_graph=True autograd.grad makes nodes of its own, which the backward evaluates again: they were
    # listed as the backward of no op ("backward_without_op"); they are the grad op's backward.
    kp = tl.report.kernel_profile(Residual(), torch.randn(4, 2), backward=True)
    assert kp.complete
    assert "backward_without_op" not in kp.coverage.host_unattributed
    assert _rows_and_reasons(kp, ["cpu_ns", "bwd_cpu_ns"]) == kp.coverage.host_ns
    grad = next(row for row in kp.ops if row["type"] == "grad")
    assert grad["bwd_aten_ops"] > 0
