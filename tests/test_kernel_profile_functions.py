"""tl.report.kernel_profile on custom autograd Functions: ``apply`` numbers the Function's backward node outside
the ranges of the ops inside it, and the node's backward goes to the op that made the output it differentiates,
in a forward-and-backward profile of a model as in the backward-only profile of a ``grads=True`` trace."""

import os
import sys

import pytest
import torch
import torch.nn as nn

import torchlens as tl

sys.path.insert(0, os.path.dirname(__file__))
from test_kernel_profile_views import _nodes_by_op  # noqa: E402
from zoo import DoubledInPlace  # noqa: E402


class _ReluMatmul(torch.autograd.Function):
    """relu(a @ b) with its own backward: two ops inside, the output made by the second."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return (a @ b).relu()

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad * ((a @ b) > 0)
        return grad @ b.T, a.T @ grad


class _SinAndTriple(torch.autograd.Function):
    """Two outputs, made by two ops: one node differentiates both."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 3, x.sin()

    @staticmethod
    def backward(ctx, grad_triple, grad_sin):
        (x,) = ctx.saved_tensors
        return grad_triple * 3 + grad_sin * x.cos()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return _ReluMatmul.apply(x, self.weight)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.block = Block()
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        triple, sin = _SinAndTriple.apply(self.fc(x))
        return self.head(self.block(triple + sin))


@pytest.fixture(scope="module")
def profiles():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    forward_and_backward = tl.report.kernel_profile(model, x, backward=True)
    log = tl.trace(model, x, grads=True)
    return forward_and_backward, tl.report.kernel_profile(log, backward=True), log


def test_a_custom_functions_backward_lands_on_the_op_that_made_its_output(profiles):
    forward_and_backward, _, log = profiles
    nodes = _nodes_by_op(forward_and_backward)
    relu = next(label for label, name in nodes if name == "_ReluMatmulBackward")
    assert log[relu].func_name == "relu" and log[relu].grad_fn == "_ReluMatmulBackward"
    assert "backward_without_op" not in forward_and_backward.coverage.host_unattributed
    # The Function's backward (two matmuls and a compare) is the op's, and so its module call's.
    assert forward_and_backward[relu]["bwd_aten_ops"] >= 3
    assert forward_and_backward["block:1"]["bwd_aten_ops"] == forward_and_backward[relu]["bwd_aten_ops"]


def test_a_node_of_several_outputs_lands_on_the_first_outputs_op(profiles):
    forward_and_backward, _, log = profiles
    nodes = _nodes_by_op(forward_and_backward)
    holder = next(label for label, name in nodes if name == "_SinAndTripleBackward")
    assert log[holder].func_name == "mul"


def test_both_profiles_put_every_node_on_the_same_op(profiles):
    forward_and_backward, backward_only, _ = profiles
    assert _nodes_by_op(forward_and_backward) == _nodes_by_op(backward_only)


class Checkpointed(nn.Module):
    """Two same-shaped layers, the second run in a reentrant checkpoint region (a Function whose backward
    recomputes the region and runs the region's own backward inside its node)."""

    def __init__(self):
        super().__init__()
        self.plain, self.region = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.region, self.plain(x), use_reentrant=True).tanh()


@pytest.fixture(scope="module")
def checkpointed():
    torch.manual_seed(0)
    model, x = Checkpointed(), torch.randn(4, 16, requires_grad=True)  # reentrant regions need an input that does
    forward_and_backward = tl.report.kernel_profile(model, x, backward=True)
    log = tl.trace(model, x, grads=True)
    return forward_and_backward, tl.report.kernel_profile(log, backward=True)


def test_a_reentrant_checkpoints_inner_backward_goes_where_its_node_goes(checkpointed):
    # The region's backward nodes are made afresh during the backward, inside the checkpoint's node, and no op
    # made them: they were listed as work of no op while the checkpoint's own node and recompute were the op's.
    forward_and_backward, _ = checkpointed
    nodes = _nodes_by_op(forward_and_backward)
    assert not [name for label, name in nodes if label is None and "AccumulateGrad" not in name]
    assert "backward_without_op" not in forward_and_backward.coverage.host_unattributed
    plain, region = forward_and_backward["plain:1"], forward_and_backward["region:1"]
    assert region["bwd_aten_ops"] > plain["bwd_aten_ops"]  # its own backward, plus the recompute


def test_both_profiles_put_a_reentrant_checkpoints_nodes_on_the_same_op(checkpointed):
    forward_and_backward, backward_only = checkpointed
    assert _nodes_by_op(forward_and_backward) == _nodes_by_op(backward_only)


class Dirty(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return DoubledInPlace.apply(self.fc(x) + 1).tanh()


def test_a_function_that_hands_back_its_dirty_input_has_its_backward_on_the_write():
    # Without gradient capture the version move read as a write no op made, so no record held the output and the
    # model profile listed the Function's backward under no op, where the trace's put it on the mul_.
    torch.manual_seed(0)
    model, x = Dirty(), torch.randn(2, 8)
    forward_and_backward = _nodes_by_op(tl.report.kernel_profile(model, x, backward=True))
    log = tl.trace(model, x, grads=True)
    holder = next(label for label, name in forward_and_backward if name == "DoubledInPlaceBackward")
    assert holder is not None and log[holder].func_name == "mul_"
    assert forward_and_backward == _nodes_by_op(tl.report.kernel_profile(log, backward=True))
