"""Gradients through the tools that read a trace: saved-for-backward memory, the debug helpers, the kernel
profile, the viewer, and interventions (save, load and extraction: test_grads_io.py).
"""

from __future__ import annotations

import gc
import math
import re
import warnings

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.record.errors import GradientUnavailable
from grad_oracle import Oracle, _assert_bit_identical, _op_grads
from zoo import zoo


def test_saved_for_backward_bytes_count_distinct_storages():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with pytest.raises(GradientUnavailable, match="saved_for_backward=True"):
        tl.trace(model, x, grads=True)["0"].saved_for_backward_bytes
    log = tl.trace(model, x, saved_for_backward=True)
    fp = 4
    # The first linear keeps only its input (the weight's gradient needs it; x needs no gradient),
    # relu its output, the second linear relu's output (the same storage: counted once in totals) and
    # its weight (to pass the gradient on to relu).
    assert log["0"].saved_for_backward_bytes == 3 * 4 * fp
    assert log["1"].saved_for_backward_bytes == 3 * 8 * fp
    assert log["2"].saved_for_backward_bytes == (3 * 8 + 2 * 8) * fp
    assert log.saved_for_backward_bytes == (3 * 4 + 3 * 8 + 2 * 8) * fp
    table = log.saved_for_backward()
    assert [r["module_call"] for r in table.rows] == ["2:1", "1:1", "0:1"]
    assert "saved for backward" in str(table)
    long_named = torch.nn.Sequential(type("LinearWithAClassNameOverTwenty", (torch.nn.Linear,), {})(4, 2))
    shown = str(tl.trace(long_named, torch.randn(3, 4, requires_grad=True), saved_for_backward=True)
                .saved_for_backward())
    assert "0:1          LinearWithAClassNameOverTwenty " in shown  # the class was cut to 20 characters
    x.requires_grad_()
    log = tl.trace(model, x, saved_for_backward=True)
    assert log["0"].saved_for_backward_bytes == (3 * 4 + 8 * 4) * fp  # now the weight is kept for x's gradient


class Cube(torch.autograd.Function):
    """Keeps its input for backward: torch packs it as ``apply`` returns, after the forward's ops ran."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


class CubedThenProjected(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.proj = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.proj(Cube.apply(self.inner(x)))


@pytest.mark.parametrize("grads", [False, True])
def test_what_a_custom_function_keeps_for_backward_is_counted_at_its_output_op(grads):
    # It was counted at the op after the Function (proj's linear, in another module call), as the
    # pack hook ran after the Function's forward had recorded its ops.
    torch.manual_seed(0)
    log = tl.trace(CubedThenProjected(), torch.randn(3, 4), saved_for_backward=True, grads=grads)
    fp = 4
    assert log["mul_2_3:1"].saved_for_backward_bytes == 3 * 8 * fp  # the cube, holding the Function's output
    assert log["mul_1_2:1"].saved_for_backward_bytes == 0
    assert log["proj"].saved_for_backward_bytes == (3 * 8 + 2 * 8) * fp  # its own input and weight alone


def test_saved_for_backward_left_to_callers_own_hooks():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with torch.autograd.graph.save_on_cpu():
        log = tl.trace(model, torch.randn(3, 4), grads=True, saved_for_backward=True)
    with pytest.raises(GradientUnavailable, match="saved_tensors_hooks"):
        log.saved_for_backward_bytes
    log.backward(log.output.sum())
    assert log["0"].grad is not None


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval(), torch.randint(0, 64, (2, 8))


def test_gpt2_gradients_bit_identical_to_an_untraced_run():
    model, ids = _gpt2()
    oracle = Oracle(how="hook")
    with oracle:
        logits = model(ids).logits
    logits.logsumexp(-1).sum().backward()
    expected = oracle.grads()
    ref_params = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    log = tl.trace(model, ids, grads=True, saved_for_backward=True)
    log.backward(log.output.logits.logsumexp(-1).sum())
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, expected)
    assert all(torch.equal(p.grad, ref_params[n]) for n, p in model.named_parameters())
    block = log["transformer.h.1:1"]
    assert block.grad is not None
    params = {p.address: p for p in log.params}
    assert torch.equal(params["transformer.wte.weight"].grad, ref_params["transformer.wte.weight"])
    assert log.saved_for_backward_bytes > 0
    top = log.saved_for_backward().rows[0]
    assert top["module_call"] in ("transformer:1", "self:1") or top["saved_for_backward_bytes"] > 0


def test_hot_path_by_grad_norm_and_saved_for_backward():
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, grads=True, saved_for_backward=True)
    with pytest.raises(ValueError, match="backward"):
        tl.debug.hot_path(log, by="grad_norm")
    log.backward(log.output.pow(2).sum())
    ranked = tl.debug.hot_path(log, by="grad_norm")
    norms = {op.label: float(torch.linalg.vector_norm(op.grad)) for op in log if op.kind == "op"}
    assert [r["address"] for r in ranked.rows] == sorted(norms, key=norms.get, reverse=True)
    assert ranked.rows[0]["total"] == pytest.approx(max(norms.values()))
    by_module = {r["address"]: r["total"] for r in tl.debug.hot_path(log, by="grad_norm", group="module")}
    head = [op for op in log if op.module == "head:1"]
    assert by_module["head:1"] == pytest.approx(sum(norms[op.label] ** 2 for op in head) ** 0.5)
    # percent is a share of the squared total (squares add up, norms do not), and the printed table says so.
    grand = sum(value ** 2 for value in norms.values())
    assert [r["percent"] for r in ranked.rows] == pytest.approx([100 * r["total"] ** 2 / grand for r in ranked.rows])
    assert "percent is its share of the total's square" in str(ranked)
    saved = tl.debug.hot_path(log, by="saved_for_backward", group="module")
    assert {r["address"]: r["total"] for r in saved} == {
        mc.label: mc.saved_for_backward_bytes for mc in log.module_calls}
    with pytest.raises(GradientUnavailable, match="grads=True"):
        tl.debug.hot_path(tl.trace(model, args), by="grad_norm")


class _NaNSideBranch(nn.Module):
    """A side branch whose backward is NaN (sqrt at 0, times 0) between two finite ones."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        small = self.b(h) * 0.01
        bad = torch.sqrt(h * 0) * 0
        big = self.c(h) * 10.0
        return small.sum() + bad.sum() + big.sum()


