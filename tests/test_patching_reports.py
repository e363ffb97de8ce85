"""Patching reports (``tl.report.activation_patching``, ``attribution_patching``) against the same patch made
by a hand-written forward hook: their estimates are the model's own forward's, every module call and position
has its row, and a model's own error is let through."""

from __future__ import annotations

import html
import inspect
import math
import os
import re
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from untouched import assert_clean_process  # noqa: E402
import real_models  # noqa: E402 - imports transformers lazily, per entry
from zoo import ActivationMadePerCall  # noqa: E402


def _corpus_pair(name):
    """``(model, clean args, corrupt args, kwargs, metric)`` for a corpus entry in eval mode: a token changed
    for a language model, noise added to a float input otherwise."""
    model, args, kwargs = real_models.build(name)
    model.eval()
    if "input_ids" in kwargs:
        kwargs = dict(kwargs)
        ids = kwargs.pop("input_ids")
        corrupt = ids.clone()
        corrupt[..., 1] = (corrupt[..., 1] + 5) % 60
        return model, (ids,), (corrupt,), kwargs, lambda out: out.logits.flatten()[-1] - out.logits.flatten()[-2]
    (x,) = args
    noise = 0.5 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    return model, (x,), (x + noise,), kwargs, lambda out: out[0, 0, 0] - out[1, 0, 1]


def _hooked_estimate(model, module, clean, corrupt, kwargs, metric):
    """``((clean - corrupt) * d metric / d output).sum()`` at ``module``'s output, and the two metrics, from
    untraced forwards with gradients on and a forward hook keeping the module's output."""
    outputs = []
    handle = module.register_forward_hook(lambda m, inputs, output: outputs.append(output))
    try:
        with torch.enable_grad():
            clean_value = metric(model(*clean, **kwargs))
            corrupt_value = metric(model(*corrupt, **kwargs))
            (grad,) = torch.autograd.grad(corrupt_value, outputs[1])
    finally:
        handle.remove()
    return float(((outputs[0] - outputs[1]) * grad).sum()), float(clean_value), float(corrupt_value)


@pytest.mark.parametrize("name,site", [
    ("longformer", "longformer.encoder.layer.0.output.dense"),  # writes a mask that needs no grad in place
    ("mixtral", "model.layers.0.self_attn.o_proj"),  # an integer cumsum, which autograd does not support
    ("rwkv", "rwkv.blocks.0.feed_forward.value"),  # rescales its weights on its first forward in eval mode
    ("transformer_encoder_padded", "layers.0.linear2"),  # a padding mask filled in place
    ("transformer_encoder", "layers.0.linear2"),  # torch's fused kernel runs only with gradients off
])
def test_attribution_patching_on_models_it_must_not_change(name, site):
    """The estimate is the model's own forward's: its baselines and its estimate at a module call equal
    those of untraced forwards with a hook, and no value is made to require a gradient it would not have
    (which made these models raise: an in-place write into a leaf, an integer op on a tensor requiring grad,
    another path than the clean run's)."""
    pytest.importorskip("pandas")
    if name in real_models.TRANSFORMERS:
        pytest.importorskip("transformers")
    model, clean, corrupt, kwargs, metric = _corpus_pair(name)
    with torch.no_grad():
        model(*clean, **kwargs)  # a first forward: RWKV rescales its weights once, here
    expected, clean_value, corrupt_value = _hooked_estimate(model, model.get_submodule(site), clean, corrupt,
                                                            kwargs, metric)
    table = tl.report.attribution_patching(model, clean, corrupt, metric, kwargs=kwargs)
    assert table.attrs["clean"] == pytest.approx(clean_value, rel=1e-5, abs=1e-7)
    assert table.attrs["corrupt"] == pytest.approx(corrupt_value, rel=1e-5, abs=1e-7)
    calls = table[table.kind == "module call"].set_index("site")
    assert calls.estimate[f"{site}:1"] == pytest.approx(expected, rel=1e-4, abs=1e-7)
    unreached = table[(table.kind == "op") & table.estimate.isna()]
    assert unreached.note.str.len().gt(0).all()  # every op without an estimate says why


