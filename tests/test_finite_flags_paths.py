"""``record_finite=True`` on every path an op's output is recorded by: each op's ``(has_nan, has_inf)`` flag
must be the one its own value gives, whether the op took the hot path (one tensor out, the inline scan,
``F.linear`` with parameters), the path for several outputs, or a write in place."""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl
from torchlens.record.finite import nonfinite_flags


class Mixed(nn.Module):
    """Ops of every recording path, with a NaN and an Inf made midway and a later op that hides them."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x):
        h = self.proj(x)                       # F.linear with parameters
        r = torch.sqrt(h)                      # NaN where h < 0 (one tensor out, inline scan)
        big = h * 1e30 * 1e30                  # Inf in float32
        values, _ = torch.max(big, dim=1)      # several outputs
        w = h.clone()
        w.div_(0.0)                            # a write in place: Inf and NaN (0 / 0 where h == 0)
        clean = torch.nan_to_num(r + big)      # finite again
        return F.relu(clean) + values.clamp(max=1.0).unsqueeze(1) + w.isnan().float()


@pytest.fixture(scope="module")
def traced():
    torch.manual_seed(0)
    model = Mixed().eval()
    x = torch.randn(4, 6)
    x[0, 0] = 0.0
    with torch.no_grad():
        model.proj.weight[0].zero_()
        model.proj.bias[0] = 0.0                # so that h[0, 0] == 0 and the write makes a 0 / 0
    return tl.trace(model, x), tl.trace(model, x, save="none", record_finite=True)


def test_each_op_flag_is_the_one_its_saved_value_gives(traced):
    saved, flagged = traced
    assert [op.label for op in saved.ops] == [op.label for op in flagged.ops]
    kinds = {op.func_name: op.finite for op in flagged.ops}
    assert kinds["sqrt"] == (True, False) and kinds["div_"] == (True, True) and kinds["nan_to_num"] == (False, False)
    for saved_op, op in zip(saved.ops, flagged.ops):
        if op.is_output:  # the output is the last op's value, flagged there
            continue
        assert op.finite == nonfinite_flags(saved_op.activation), op.label


def test_nonfinite_origin_reads_the_flags_of_a_metadata_trace(traced):
    _, flagged = traced
    flagged.cleanup()
    report = tl.debug.nonfinite_origin(flagged)
    assert report.found and report.certain and report.origin.func_name == "sqrt"


def test_a_finite_flags_trace_keeps_the_hot_path(monkeypatch):
    """The flags are one check per output: a trace that records them takes the path a trace without them
    takes (the compiled handler, where torchlens-accel is in use), not the feature path of deep capture."""
    from torchlens.capture.mode import CaptureMode

    featured = []
    general = CaptureMode._call_with_features

    def counted(self, func, *rest):
        featured.append(func)
        return general(self, func, *rest)

    monkeypatch.setattr(CaptureMode, "_call_with_features", counted)
    model = Mixed().eval()
    x = torch.randn(4, 6)
    log = tl.trace(model, x, save="none", record_finite=True)
    assert featured == [] and log["sqrt_1_2:1"].finite is not None
    tl.trace(model, x, deep=True)
    assert featured  # the witness: the feature path is seen when taken (deep capture takes it at every op)


def _exact(t):
    return bool(torch.isnan(t).any()), bool(torch.isinf(t).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_one_pass_check_gives_the_exact_flags(dtype):
    """A finite sum proves every value finite; where it is not (a NaN, an Inf, both signs of Inf, or finite
    values whose sum overflows), the exact check decides: the flags are the same either way."""
    top = torch.finfo(dtype).max
    cases = [torch.randn(5, 7), torch.randn(5, 7).t(), torch.randn(0, 3), torch.tensor(2.5),
             torch.tensor([1.0, float("nan")]), torch.tensor([float("inf"), 1.0]), torch.tensor([-float("inf")]),
             torch.tensor([float("inf"), -float("inf")]), torch.tensor([float("nan"), float("inf")])]
    cases = [c.to(dtype) for c in cases] + [torch.full((4,), top, dtype=dtype)]  # finite, summing past max
    for t in cases:
        assert nonfinite_flags(t) == _exact(t), t
    assert cases[-1].sum().isinf() and nonfinite_flags(cases[-1]) == (False, False)


@pytest.fixture(scope="module")
def nan_running_var():
    """A BatchNorm whose running variance holds a NaN (a diverged update of its statistics)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU()).eval()
    model[1].running_var[1] = float("nan")
    return model


@pytest.mark.parametrize("save", ["none", ["0"]])
def test_a_buffer_is_flagged_like_an_input_so_its_nan_is_named_without_saving_it(nan_running_var, save):
    """A buffer is a source as an input is: with flags alone, its NaN is named as already in the buffer, as with
    saved activations, not left unexamined, which made the batch norm reading it only a possible origin."""
    log = tl.trace(nan_running_var, torch.randn(3, 4), save=save, record_finite=True)
    var = next(op for op in log.ops if op.kind == "buffer" and op.io_path == "1.running_var")
    assert var.finite == (True, False)
    report = tl.debug.nonfinite_origin(log)
    assert report.certain and report.origin_kind == "buffer" and report.origin_label == var.label
    assert [log[label].func_name for label in report.propagators] == ["batch_norm", "relu"]
