"""Options of render and show: each refused by name when wrong, before anything is drawn; grad_norm colours; the
statistics a record shows of values near the largest numbers of their dtype."""

from __future__ import annotations

import json
import math
import re
import statistics

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.viz.metrics import format_value


@pytest.fixture(scope="module")
def log():
    return tl.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), (torch.randn(2, 4),))


@pytest.mark.parametrize("fmt", ["dot", "html"])
def test_a_title_that_is_no_string_is_refused_by_name(log, fmt):
    with pytest.raises(TypeError, match=r"title= takes a string .* got int 5"):
        log.render(format=fmt, title=5)
    assert "<b>my model</b>" in log.render(title="my model")


@pytest.mark.parametrize("max_ops, error", [(-3, ValueError), ("10", TypeError)])
def test_show_outside_a_notebook_refuses_a_bad_max_ops_as_a_notebook_would(log, monkeypatch, max_ops, error):
    opened = []
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr("webbrowser.open", lambda url: opened.append(url) or True)
    with pytest.raises(error, match=r"^show: max_ops="):
        log.show(max_ops=max_ops)
    assert opened == []
    page = log.show(max_ops=10)  # a good value is taken, and unused outside a notebook: the page draws every op
    page.unlink()
    assert len(opened) == 1


def test_show_and_notebook_html_refuse_what_is_not_a_trace(log, monkeypatch):
    # show(model) and notebook_html(model) failed on a missing attribute ("'Sequential' object has no attribute
    # 'model_name'"), where render(model) says to trace the model first.
    opened = []
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr("webbrowser.open", lambda url: opened.append(url) or True)
    model = nn.Sequential(nn.Linear(4, 4))
    for reader in (tl.viz.show, tl.viz.notebook_html):
        with pytest.raises(TypeError, match=rf"^{reader.__name__} takes a Trace \(log = tl.trace\(model, x\)\), got "
                                            "Sequential: trace the model first"):
            reader(model)
    assert opened == []
    assert "<pre" in tl.viz.notebook_html(log, max_ops=0)


def test_color_by_grad_norm_without_gradients_says_how_to_get_them():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(tl.errors.GradientUnavailable, match="grads=True"):
        tl.trace(model, (torch.randn(2, 4),)).render(color_by="grad_norm")
    log = tl.trace(model, (torch.randn(2, 4),), grads=True)
    with pytest.raises(ValueError, match="run a backward through log.output first"):
        log.render(color_by="grad_norm", format="html")
    log.output.sum().backward()
    assert "colour: grad norm" in log.render(color_by="grad_norm")


def test_a_collapsed_module_shows_the_gradient_norm_of_its_ops_together_as_hot_path_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 1))
    log = tl.trace(model, (torch.randn(2, 4),), grads=True)
    log.output.sum().backward()
    norms = log.to_pandas().set_index("label")["grad_norm"]
    together = math.sqrt(norms["linear_1_1:1"] ** 2 + norms["tanh_1_2:1"] ** 2)  # not their sum, 1.56
    shown = re.search(r"<b>0:1 \(Sequential\)</b>.*?<br/><font point-size=\"8\">([^<]*)</font>>",
                      log.render(color_by="grad_norm", depth=0)).group(1)
    assert shown == format_value("grad_norm", together) == "1.1"
    by_module = {row["address"]: row["total"] for row in tl.debug.hot_path(log, by="grad_norm", group="module").rows}
    assert math.isclose(by_module["0:1"], together)