class _MaskFilledInPlace(nn.Module):
    """Builds a bias that needs no grad and fills it in place, as attention masks are built."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        scaled = x * 2
        bias = torch.zeros(x.shape[0], 4)
        bias.masked_fill_(x < 0, -1.0)
        return self.lin(scaled) + bias


def test_attribution_patching_attributes_inputs_only_when_they_require_grad():
    """A value computed with no gradient is not made to require one: NaN and a note, unless the inputs
    given require grad, and then the estimate is that of a hand-taken gradient."""
    pytest.importorskip("pandas")
    torch.manual_seed(0)
    model, clean, corrupt = _MaskFilledInPlace().eval(), torch.randn(2, 4), torch.randn(2, 4)
    metric = lambda out: out.sum()  # noqa: E731
    table = tl.report.attribution_patching(model, clean, corrupt, metric).set_index("site")
    assert math.isnan(table.estimate["mul_1_1:1"]) and "computed with no gradient" in table.note["mul_1_1:1"]
    assert "written in place" in table.note["maskedfill_1_4:1"]
    assert table.attrs["clean"] == pytest.approx(float(metric(model(clean))))
    wanting = tl.report.attribution_patching(model, clean.requires_grad_(), corrupt.requires_grad_(), metric)
    scaled = 2 * corrupt.detach().requires_grad_()
    (grad,) = torch.autograd.grad(metric(model.lin(scaled)), scaled)
    expected = float(((2 * clean - 2 * corrupt) * grad).sum())
    assert wanting.set_index("site").estimate["mul_1_1:1"] == pytest.approx(expected, rel=1e-5)


def _patched_by_hook(model, module, clean, corrupt, metric, at=None):
    """``metric`` of ``model(corrupt)`` with each call of ``module`` returning the value of the same call on
    ``clean`` (only ``[at]`` when given), from untraced forwards and forward hooks."""
    clean_outputs, calls = [], []
    handle = module.register_forward_hook(lambda m, inputs, output: clean_outputs.append(output.detach()))
    try:
        model(clean)
    finally:
        handle.remove()

    def patch(m, inputs, output):
        source = clean_outputs[len(calls)]
        calls.append(1)
        if at is None:
            return source.clone()
        patched = output.clone()
        patched[at] = source[at]
        return patched

    handle = module.register_forward_hook(patch)
    try:
        return float(metric(model(corrupt)))
    finally:
        handle.remove()


def test_activation_patching_t5s_loss_made_in_the_forward():
    """T5 makes its CrossEntropyLoss inside forward: that row says so, the others are patched."""
    pytest.importorskip("pandas")
    pytest.importorskip("transformers")
    model, _, kwargs = real_models.build("t5")
    model.eval()
    kwargs = dict(kwargs)
    clean = kwargs.pop("input_ids")
    corrupt = clean.clone()
    corrupt[..., 1] = (corrupt[..., 1] + 5) % 60
    metric = lambda out: out.logits[0, -1, 3] - out.logits[0, -1, 4]  # noqa: E731
    site, loss = "encoder.block.1.layer.1.DenseReluDense.wo", "<unregistered CrossEntropyLoss #1>:1"
    table = tl.report.activation_patching(model, clean, corrupt, metric, sites=[f"{site}:1", loss], kwargs=kwargs,
                                          progress=False)
    rows = table.set_index("site")
    assert math.isnan(rows.metric[loss]) and "made itself" in rows.error[loss] and "crossentropy" in rows.error[loss]
    model_call = lambda ids: model(ids, **kwargs)  # noqa: E731
    with torch.no_grad():
        expected = _patched_by_hook(model_call, model.get_submodule(site), clean, corrupt, metric)
    assert rows.metric[f"{site}:1"] == pytest.approx(expected, rel=1e-5)


class _Loop(nn.Module):
    """One cell called three times."""

    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.zeros_like(x)
        for _ in range(3):
            h = torch.tanh(self.cell(x) + h)
        return h


def test_activation_patching_by_position_at_a_module_called_several_times():
    """``positions=`` at a module address that ran three times patches that position in every call (it
    raised 'has shape None': a module called several times is no single op)."""
    pytest.importorskip("pandas")
    torch.manual_seed(0)
    model, clean, corrupt = _Loop().eval(), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    metric = lambda out: out[0, -1, 0]  # noqa: E731
    table = tl.report.activation_patching(model, clean, corrupt, metric, sites=["cell"], positions=1, progress=False)
    assert list(table.position) == list(range(5)) and not table.error.any()
    with torch.no_grad():
        expected = [_patched_by_hook(model, model.cell, clean, corrupt, metric, at=(slice(None), p)) for p in range(5)]
    assert table.metric.tolist() == pytest.approx(expected)


class _CheckedTwice(nn.Module):
    """Runs one layer twice and refuses to go on when the two results disagree, as a model checking its own
    hidden states does: a patch of the first call alone makes it raise."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        first, second = self.fc(x), self.fc(x)
        if not torch.equal(first, second):
            raise ValueError("the two calls of fc disagree")
        return first.tanh()