def test_hot_path_ranks_nan_gradients_first_and_the_rest_in_order():
    torch.manual_seed(0)
    log = tl.trace(_NaNSideBranch(), torch.randn(4, 8), grads=True)
    log.backward(log.output)
    norms = {op.label: float(torch.linalg.vector_norm(op.grad)) for op in log if op.kind == "op"}
    assert any(math.isnan(v) for v in norms.values())
    for group in ("op", "layer", "module", "source"):
        totals = [r["total"] for r in tl.debug.hot_path(log, by="grad_norm", group=group)]
        nan_rows = sum(1 for t in totals if math.isnan(t))
        assert nan_rows and all(math.isnan(t) for t in totals[:nan_rows]), group
        assert totals[nan_rows:] == sorted(totals[nan_rows:], reverse=True), group
    by_op = tl.debug.hot_path(log, by="grad_norm").rows
    first_finite = next(r for r in by_op if not math.isnan(r["total"]))
    assert first_finite["total"] == pytest.approx(max(v for v in norms.values() if not math.isnan(v)))



_EXPLODING = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("dtype, scale", [(torch.float32, 1e20), (torch.bfloat16, 1e20), (torch.float64, 1e200)])
def test_a_finite_exploding_gradient_has_a_finite_norm(dtype, scale):
    # Entries near 1e20 are finite in float32 and bfloat16, their squares are not: torch's own norm of such a
    # gradient is Inf, which the statistics and hot_path reported while counting no non-finite entry.  Norms near
    # 1e200 of float64 gradients are finite, their squares are not even as Python floats: hot_path and the viewer,
    # combining norms through their squares, gave Inf totals and NaN percentages.
    from torchlens.viz.metrics import aggregate, op_values

    model = _EXPLODING.to(dtype)
    log = tl.trace(model, torch.randn(3, 4, generator=torch.Generator().manual_seed(0), dtype=dtype), grads=True)
    log.backward(log.output.sum() * scale)
    frame = log.to_pandas().set_index("label")
    for op in log:
        if op.kind == "op":
            assert torch.isfinite(op.grad).all() and frame.loc[op.label, "grad_nonfinite"] == 0, op.label
            largest = float(op.grad.double().abs().max())  # scaled: the squares of float64 ones overflow too
            expected = largest * float(torch.linalg.vector_norm(op.grad.double() / largest))
            assert frame.loc[op.label, "grad_norm"] == pytest.approx(expected, rel=1e-5), op.label
    for group in ("op", "module"):
        rows = tl.debug.hot_path(log, by="grad_norm", group=group).rows
        assert all(math.isfinite(r["total"]) and math.isfinite(r["percent"]) for r in rows), group
    norms = [frame.loc[op.label, "grad_norm"] for op in log if op.kind == "op"]
    together = math.sqrt(sum((norm / max(norms)) ** 2 for norm in norms)) * max(norms)
    assert tl.debug.hot_path(log, by="grad_norm").total == pytest.approx(together)
    ops = [op.index for op in log if op.kind == "op"]
    assert aggregate(op_values(log, "grad_norm"), ops, "grad_norm") == pytest.approx(together)  # a collapsed box