@pytest.mark.parametrize("values", [
    torch.randn(5, 7),  # finite floats
    torch.tensor([1.0, float("nan"), -3.0, float("inf"), 2.0]),  # the statistics skip NaN and Inf
    torch.tensor([float("nan"), float("-inf")]),  # nothing finite: counts only
    torch.randn(4, dtype=torch.bfloat16),
    torch.randint(-5, 5, (6,)),
    torch.tensor([True, False, True]),
    torch.randn(3, dtype=torch.complex64),  # magnitudes
    torch.randn(6, 4).t(),  # not contiguous
])
def test_activation_statistics_match_a_direct_computation(values):
    # The viewer's statistics take a shortcut for finite tensors (one sum decides, min and max in one
    # reduction): every figure must still be what the plain reductions give.
    from torchlens.viz.records import activation_stats

    stats = activation_stats(values)
    expected = {"numel": values.numel()}
    t = values.abs() if values.is_complex() else values
    if t.dtype == torch.bool:
        expected["true"] = int(t.sum())
    else:
        if t.is_floating_point():
            expected.update(nan=int(t.isnan().sum()), inf=int(t.isinf().sum()))
            t = t[t.isfinite()]
        t = t.double()
        if t.numel():
            expected.update(min=float(t.min()), max=float(t.max()), mean=float(t.mean()))
        if t.numel() > 1:
            expected["std"] = float(t.std())
    assert stats.keys() == expected.keys()
    assert stats == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("values, std", [
    ([1.7e308, 1.6e308, 1.65e308], statistics.stdev([1.7e308, 1.6e308, 1.65e308])),  # their sum overflows float64
    ([1e200, -1e200, 3e199], statistics.stdev([1e200, -1e200, 3e199])),  # their squares overflow
    ([1.7e308, -1.7e308], "2.40416e+308"),  # a std beyond float64's largest number, given as text
], ids=["sum", "squares", "beyond"])
def test_statistics_of_float64_values_near_overflow_are_what_exact_arithmetic_gives(values, std):
    # Reduced directly in float64, the mean of values near 1.8e308 and the std of values above 1e154 overflow:
    # the panel said mean inf and std inf of finite values, and the page's data held Infinity, which JSON.parse
    # refuses, so the viewer of such a trace drew nothing at all.
    class Passes(nn.Module):
        def forward(self, x):
            return x * 1.0

    log = tl.trace(Passes(), torch.tensor(values, dtype=torch.float64))
    page = log.render(format="html")
    raw = re.search(r'id="tl-data">(.*?)</script>', page, re.S).group(1)
    data = json.loads(raw, parse_constant=lambda name: pytest.fail(f"the page's data holds {name}"))
    stats = next(rec["activation"] for rec in data["items"].values() if rec.get("label") == "mul_1_1:1")
    assert stats["mean"] == pytest.approx(statistics.mean(values), rel=1e-5)
    assert stats["std"] == (std if isinstance(std, str) else pytest.approx(std, rel=1e-5))


class _Pairs(nn.Module):
    """Each value made the real and imaginary part of a complex64 number, read back through its parts."""

    def forward(self, x):
        return torch.view_as_real(torch.complex(x, x) * 1.0).sum()


def test_complex64_values_with_finite_parts_have_finite_magnitudes():
    # |2.5e38 + 2.5e38j| is 3.5e38, past float32's largest number: taken in complex64's own float32, the magnitude
    # was Inf, and the viewer and the gradient columns counted an Inf the values do not hold (op.finite says none).
    x = torch.full((2,), 2.5e38, requires_grad=True)
    log = tl.trace(_Pairs(), x, grads=True, record_finite=True)
    log.backward(log.output, torch.tensor(3e38))  # d loss / d z = 3e38 + 3e38j, finite
    op = log["mul_1_2:1"]
    assert op.dtype == torch.complex64 and op.finite == (False, False)
    frame = log.to_pandas().set_index("label")
    assert frame.loc[op.label, "grad_nonfinite"] == 0
    assert frame.loc[op.label, "grad_max"] == pytest.approx(3e38 * math.sqrt(2), rel=1e-6)
    data = json.loads(re.search(r'id="tl-data">(.*?)</script>', log.render(format="html"), re.S).group(1))
    record = next(rec for rec in data["items"].values() if rec.get("label") == op.label)
    assert record["activation"]["inf"] == 0
    assert record["activation"]["max"] == pytest.approx(2.5e38 * math.sqrt(2), rel=1e-5)
    assert record["gradient"]["inf"] == 0 and record["gradient"]["non-finite"] == 0