def test_activation_patching_lets_the_models_own_error_through():
    """A ValueError the model raises in a patched run reaches the caller: it used to become a NaN row whose
    error read as if the site could not be patched."""
    pytest.importorskip("pandas")
    torch.manual_seed(0)
    model, clean, corrupt = _CheckedTwice().eval(), torch.randn(2, 8), torch.randn(2, 8)
    clean_first = F.linear(clean, model.fc.weight, model.fc.bias).detach()
    calls = []

    def first_call_from_clean(module, inputs, output):
        calls.append(1)
        return clean_first if len(calls) == 1 else None

    handle = model.fc.register_forward_hook(first_call_from_clean)
    try:  # untraced, the same patch by a forward hook: the model's own refusal
        with pytest.raises(ValueError, match="the two calls of fc disagree"):
            model(corrupt)
    finally:
        handle.remove()
    metric = lambda out: out[0, 0]  # noqa: E731
    with pytest.raises(ValueError, match="the two calls of fc disagree") as info:
        tl.report.activation_patching(model, clean, corrupt, metric, sites=["fc:1"], progress=False)
    assert not isinstance(info.value, tl.TorchlensError)


class _Shrinking(nn.Module):
    """One layer called on 4, then 3 positions."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x).sum() + self.fc(x[:, :3]).sum()


def test_activation_patching_by_position_past_a_shorter_pass_says_so_in_its_row():
    """Positions are counted up to a layer's longest pass; one a later, shorter pass lacks is that row's error."""
    pytest.importorskip("pandas")
    torch.manual_seed(0)
    model, clean, corrupt = _Shrinking().eval(), torch.randn(1, 4, 3), torch.randn(1, 4, 3)
    metric = lambda out: out  # noqa: E731
    table = tl.report.activation_patching(model, clean, corrupt, metric, sites=["fc"], positions=1, progress=False)
    assert list(table.position) == [0, 1, 2, 3] and not table.error[:3].any()
    with torch.no_grad():
        expected = [_patched_by_hook(model, model.fc, clean, corrupt, metric, at=(slice(None), p)) for p in range(3)]
    assert table.metric[:3].tolist() == pytest.approx(expected)
    assert math.isnan(table.metric[3]) and "outside this value of shape (1, 3, 3)" in table.error[3]


def _patched_at_by_hooks(model, modules, clean, corrupt, metric, at, kwargs):
    """``metric`` of the corrupted run with ``[at]`` of each module's output taken from the clean run, untraced."""
    clean_outputs = {}
    handles = [m.register_forward_hook(lambda m, i, out: clean_outputs.__setitem__(m, out.detach())) for m in modules]
    try:
        model(clean, **kwargs)
    finally:
        for handle in handles:
            handle.remove()

    def patch(m, inputs, output):
        patched = output.clone()
        patched[at] = clean_outputs[m][at]
        return patched

    handles = [m.register_forward_hook(patch) for m in modules]
    try:
        return float(metric(model(corrupt, **kwargs)))
    finally:
        for handle in handles:
            handle.remove()


def test_activation_patching_by_position_counts_the_longest_pass_not_the_first():
    """A predicate accepting T5's two embeddings, of a 2-token input and a 4-token decoder input: the rows stopped
    at position 1, the first value's last, so positions 2 and 3 of the decoder had no row, which read as no
    effect there. Every position of the longest value has a row; one the shorter value lacks is that row's error."""
    pytest.importorskip("transformers")
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                      decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config).eval()
    clean, corrupt = torch.tensor([[5, 6]]), torch.tensor([[5, 9]])
    kwargs = {"decoder_input_ids": torch.tensor([[0, 7, 8, 9]])}
    metric = lambda out: out.logits[0, -1, 3] - out.logits[0, -1, 4]  # noqa: E731
    embeddings = lambda op: op.type == "embedding"  # noqa: E731
    table = tl.report.activation_patching(model, clean, corrupt, metric, sites=[embeddings], positions=1,
                                          kwargs=kwargs, progress=False)
    assert list(table.position) == [0, 1, 2, 3]
    modules = [model.encoder.embed_tokens, model.decoder.embed_tokens]
    with torch.no_grad():
        expected = [_patched_at_by_hooks(model, modules, clean, corrupt, metric, (slice(None), p), kwargs)
                    for p in range(2)]
    assert table.metric[:2].tolist() == pytest.approx(expected) and not table.error[:2].any()
    assert table.metric[2:].isna().all()
    assert all("outside this value of shape (1, 2, 16)" in error for error in table.error[2:])