class _Spectral(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        spectrum = torch.fft.rfft(self.fc(x), dim=-1) * (1 + 2j)
        return torch.fft.irfft(spectrum, n=8, dim=-1)


def test_a_complex_gradients_min_and_max_are_those_of_its_magnitudes():
    torch.manual_seed(0)
    log = tl.trace(_Spectral(), torch.randn(2, 8), grads=True)
    log.backward(log.output.pow(2).sum())
    frame = log.to_pandas().set_index("label")
    complex_ops = [op for op in log if op.kind == "op" and op.dtype.is_complex]
    assert complex_ops
    for op in complex_ops:
        magnitudes = op.grad.abs()
        assert frame.loc[op.label, "grad_min"] == float(magnitudes.min()), op.label
        assert frame.loc[op.label, "grad_max"] == float(magnitudes.max()), op.label
        assert frame.loc[op.label, "grad_norm"] == pytest.approx(float(torch.linalg.vector_norm(op.grad)))

class SqrtOfZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        spread = h.norm(dim=-1, keepdim=True) * 0.0  # finite in the forward; sqrt'(0) is Inf
        return self.b(torch.sqrt(spread) + h)


def test_nonfinite_origin_of_gradients_names_the_first_op_in_backward_order():
    log = tl.trace(SqrtOfZero(), torch.randn(3, 4), grads=True)
    log.backward(log.output.sum())
    assert not tl.debug.nonfinite_origin(log)  # the forward is finite
    report = tl.debug.nonfinite_origin(log, grads=True)
    assert report.origin_label == "mul_1_3:1" and report.kind == "inf"
    assert report.born_in == ("sqrt_1_4:1",)
    assert set(report.nonfinite) == {"mul_1_3:1", "norm_1_2:1", "linear_1_1:1"}
    assert "detect_anomaly" in str(report) and "sqrt_1_4:1" in str(report)
    selected = tl.trace(SqrtOfZero(), torch.randn(3, 4), grads=["b"])
    selected.backward(selected.output.sum())
    # Only b's gradients are watched, and they are finite; a's parameters' own .grad still hold Inf.
    report = tl.debug.nonfinite_origin(selected, grads=True)
    assert report.origin is None and report.parameters == ("a.weight", "a.bias") and not report.born_in
    assert "grads=[...]" in str(report)
    clean = tl.trace(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(3, 4), grads=True)
    clean.backward(clean.output.sum())
    assert not tl.debug.nonfinite_origin(clean, grads=True)
    # A non-finite loss: the first gradient of the backward, the output's, is already NaN.
    seeded = tl.trace(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(3, 4), grads=True)
    seeded.backward(seeded.output.sum() * float("nan"))
    report = tl.debug.nonfinite_origin(seeded, grads=True)
    assert report.loss_nonfinite and report.origin_label == "linear_2_3:1" and "the loss side" in str(report)


class SqrtBesideOthers(nn.Module):
    """``a`` feeds ``sqrt`` (whose backward at 0, times a zero gradient, is NaN), a comparison (no
    backward edge) and, with ``scale``, a multiplication whose backward is finite."""

    def __init__(self, scale):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x):
        a = torch.relu(self.fc(x))
        out = torch.sqrt(a) * 0.0 + (a > 0).float()
        return out + a * 3.0 if self.scale else out


