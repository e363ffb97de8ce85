"""A module call's inputs and outputs name the op whose saved value they are, on both capture paths: a tensor
written through a view or its base after the op that made it is no op's value, so it names none (the op
that made it kept its value from before the write, the write's is the view it wrote)."""

import pytest
import torch
import torch.nn as nn

import torchlens as tl

from accel_paths import PATHS, on_path


class WritesItsOutputThroughAView(nn.Module):
    def forward(self, x):
        y = x * 2
        y.view(-1).add_(100)  # y's own bytes, through a view made after y
        return y


class WritesPartOfItsOutput(nn.Module):
    def forward(self, x):
        y = x * 2
        y[:, :1].zero_()
        return y


class WritesBesideItsOutput(nn.Module):
    def forward(self, x):
        base = x * 2
        y = base[:1]  # a view of row 0: its version moves with base's
        base[1:].add_(100)  # row 1 only: y's bytes are not written
        return y


class Outer(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + 1


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("inner", [WritesItsOutputThroughAView, WritesPartOfItsOutput])
def test_a_module_output_written_through_a_view_names_no_op(compiled, inner):
    x = torch.ones(2, 2)
    with on_path(compiled):
        log = tl.trace(Outer(inner()), x)
    call = log.module_calls[0]
    assert call.output_ops == []  # not mul_1_1:1, whose saved value is from before the write
    assert isinstance(log["inner:1"], tl.ModuleCall) and isinstance(log["inner"], tl.Module)  # no op's value
    with pytest.raises(AttributeError, match=r"inner:1 returned no op's value \(no tensor, .* written through a view"):
        log["inner"].activation
    assert torch.equal(log["mul_1_1:1"].activation, torch.full((2, 2), 2.0))
    writer = log[-2].parents[0]  # the caller's next op reads the write, through a view
    assert log[writer].type in ("add", "zero")


@pytest.mark.parametrize("compiled", PATHS)
def test_selecting_a_module_whose_output_was_written_through_a_view_says_why_it_matched_nothing(compiled):
    with on_path(compiled), pytest.raises(tl.UnmatchedSelection, match="written through a view or its base"):
        tl.trace(Outer(WritesPartOfItsOutput()), torch.ones(2, 2), save=["inner"])


@pytest.mark.parametrize("compiled", PATHS)
def test_a_write_beside_a_module_output_leaves_it_named_by_its_op(compiled):
    x = torch.ones(2, 2)
    with on_path(compiled):
        log = tl.trace(Outer(WritesBesideItsOutput()), x)
    maker = next(op.label for op in log.ops if op.type == "getitem")
    assert log.module_calls[0].output_ops == [maker] == log[-2].parents


@pytest.mark.parametrize("compiled", PATHS)
def test_a_module_input_written_through_a_view_before_the_call_names_no_op(compiled):
    class Caller(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Identity()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            z = x * 2
            z[:, :1].zero_()
            return self.fc(self.inner(z))

    with on_path(compiled):
        log = tl.trace(Caller(), torch.ones(2, 2))
    inner, fc = log.module_calls
    assert inner.input_ops == [] == inner.output_ops == fc.input_ops
    assert log[log["fc"].parents[0]].type == "zero"  # the op reading it names the write


@pytest.mark.parametrize("compiled", PATHS)
def test_an_in_place_module_writing_its_input_is_its_own_output(compiled):
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True), nn.Linear(3, 3))
    with on_path(compiled):
        log = tl.trace(model, torch.randn(2, 3))
    linear, relu, _ = log.module_calls
    assert relu.input_ops == linear.output_ops and relu.output_ops == [log["1"].label]
    assert log["1"].type == "relu" and log["1"].is_inplace


@pytest.mark.parametrize("compiled", PATHS)
def test_a_write_elsewhere_leaves_a_module_input_named_by_its_op(compiled):
    # A train-mode BatchNorm writes its running statistics (a write noted after x's op): x itself is unwritten.
    class AfterANorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn, self.inner = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Identity()

        def forward(self, x):
            h = self.fc(x)
            return self.bn(h) + self.inner(h)

    with on_path(compiled):
        log = tl.trace(AfterANorm().train(), torch.randn(3, 4))
    fc, bn, inner = log.module_calls
    assert inner.input_ops == fc.output_ops == inner.output_ops == ["linear_1_1:1"]
