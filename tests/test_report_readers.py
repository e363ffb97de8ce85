"""Decisions in the report and record readers that no other test pins: which profiler range an op's row reads
when calls that return no tensor come between ops, and the small readers that summarize a trace."""

import torch
import torch.nn as nn

import torchlens as tl


class _NonTensorCalls(nn.Module):
    """Torch calls that return no tensor (``is_nonzero``, ``item``) between ops: each opens a profiler range
    but is not an op, so the op after it reuses its call index."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        torch.is_nonzero(x.sum() > -1e9)
        x.norm().item()
        return self.fc(x) * 2


def test_kernel_profile_rows_read_the_range_of_their_own_call():
    torch.manual_seed(0)
    profile = tl.report.kernel_profile(_NonTensorCalls(), (torch.randn(2, 4),))
    aten = {row["op"].split("_")[0]: row["aten"] for row in profile.ops}
    # The op's own range, not that of the no-tensor call that used its call index first.
    assert aten["norm"] == ["aten::linalg_vector_norm"]
    assert aten["linear"] == ["aten::linear"]
    assert aten["mul"] == ["aten::mul"]


def test_gradient_statistics_of_a_bfloat16_model_are_computed_in_float():
    # A bfloat16 norm keeps about three significant digits: the column would differ from the gradient's norm
    # in the third digit.
    torch.manual_seed(0)
    model = nn.Linear(16, 16).to(torch.bfloat16)
    log = tl.trace(model, torch.randn(4, 16, dtype=torch.bfloat16), grads=True)
    log.backward((log.output.float() * torch.randn(4, 16)).sum())
    (op,) = [op for op in log.ops if op.kind == "op"]
    row = log.to_pandas().set_index("label").loc[op.label]
    assert op.grad.dtype == torch.bfloat16
    assert row["grad_norm"] == float(torch.linalg.vector_norm(op.grad.float()))


def test_to_pandas_has_activation_follows_what_save_kept():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    log = tl.trace(model, torch.randn(3, 4), save=["1"])
    frame = log.to_pandas().set_index("label")
    kept = {op.label: op.has_activation for op in log.ops}
    assert True in kept.values() and False in kept.values()
    assert frame["has_activation"].to_dict() == kept


def test_cli_hot_path_text_shows_durations_in_milliseconds():
    from torchlens.cli import hot_path_text

    torch.manual_seed(0)
    log = tl.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(3, 4))
    top = tl.debug.hot_path(log, by="duration").rows[0]
    line = hot_path_text(log, 1, by="duration").splitlines()[1]
    assert line.split()[:3] == [top["address"], f"x{top['count']}", f"{top['total'] * 1e3:.3f}"]
    assert line.split()[3] == "ms"


def test_attribution_patching_of_a_linear_metric_is_exact_and_normalized_against_zero():
    # For metric = output.sum() the first-order estimate at the output op is the whole change, so its
    # normalized value, measured from 0 (not from the corrupted metric), is 1.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    clean, corrupt = torch.randn(3, 4), torch.randn(3, 4)
    table = tl.report.attribution_patching(model, clean, corrupt, lambda out: out.sum()).set_index("site")
    row = table.loc["linear_1_1:1"]
    span = table.attrs["clean"] - table.attrs["corrupt"]
    assert abs(row["estimate"] - span) <= 1e-5 * abs(span)
    assert abs(row["normalized"] - 1.0) <= 1e-5