def anomaly_node(model, x) -> str:
    """The backward node autograd's anomaly mode names for the first NaN of ``model(x).sum()``'s backward."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.set_detect_anomaly(True), pytest.raises(RuntimeError) as error:
            model(x).sum().backward()
    return re.search(r"Function '(\w+)' returned nan", str(error.value)).group(1)


@pytest.mark.parametrize("scale", [False, True])
def test_born_in_names_only_ops_whose_backward_can_have_produced_it(scale):
    """Anomaly mode names SqrtBackward0. The comparison has no backward edge, so it is never named; the
    finite multiplication can be told apart from sqrt only by anomaly mode, so it leaves born_in a list of
    candidates, not a claim."""
    torch.manual_seed(0)
    model, x = SqrtBesideOthers(scale), torch.randn(8, 4)
    node = anomaly_node(model, x)
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    report = tl.debug.nonfinite_origin(log, grads=True)
    assert report.origin.func_name == "relu" and report.kind == "nan"
    born = {log[label].func_name: log[label].grad_fn for label in report.born_in}
    assert born.get("sqrt") == node == "SqrtBackward0"
    assert "gt" not in born
    if scale:
        assert set(born) == {"sqrt", "mul"} and not report.born_in_certain
        assert "one or more of" in str(report)
    else:
        assert set(born) == {"sqrt"} and report.born_in_certain
        assert f"born in the backward of {report.born_in[0]} (" in str(report)


class SqrtOfParameter(nn.Module):
    """The NaN is born where the gradient enters a parameter: ``sqrt``'s backward at 0, times 0, lands
    on ``scale.grad`` and on no op's gradient."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + torch.sqrt(self.scale) * 0.0


def test_a_gradient_non_finite_only_on_a_parameter_is_reported_with_the_op_that_read_it():
    torch.manual_seed(0)
    model, x = SqrtOfParameter(), torch.randn(3, 4)
    node = anomaly_node(model, x)
    model.zero_grad(set_to_none=True)
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    assert torch.isnan(model.scale.grad).all()  # the parameter's own gradient, read from torch
    report = tl.debug.nonfinite_origin(log, grads=True)
    assert report and report.found and report.origin is None
    assert report.parameters == ("scale",) and report.kind == "nan"
    assert report.born_in_certain and log[report.born_in[0]].grad_fn == node == "SqrtBackward0"
    assert "scale" in str(report) and "every gradient the trace received is finite" not in str(report)


