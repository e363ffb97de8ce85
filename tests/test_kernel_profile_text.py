"""The printed form of tl.report.kernel_profile where there is nothing to rank."""

import pytest
import torch
import torch.nn as nn

import torchlens as tl


def test_a_forward_that_ran_no_torch_op_says_so_rather_than_print_an_empty_top_table():
    text = str(tl.report.kernel_profile(nn.Identity(), torch.randn(2, 3)))
    assert "KernelProfile of Identity: 0 torch calls" in text
    assert "the forward ran no torch ops: there is nothing to rank" in text
    assert "top 0 ops" not in text


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("level", ["op", "layer", "module"])
def test_the_tables_of_a_forward_that_ran_no_torch_op_have_the_columns_of_any_other(level, backward):
    # A table of no rows was a DataFrame of no columns: reading a column of it (table["cpu_ns"].sum()) raised a
    # KeyError where a model with ops gives a number.
    empty = tl.report.kernel_profile(nn.Identity(), torch.randn(2, 3, requires_grad=True), backward=backward)
    model = nn.Sequential(nn.Linear(3, 3))
    ran = tl.report.kernel_profile(model, torch.randn(2, 3, requires_grad=True), backward=backward)
    table = empty.to_pandas(level)
    assert table.empty and list(table.columns) == list(ran.to_pandas(level).columns)
    assert table["cpu_ns"].sum() == 0


def test_a_forward_with_ops_still_ranks_them():
    text = str(tl.report.kernel_profile(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), torch.randn(2, 3)))
    assert "top 2 ops by self CPU time:" in text and "ran no torch ops" not in text


def test_the_header_counts_torch_calls_as_print_log_does_when_a_call_returns_several_tensors():
    # An LSTM returns three tensors and chunk two: the header said "6 ops" of a trace print(log) gives 9 ops.
    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.fc = nn.LSTM(6, 4, batch_first=True), nn.Linear(4, 2)

        def forward(self, x):
            first, second = self.lstm(x)[0].chunk(2, dim=1)
            return self.fc(first + second)

    profile = tl.report.kernel_profile(Recurrent(), torch.randn(2, 4, 6))
    calls = len(profile.trace.calls)
    assert len(profile.ops) == calls < sum(op.kind == "op" for op in profile.trace.ops)
    assert f"from {calls} torch calls" in str(profile.trace)  # print(log) names the same count
    assert str(profile).startswith(f"KernelProfile of Recurrent: {calls} torch calls, forward")
    assert repr(profile).startswith(f"<KernelProfile of Recurrent: {calls} torch calls,")
