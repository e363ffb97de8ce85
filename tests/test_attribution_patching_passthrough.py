"""Gradient and intervention results checked against their definitions computed by hand on small models: where
torchlens reports a number, it is the one the definition gives, not a plausible neighbour."""

from __future__ import annotations

import torch
import torch.nn as nn

import torchlens as tl


class _PassThroughRead(nn.Module):
    """``h.to(h.dtype)`` hands back ``h`` itself: the ops after it read it as the ``to``'s output, while
    ``h`` is also read directly. Patching the ``to`` changes only what its readers see."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h.to(h.dtype).sum() * 2 + h.sum() * 3


class _InputPassThrough(nn.Module):
    """The same with an input that requires grad, handed back by ``contiguous()``."""

    def forward(self, x):
        return x.contiguous().sum() * 2 + x.sum() * 3


def _pair(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    clean, corrupt = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    return clean.requires_grad_(requires_grad), corrupt.requires_grad_(requires_grad)


def _estimate(model, clean, corrupt, site):
    table = tl.report.attribution_patching(model, clean, corrupt, lambda out: out)
    return table.set_index("site").estimate[site]


def test_attribution_of_an_op_returning_its_argument_counts_only_its_own_readers():
    torch.manual_seed(0)
    model = _PassThroughRead()
    clean, corrupt = _pair()
    with torch.no_grad():
        change = (model.fc(clean) - model.fc(corrupt)).sum()
    # The metric is linear in every value: the estimate is exact, 2 * change for the `to`, 5 * change for fc.
    assert abs(_estimate(model, clean, corrupt, "to_1_2:1") - 2 * float(change)) < 1e-5
    assert abs(_estimate(model, clean, corrupt, "linear_1_1:1") - 5 * float(change)) < 1e-5
    exact = tl.report.activation_patching(model, clean, corrupt, lambda out: out, sites=["to_1_2:1"], progress=False)
    estimate = tl.report.attribution_patching(model, clean, corrupt, lambda out: out).set_index("site")
    assert abs(estimate.normalized["to_1_2:1"] - exact.normalized[0]) < 1e-5


def test_attribution_of_an_op_returning_an_input_counts_only_its_own_readers():
    clean, corrupt = _pair(requires_grad=True)
    change = float((clean - corrupt).detach().sum())
    assert abs(_estimate(_InputPassThrough(), clean, corrupt, "contiguous_1_1:1") - 2 * change) < 1e-5


class _IdentityRead(nn.Module):
    """``nn.Identity`` returns the tensor it was given, which is also read directly."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.ident = nn.Identity()

    def forward(self, x):
        h = self.fc(x)
        return self.ident(h).sum() * 2 + h.sum() * 3


def test_attribution_of_a_call_returning_its_input_is_no_estimate_as_exact_patching_refuses_it():
    torch.manual_seed(0)
    model = _IdentityRead()
    clean, corrupt = _pair()
    rows = tl.report.attribution_patching(model, clean, corrupt, lambda out: out).set_index("site")
    exact = tl.report.activation_patching(model, clean, corrupt, lambda out: out, progress=False).set_index("site")
    assert exact.normalized.isna()["ident:1"] and "did not compute" in exact.error["ident:1"]
    assert rows.estimate.isna()["ident:1"] and "did not compute (linear_1_1:1" in rows.note["ident:1"]
    assert rows.estimate["fc:1"] == rows.estimate["linear_1_1:1"]  # a call computing its output keeps its estimate


class _NoGradInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            scale = self.fc(h).mean()
        return (h * scale + h.detach() * 2).sum()


def test_attribution_says_a_value_made_with_gradients_off_was_not_for_want_of_inputs_needing_grad():
    torch.manual_seed(0)
    clean, corrupt = _pair()
    notes = tl.report.attribution_patching(_NoGradInside(), clean, corrupt, lambda out: out).set_index("site").note
    assert "gradients off (under torch.no_grad()" in notes["linear_1_1:2"]
    assert "pass inputs that require grad" not in notes["linear_1_1:2"]
    assert "from a detached tensor" in notes["mul_2_5:1"]