def test_activation_patching_by_position_refuses_a_site_whose_values_differ_in_rank():
    """A predicate accepting BERT's linear layers takes its (batch, seq, d) projections and its (batch, d) pooler:
    row p patched sequence position p of the ones and channel p of the pooler, so position 0 read as carrying the
    whole effect on a metric of pooler channel 0. The site has one row saying so, naming the pooler's op."""
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    model = BertModel(config).eval()
    clean, corrupt = torch.tensor([[2, 5, 6, 7]]), torch.tensor([[2, 5, 9, 7]])
    pooler = tl.trace(model, clean)["pooler.dense:1"].label
    linears = lambda op: op.type == "linear"  # noqa: E731
    table = tl.report.activation_patching(model, clean, corrupt, lambda out: out.pooler_output[0, 0],
                                          sites=[linears], positions=1, progress=False)
    assert len(table) == 1 and table.position.isna().all() and table.metric.isna().all()
    assert "differ in rank" in table.error[0] and f"of another rank here: {pooler})" in table.error[0]


def test_attribution_patching_gives_a_reason_shared_by_a_calls_outputs_once():
    """Llama's rotary embedding returns cos and sin, both computed with no gradient: its row says why once."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, _, kwargs = real_models.CORPUS["llama"]()
    model.eval()
    clean = kwargs["input_ids"][:1]
    corrupt = (clean + 5) % model.config.vocab_size
    table = tl.report.attribution_patching(model, clean, corrupt, lambda out: out.logits[0, -1, 3])
    rows = table.set_index("site")
    call = next(mc for mc in tl.trace(model, clean, save="none").module_calls if mc.label == "model.rotary_emb:1")
    assert len(call.output_ops) == 2
    reasons = [rows.note[label] for label in call.output_ops]
    assert reasons[0] and reasons[0] == reasons[1]
    assert rows.note["model.rotary_emb:1"] == reasons[0]


def test_activation_patching_over_modules_reports_a_module_made_in_the_forward_in_its_row():
    """A module made inside the forward is no module of the model: its row says so and which op to patch,
    and the table goes on (it used to abort with a KeyError)."""
    pytest.importorskip("pandas")
    torch.manual_seed(0)
    model, clean, corrupt = ActivationMadePerCall().eval(), torch.randn(2, 4), torch.randn(2, 4)
    metric = lambda out: out[0, 0]  # noqa: E731
    table = tl.report.activation_patching(model, clean, corrupt, metric, sites="modules", progress=False)
    assert list(table.site) == ["fc:1", "<unregistered GELU #1>:1"]
    rows = table.set_index("site")
    assert rows.metric["fc:1"] == pytest.approx(_patched_by_hook(model, model.fc, clean, corrupt, metric))
    assert rows.error["fc:1"] == ""
    made = "<unregistered GELU #1>:1"
    assert math.isnan(rows.metric[made]) and "made itself" in rows.error[made] and "gelu_1_2:1" in rows.error[made]


@pytest.mark.parametrize("report", ["activation_patching", "attribution_patching"])
def test_a_model_without_values_is_refused_saying_so(report):
    # On the meta device the metric is a meta scalar: float() of it raised torch's "Tensor.item() cannot be
    # called on meta tensors", which names neither the metric nor the way out.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("meta")
    clean, corrupt = torch.randn(2, 4, device="meta"), torch.randn(2, 4, device="meta")
    options = {"progress": False} if report == "activation_patching" else {}
    with pytest.raises(tl.TorchlensError, match="metric returned a meta tensor.*real device"):
        getattr(tl.report, report)(model, clean, corrupt, lambda out: out.sum(), **options)


def test_activation_patching_refuses_a_dimension_counted_from_the_end():
    """``positions=-1`` counted its rows along the last dimension (GPT-2's hidden size) but patched along dimension
    0, the batch: the first rows were batch rows presented as positions of the last dimension."""
    pytest.importorskip("pandas")
    pytest.importorskip("transformers")
    gpt2 = real_models.small_gpt2_lm()
    clean, corrupt = torch.randint(0, 64, (2, 6)), torch.randint(0, 64, (2, 6))
    metric = lambda out: out.logits[:, -1, 0].sum()  # noqa: E731
    with pytest.raises(ValueError, match=r"positions=-1 is negative; give the index of the dimension to patch along, "
                                         r"counted from the front"):
        tl.report.activation_patching(gpt2, clean, corrupt, metric, sites=["transformer.h.0"], positions=-1,
                                      progress=False)
    with pytest.raises(TypeError, match=r"positions=1\.0 is a float, not an int; give the index of the dimension"):
        tl.report.activation_patching(gpt2, clean, corrupt, metric, sites=["transformer.h.0"], positions=1.0,
                                      progress=False)
    table = tl.report.activation_patching(gpt2, clean, corrupt, metric, sites=["transformer.h.0"], positions=1,
                                          progress=False)
    assert list(table.position) == list(range(6)) and not table.error.any()


@pytest.mark.parametrize("report", ["activation_patching", "attribution_patching"])
def test_a_metric_that_cannot_be_called_is_refused_before_the_clean_run(report):
    # metric=3 (or a metric's value passed for the metric) failed after the clean run: "'int' object is not callable".
    pytest.importorskip("pandas")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.raises(TypeError, match=rf"{report}: metric= is a function of the model's output returning a scalar "
                                        r".* got int"):
        getattr(tl.report, report)(model, torch.randn(2, 4), torch.randn(2, 4), 3)
    # A metric of two arguments failed after the clean run with Python's "missing 1 required positional argument".
    with pytest.raises(TypeError, match=rf"{report}: metric is called as metric\(output\), with the model's output, "
                                        r"but .*\(out, target\) cannot take that argument"):
        getattr(tl.report, report)(model, torch.randn(2, 4), torch.randn(2, 4), lambda out, target: out.sum())
    assert not forwards


@pytest.mark.parametrize("report", ["activation_patching", "attribution_patching"])
def test_a_metric_that_returns_no_number_is_refused_naming_what_it_returned(report):
    # A metric that forgot its return raised float()'s own "float() argument must be a string or a real number",
    # and one returning the text "0.5" was read as the number 0.5.
    pytest.importorskip("pandas")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    clean, corrupt = torch.randn(2, 4), torch.randn(2, 4)
    for returned, shown in ((None, "NoneType None"), ("0.5", "str '0.5'")):
        with pytest.raises(TypeError, match=rf"the metric must return one number \(a float or a one-element tensor\), "
                                            rf"got {shown}; return the value itself"):
            getattr(tl.report, report)(model, clean, corrupt, lambda out, returned=returned: returned)
    table = getattr(tl.report, report)(model, clean, corrupt, lambda out: out[0, 1] - out[0, 0])
    assert table.attrs["clean"] == pytest.approx(float((lambda o: o[0, 1] - o[0, 0])(model(clean))))


def test_attribution_patching_refuses_a_metric_cut_from_the_graph_naming_why():
    # A metric returning float(...) raised autograd's "'float' object is not iterable", and a .detach()ed one
    # "element 0 of tensors does not require grad": attribution takes the metric's gradient, which neither has.
    pytest.importorskip("pandas")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    clean, corrupt = torch.randn(2, 4), torch.randn(2, 4)
    with pytest.raises(TypeError, match=r"the metric returned a float, but attribution takes its gradient: return "
                                        r"the one-element tensor itself, without float\(\) or \.item\(\)"):
        tl.report.attribution_patching(model, clean, corrupt, lambda out: out[0, 0].item())
    with pytest.raises(ValueError, match=r"the metric's tensor has no gradient .*compute it from the output"):
        tl.report.attribution_patching(model, clean, corrupt, lambda out: out[0, 0].detach())
    assert_clean_process()
    # activation_patching reads the metric's value alone: a float is all it needs.
    table = tl.report.activation_patching(model, clean, corrupt, lambda out: out[0, 0].item(), progress=False)
    assert table.attrs["clean"] == pytest.approx(model(clean)[0, 0].item())


class _LastStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.fc = nn.LSTM(4, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, x):
        out, (h, _) = self.lstm(x)
        return self.fc(out[:, -1] + h[0])


def test_activation_patching_by_position_refuses_a_call_returning_values_of_other_shapes():
    # Index p along dimension 1 patched the LSTM output's step p and, silently, batch row p of h and c: the rows
    # of positions 0-2 were numbers for no patch of a position, and those of positions 3-4 an index error.
    pandas = pytest.importorskip("pandas")
    torch.manual_seed(0)
    model, clean, corrupt = _LastStep().eval(), torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    metric = lambda out: out[0, 0] - out[1, 1]  # noqa: E731
    table = tl.report.activation_patching(model, clean, corrupt, metric, sites=["lstm", "lstm:1", "fc"],
                                          positions=1, progress=False)
    for site in ("lstm", "lstm:1"):
        (row,) = table[table.site == site].itertuples()
        assert math.isnan(row.metric) and pandas.isna(row.position)
        assert "lstm:1 returns values of shapes (3, 5, 4), (1, 3, 4)" in row.error
        assert "at the op of the output you mean (lstm_1_3:1, lstm_2_4:1, lstm_3_5:1)" in row.error
    output_op = tl.report.activation_patching(model, clean, corrupt, metric, sites=["lstm_1_3:1"], positions=1,
                                              progress=False)
    assert list(output_op.position) == list(range(5)) and not output_op.error.any()
    assert list(table[table.site == "fc"].position) == [0, 1]


def test_attribution_patching_inside_inference_mode_is_refused_naming_it():
    # Every row came back NaN, noted "computed with no gradient ... pass inputs that require grad": the inputs were
    # not the cause, and torch.no_grad() (which the report lifts for its runs) gives the real estimates.
    pytest.importorskip("pandas")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    clean, corrupt, metric = torch.randn(2, 4), torch.randn(2, 4), lambda out: out[:, 0].sum()
    expected = tl.report.attribution_patching(model, clean, corrupt, metric)
    with torch.no_grad():
        assert expected.estimate.equals(tl.report.attribution_patching(model, clean, corrupt, metric).estimate)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="attribution_patching needs gradients .* inference"):
        tl.report.attribution_patching(model, clean, corrupt, metric)


@pytest.mark.parametrize("sites, error, message", [
    # sites=3 failed on "'int' object is not iterable" and sites="module" was refused, both after the clean run.
    (3, TypeError, r"sites= is 'modules', 'layers', 'ops' or a list of sites .* got int 3"),
    ("module", ValueError, r"sites='module': use 'modules', 'layers', 'ops' or a list of sites"),
])
def test_sites_that_name_nothing_are_refused_before_the_clean_run(sites, error, message):
    pytest.importorskip("pandas")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.raises(error, match=message):
        tl.report.activation_patching(model, torch.randn(2, 4), torch.randn(2, 4), lambda out: out.sum(), sites=sites,
                                      progress=False)
    assert not forwards


def test_activation_patching_refuses_a_progress_that_is_no_flag():
    # progress="no" was true, and showed a bar.
    pytest.importorskip("pandas")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(TypeError, match=r"activation_patching: progress='no' is a str, not True or False"):
        tl.report.activation_patching(model, torch.randn(2, 4), torch.randn(2, 4), lambda out: out.sum(), progress="no")


def test_heatmap_refuses_what_is_not_a_patching_table_or_a_column_of_numbers(tmp_path):
    # heatmap(df, value="error") failed on a float conversion of its first cell, heatmap(log) with a KeyError
    # for a label 'site', heatmap(df, title=3) on 'int' has no attribute 'replace'.
    pytest.importorskip("pandas")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    table = tl.report.activation_patching(model, x, x + 1, lambda out: out.sum(), progress=False)
    with pytest.raises(ValueError, match=r"heatmap: value='error' is not a column of numbers in this table; give one "
                                         r"of 'metric', 'normalized'"):
        tl.viz.heatmap(table, value="error")
    with pytest.raises(TypeError, match=r"heatmap takes the table tl\.report\.activation_patching .* got Trace"):
        tl.viz.heatmap(tl.trace(model, x))
    with pytest.raises(TypeError, match=r"heatmap: title= takes a string, got int 3"):
        tl.viz.heatmap(table, title=3)
    # A .png path was written with SVG text, and a missing folder raised pathlib's bare FileNotFoundError.
    with pytest.raises(ValueError, match=r"heatmap: path=.*map\.png' does not end in \.svg, but a heatmap is written "
                                         r"as SVG text"):
        tl.viz.heatmap(table, tmp_path / "map.png")
    with pytest.raises(ValueError, match=r"heatmap: path=.* is in .*missing, which does not exist; name an \.svg"):
        tl.viz.heatmap(table, tmp_path / "missing" / "map.svg")
    assert list(tmp_path.iterdir()) == []
    assert tl.viz.heatmap(table, tmp_path / "map.svg").read_text().startswith("<svg")
    attribution = tl.report.attribution_patching(model, x, x + 1, lambda out: out.sum())
    assert tl.viz.heatmap(table).startswith("<svg") and tl.viz.heatmap(attribution, value="estimate").startswith("<svg")



def test_heatmap_names_its_options_and_takes_them_as_its_drawing_does():
    # tl.viz.heatmap was (frame, path=None, **kwargs): help() named neither value= nor title=, and
    # heatmap(table, None, "metric") was refused as a positional argument too many.
    pytest.importorskip("pandas")
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    table = tl.report.activation_patching(model, x, x + 1, lambda out: out.sum(), progress=False)
    assert list(inspect.signature(tl.viz.heatmap).parameters) == ["frame", "path", "value", "title"]
    assert tl.viz.heatmap(table, None, "metric", "patched") == tl.viz.heatmap(table, value="metric", title="patched")

@pytest.mark.parametrize("report", ["activation_patching", "attribution_patching"])
def test_a_metric_the_corruption_does_not_change_is_warned_of(report):
    # normalized divides by clean - corrupt: every row was NaN with no word of why.
    pytest.importorskip("pandas")
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(2, 4)
    with pytest.warns(UserWarning, match=rf"^{report}: the metric is .* on both the clean and the corrupted input"):
        table = getattr(tl.report, report)(model, x, x.clone(), lambda out: out[:, 0].sum())
    assert table.normalized.isna().all()


class _Product(nn.Module):
    """The product of two non-negative values, each through a site of its own: 0 where either is."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.ReLU(), nn.ReLU()

    def forward(self, x):
        return self.a(x[:, 0]) * self.b(x[:, 1])


def test_an_infinite_value_in_a_heatmap_is_drawn_saturated_on_its_own_side():
    # The colour scale was the largest magnitude in the table, Inf itself: every finite cell was drawn white (x / inf
    # is 0), and -inf / inf is NaN, which was drawn red, the colour of positive values.
    pytest.importorskip("pandas")
    clean, corrupt = torch.tensor([[2.0, 3.0]]), torch.tensor([[0.0, 3.0]])
    table = tl.report.activation_patching(_Product(), clean, corrupt, lambda out: out.log().sum(), progress=False)
    metrics = table.set_index("site").metric
    assert metrics["a:1"] == pytest.approx(math.log(6)) and metrics["b:1"] == -math.inf
    svg = tl.viz.heatmap(table, value="metric")
    fills = dict(re.findall(r'fill="(#[0-9a-f]{6})" stroke="white"><title>(\S+):', svg))
    assert {site: fill for fill, site in fills.items()} == {"a:1": "#ff0000", "b:1": "#0000ff"}
    assert f"|max| = {math.log(6):.3g}" in svg


def test_a_nan_cell_of_a_heatmap_says_why_the_table_has_no_number_there():
    # Every NaN cell said "not patched", also where the site was patched and the metric of the patched run was NaN.
    pytest.importorskip("pandas")
    model, clean, corrupt = _Product(), torch.tensor([[2.0, 3.0]]), torch.tensor([[0.0, 3.0]])
    table = tl.report.activation_patching(model, clean, corrupt, lambda out: (out - 5).sqrt().sum(), progress=False)
    assert math.isnan(table.set_index("site").metric["b:1"]) and not table.set_index("site").error["b:1"]
    tips = dict(re.findall(r"<title>(\S+): ([^<]*)</title>", tl.viz.heatmap(table, value="metric")))
    assert tips == {"a:1": "1", "b:1": "nan"}
    estimate = tl.report.attribution_patching(model, clean, corrupt, lambda out: out.sum())  # nothing requires grad
    tips = dict(re.findall(r"<title>(\S+): ([^<]*)</title>", tl.viz.heatmap(estimate, value="estimate")))
    assert html.unescape(tips["a:1"]) == estimate.set_index("site").note["a:1"] and "no gradient" in tips["a:1"]