class InfOfParameter(nn.Module):
    """``sqrt``'s backward at 0 sends Inf into ``scale.grad``; nothing turns it into a NaN."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + torch.sqrt(self.scale)


def test_an_inf_only_backward_is_reported_with_anomaly_modes_nan_only_check_said():
    """Anomaly mode checks backward outputs for NaN alone: on an Inf-only backward it raises nothing, so
    the report must not send the user to it as if it would name the node."""
    torch.manual_seed(0)
    model, x = InfOfParameter(), torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.set_detect_anomaly(True):
            model(x).sum().backward()  # raises nothing
    assert torch.isinf(model.scale.grad).all()
    model.zero_grad(set_to_none=True)
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    report = tl.debug.nonfinite_origin(log, grads=True)
    assert report.kind == "inf" and report.parameters == ("scale",)
    assert "anomaly mode checks for NaN alone" in str(report)
    assert "NaN only" in tl.debug.DETECT_ANOMALY_RECIPE


def test_kernel_profile_reuses_a_grads_trace_and_reports_backward_per_module_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    fresh = tl.report.kernel_profile(model, x, backward=True)
    model.zero_grad()
    log = tl.trace(model, x, grads=True)
    reused = tl.report.kernel_profile(log, backward=True)
    assert log.num_backwards == 1 and log["linear_1_1:1"].grad is not None  # the profiled backward filled them
    # It is the trace's own backward: the parameters' .grad are a plain backward's, not set aside.
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.autograd.backward(model(x), grad_tensors=torch.ones(3, 2))
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))
    # The same backward nodes land on the same ops and module calls, with no second forward.
    assert [(r["op"], r["bwd_aten_ops"]) for r in reused.ops] == [(r["op"], r["bwd_aten_ops"]) for r in fresh.ops]
    assert all(r["cpu_ns"] is None and r["bwd_cpu_ns"] > 0 for r in reused.ops)
    by_call = {r["module_call"]: r for r in reused.module_calls}
    inside = [r["bwd_aten_ops"] for r in reused.ops if r["module"] in ("2.0:1", "2.1:1")]
    assert by_call["2:1"]["bwd_aten_ops"] == sum(inside)
    assert "module calls by backward" in str(reused)
    with pytest.raises(ValueError, match="backward"):
        tl.report.kernel_profile(tl.trace(model, x, grads=True), backward=False)
    with pytest.raises(GradientUnavailable, match="grads=True"):
        tl.report.kernel_profile(tl.trace(model, x), backward=True)


@pytest.mark.parametrize("name", ["bert", "transformer_encoder"])
def test_backward_only_profile_of_a_corpus_model_matches_the_full_profile(name):
    """Dropout in eval mode and ``contiguous`` on a contiguous tensor hand on their input: they make no
    backward node, so their backward is a measured zero, as the forward-and-backward profile (which links
    nodes through the profiler's own sequence numbers) finds it; the backward-only profile is complete."""
    import real_models

    model, args, kwargs = real_models.build(name)
    model.eval()
    loss = lambda out: (out.logits if hasattr(out, "logits") else out).sum().backward()
    fresh = tl.report.kernel_profile(model, args, kwargs, backward=loss)
    model.zero_grad(set_to_none=True)
    log = tl.trace(model, args, kwargs, grads=True, save="none")
    reused = tl.report.kernel_profile(log, backward=loss)
    model.zero_grad(set_to_none=True)
    handed_on = [op.label for op in log.ops if op.kind == "op" and op.func_name in ("dropout", "contiguous")
                 and op.grad_fn == log[op.parents[0]].grad_fn]
    assert handed_on  # the case at issue is present
    assert reused.complete and not reused.coverage.problems
    assert [(r["op"], r["bwd_aten_ops"]) for r in reused.ops] == [(r["op"], r["bwd_aten_ops"]) for r in fresh.ops]


def test_backward_only_profile_prints_its_costliest_backward_ops():
    import real_models

    model, args, kwargs = real_models.build("bert")
    model.eval()
    log = tl.trace(model, args, kwargs, grads=True, save="none")
    kp = tl.report.kernel_profile(log, backward=lambda out: out.logits.sum().backward())
    model.zero_grad(set_to_none=True)
    text = str(kp)
    # No forward ran under this profiler: ranking by forward time would list ops in execution order.
    assert "backward only" in text and "forward + backward" not in text
    title = "top 15 ops by backward self CPU time:"
    assert title in text
    listed = [line.split()[0] for line in text.split(title)[1].splitlines()[2:17]]
    costliest = sorted(kp.ops, key=lambda r: -r["bwd_cpu_ns"])[:15]
    assert listed == [r["op"] for r in costliest]


def test_viewer_colours_by_gradient_norm_and_shows_gradient_stats():
    from torchlens.viz.metrics import Coloring, op_values

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    log = tl.trace(model, torch.randn(3, 4), grads=True)
    log.backward(log.output.pow(3).sum())
    values = op_values(log, "grad_norm")
    for op in log:
        if op.has_grad:
            assert values[op.index] == pytest.approx(float(torch.linalg.vector_norm(op.grad)))
    svg = log.render(color_by="grad_norm", format="svg")
    assert "colour: grad norm" in svg
    html = log.render(color_by="grad_norm", format="html")
    assert '"gradient":{' in html and '"norm":' in html
    exploded = tl.trace(model, torch.randn(3, 4), grads=True)
    exploded.backward(torch.sqrt(exploded.output - 1e6).sum())  # NaN gradients
    values = op_values(exploded, "grad_norm")
    coloring = Coloring("grad_norm", values)
    top = coloring.fill(max(v for v in values if v is not None))
    assert coloring.fill(values[exploded["linear_2_3:1"].index]) == top  # the darkest colour
    html = exploded.render(color_by="grad_norm", format="html")
    assert '"norm":"nan"' in html



def test_viewer_says_why_a_batched_backwards_gradient_has_no_values_shown():
    # is_grads_batched=True hands every hook vmap's batched gradient, which cannot be read: the viewer read it and
    # raised GradientUnavailable, failing the whole render.
    torch.manual_seed(0)
    x = torch.randn(1, 4, requires_grad=True)
    log = tl.trace(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), x, grads=True)
    rows = torch.eye(3).reshape(3, 1, 3)
    torch.autograd.grad(log.output, x, grad_outputs=rows, is_grads_batched=True)
    assert log["linear_1_1:1"].has_grad
    html = log.render(format="html")
    assert '"gradient":"unreadable: a backward run under vmap' in html

class RaisesMidway(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.kept = []

    def forward(self, x):
        h = self.fc(x)
        self.kept.append(h)  # a tensor that outlives the failed forward
        raise RuntimeError("model failure")


def test_a_forward_that_raises_leaves_no_hook_behind():
    model = RaisesMidway()
    with pytest.raises(RuntimeError, match="model failure"):
        tl.trace(model, torch.randn(2, 4), grads=True, saved_for_backward=True)
    gc.collect()
    (h,) = model.kept
    assert not h._backward_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # no saved-tensor hooks left
    from torchlens.capture.function_outputs import _HOST, _ORIGINAL_APPLY

    assert vars(_HOST).get("apply") is _ORIGINAL_APPLY  # torch's own Function.apply is back
    h.sum().backward()  # an untraced backward afterwards runs as usual
    assert model.fc.weight.grad is not None


def test_gradients_of_an_intervened_run_follow_the_value_downstream_saw():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    x = torch.randn(3, 6)

    kept = {}

    def halve(module, args, output):  # the same edit as tl.scale(0.5), by hand
        edited = output * 0.5
        edited.retain_grad()
        kept["edited"] = edited
        return edited

    handle = model[1].register_forward_hook(halve)
    try:
        model(x).sum().backward()
    finally:
        handle.remove()
    expected_param_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    log = tl.trace(model, x, grads=True, intervene={"1": tl.scale(0.5)})
    log.backward(log.output.sum())
    site = log["1"]
    assert site.intervention is not None
    assert torch.equal(site.grad, kept["edited"].grad)
    for p, expected in zip(model.parameters(), expected_param_grads):
        assert torch.equal(p.grad, expected)
    log.cleanup()


def test_a_value_replaced_by_an_intervention_says_so_when_it_has_no_gradient():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    log = tl.trace(model, torch.randn(3, 4), grads=True, intervene={"relu_1_2:1": tl.zero_ablate()})
    log.backward(log.output.sum())
    with pytest.raises(GradientUnavailable, match="an intervention .*zero_ablate") as raised:
        log["relu_1_2:1"].grad
    assert "no_grad" not in str(raised.value)


def test_a_backward_refused_after_an_edit_written_into_an_in_place_op_names_the_site_and_the_way_out():
    # An intervention at an in-place op (relu_, as nn.ReLU(inplace=True) runs) writes its value into the tensor
    # the op returned, which the op's backward keeps: autograd refused the backward naming a write the model never
    # made.  The refusal now says which site wrote; a module site there edits a new tensor, and its backward runs.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    log = tl.trace(model, x, grads=True, intervene={"relu_1_2:1": tl.scale(0.5)})
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        log.backward(log.output.sum())
    note = " ".join(getattr(raised.value, "__notes__", []))
    assert "relu_1_2:1" in note and "module" in note and "linear_1_1:1" in note
    by_module = tl.trace(model, x, grads=True, intervene={"1": tl.scale(0.5)})
    by_module.backward(by_module.output.sum())
    hooked = model[1].register_forward_hook(lambda module, args, out: out * 0.5)
    try:
        h = model[1](model[0](x))
        h.retain_grad()
        model[2](h).sum().backward()
    finally:
        hooked.remove()
    assert torch.equal(by_module["1"].grad, h.grad)


def test_a_meta_device_backward_is_read_as_shapes_without_values(tmp_path):
    # A meta forward and backward have shapes and no values: the gradient statistics (to_pandas, the html
    # viewer, log.save) raised torch's "Tensor.item() cannot be called on meta tensors", the viewer raised
    # it for the activations too, and nonfinite_origin(grads=True) said every gradient was finite.
    with torch.device("meta"):
        model, x = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 4)
    assert "<html" in tl.trace(model, x).render(format="html").lower()
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    assert log["linear_1_1:1"].grad.is_meta and log["linear_1_1:1"].grad.shape == (3, 8)
    frame = log.to_pandas()
    assert frame["grad_norm"].isna().all() and frame["grad_nonfinite"].isna().all()
    assert "no values: a meta tensor" in log.render(format="html")
    with pytest.raises(ValueError, match="meta device"):
        tl.debug.nonfinite_origin(log, grads=True)
    loaded = tl.load(log.save(tmp_path / "meta"))
    assert [op.shape for op in loaded] == [op.shape for op in log]
