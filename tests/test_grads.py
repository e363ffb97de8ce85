"""Gradient capture (``tl.trace(..., grads=...)``): faithful to autograd, addressed like activations.

The reference for every gradient is an untraced run of the same model under a minimal recording mode
(``Oracle`` below, not torchlens) that calls ``retain_grad()`` (or, for tensors later modified in place,
``register_hook``, whose semantics PyTorch defines per version) on every tensor each torch call returns.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.record.errors import GradientUnavailable
from grad_oracle import Oracle, _assert_bit_identical, _case, _op_grads, _reference, _traced
from zoo import LoopRNN, zoo


RETAIN_GRAD_CASES = ["mlp", "recurrent", "shared_module", "loop_rnn", "branchy", "functional", "dict_io",
                     "multi_output", "batchnorm_train", "dropout_train"]


@pytest.mark.parametrize("name", RETAIN_GRAD_CASES)
def test_grads_bit_identical_to_retain_grad(name):
    oracle, ref_params = _reference(name)
    log, params = _traced(name)
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, oracle.grads())
    assert params.keys() == ref_params.keys()
    assert all(torch.equal(params[n], ref_params[n]) for n in params)
    assert log.num_backwards == 1


class InplaceViews(nn.Module):
    """In-place writes, a write through a view, item assignment and views, all differentiable."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        y.mul_(2)
        z = y[:, :4]
        z.add_(1)  # writes y through its view
        c = y.clone()
        c[:, 0] = 5.0
        return c.view(-1).sum() + y.t().contiguous().pow(2).sum(0).mean()


def _inplace_case():
    torch.manual_seed(0)
    return InplaceViews(), (torch.randn(3, 8),), {}


@pytest.mark.parametrize("name", ["inplace_views", "small_cnn", "batchnorm_eval"])
def test_grads_through_inplace_ops_and_views_follow_pytorch_hook_semantics(name):
    # Each op's gradient is that of the value it produced, even when a later op overwrote it in place.
    # (The zoo's inplace_views writes a tensor relu saved for backward: it has no backward at all.)
    case = (lambda _: _inplace_case()) if name == "inplace_views" else _case
    oracle, ref_params = _reference(name, how="hook", case=case)
    log, params = _traced(name, case=case)
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, oracle.grads())
    assert all(torch.equal(params[n], ref_params[n]) for n in params)


class InplaceRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        y.relu_()
        return y * torch.arange(4.0)


def test_tensor_later_modified_in_place_keeps_the_gradient_of_each_version():
    model, x = InplaceRelu(), torch.randn(3, 4)
    y = model.fc(x)
    y.retain_grad()  # retain_grad follows the tensor to its latest version: relu_'s output
    y.relu_()
    (y * torch.arange(4.0)).sum().backward()
    model.zero_grad()
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    relu, linear = log["relu_1_2:1"], log["linear_1_1:1"]
    assert relu.is_inplace
    assert torch.equal(relu.grad, y.grad)
    # fc's output, as fc produced it (before relu_ overwrote it): d loss / d (pre-activation)
    assert torch.equal(linear.grad, y.grad * (y > 0))
    assert not torch.equal(linear.grad, relu.grad)


def test_every_pass_of_a_reused_module_has_its_own_gradient():
    model = LoopRNN(steps=5).eval()
    x = torch.randn(2, 8)
    hs = []
    h = torch.zeros_like(x)
    for _ in range(5):
        pre = model.cell(x)
        pre.retain_grad()
        hs.append(pre)
        h = torch.tanh(pre + h) * 0.5
    h.pow(2).sum().backward()
    expected = [t.grad for t in hs]
    model.zero_grad()
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.pow(2).sum())
    (layer,) = [layer for layer in log.layers if layer.first.func_name == "linear"]
    assert layer.num_passes == 5
    assert all(torch.equal(g, e) for g, e in zip(layer.grads, expected))
    calls = [mc for mc in log.module_calls if mc.address == "cell"]
    assert all(torch.equal(mc.grad, e) for mc, e in zip(calls, expected))
    with pytest.raises(AttributeError, match="passes"):
        layer.grad


def test_lstm_output_h_and_c_each_get_their_gradient():
    lstm = nn.LSTM(4, 6, batch_first=True)
    x = torch.randn(2, 3, 4)
    oracle = Oracle()
    with oracle:
        out, (h, c) = lstm(x)
    (out.sum() + 2 * h.sum() + 3 * c.sum()).backward()
    expected = oracle.grads()
    lstm.zero_grad()
    log = tl.trace(lstm, x, grads=True)
    out, (h, c) = log.output
    log.backward(out.sum() + 2 * h.sum() + 3 * c.sum())
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, expected)
    lstm_ops = [op for op in ops if op.multi_output_index is not None and op.func_name == "lstm"]
    assert len(lstm_ops) >= 3 and all(op.grad is not None for op in lstm_ops)
    assert torch.equal(log.outputs[2].grad, torch.full_like(c, 3.0))


def test_inputs_requiring_grad_get_their_gradient():
    model, (x,), _ = zoo()["mlp"]
    x = x.clone().requires_grad_()
    ref = x.detach().clone().requires_grad_()
    model(ref).sum().backward()
    model.zero_grad()
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    assert torch.equal(log["input_1"].grad, ref.grad)
    assert torch.equal(x.grad, ref.grad)


class NoGradRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        with torch.no_grad():
            z = self.frozen(x)
        return self.head(z.relu())


def test_no_grad_region_has_no_gradient_and_says_so():
    log = tl.trace(NoGradRegion(), torch.randn(3, 4), grads=True)
    log.backward(log.output.sum())
    assert log["head"].grad is not None
    with pytest.raises(GradientUnavailable, match="does not require grad"):
        log["frozen"].grad
    with pytest.raises(GradientUnavailable, match="does not require grad"):
        log["input_1"].grad
    assert log.params[0].grad is None and log.params[2].grad is not None  # frozen.weight, head.weight


def test_the_reason_an_op_has_no_gradient_is_its_own_not_a_list_of_maybes():
    """A token input and the integer ops on it have no gradient because of their dtype, and a float input because
    it was given without requires_grad: the message listed every possible cause (no_grad, vmap, ...) for each."""
    embed, head = nn.Embedding(10, 4), nn.Linear(4, 2)
    model = nn.Sequential(embed, head)
    ids = torch.tensor([[1, 2, 3]])
    log = tl.trace(model, ids, grads=True)
    log.backward(log.output.sum())
    with pytest.raises(GradientUnavailable, match=r"^input_1:1: its output is int64, a dtype autograd computes no"):
        log["input_1"].grad
    assert log["0"].grad is not None
    floats = tl.trace(head, torch.randn(2, 4), grads=True)
    floats.backward(floats.output.sum())
    with pytest.raises(GradientUnavailable, match=r"an input that does not require grad.*requires_grad=True"):
        floats["input_1"].grad


def test_without_grads_the_trace_says_how_to_get_them():
    log = tl.trace(nn.Linear(3, 3), torch.randn(2, 3))
    with pytest.raises(GradientUnavailable, match="grads=True"):
        log["linear_1_1:1"].grad
    with pytest.raises(GradientUnavailable, match="grads=True"):
        log.backward(log.output.sum())


def test_several_backwards_accumulate_and_are_counted():
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, grads=True)
    out = log.output
    log.backward(out.sum(), retain_graph=True)
    first = log["linear_1_1:1"].grad.clone()
    (out * 2).sum().backward()
    assert log.num_backwards == 2
    assert torch.equal(log["linear_1_1:1"].grad, first + 2 * first)
    assert torch.equal(log.outputs[0].grad, torch.full_like(out, 3.0))


def test_save_none_and_selected_grads():
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, save="none", grads=True)
    log.backward(log.output.sum())
    assert not log._activations and log["linear_2_3:1"].grad is not None
    log = tl.trace(model, args, grads=["relu", "head"])
    log.backward(log.output.sum())
    have = {op.label for op in log if op.kind == "op" and op.grad is not None}
    relus = {op.label for op in log if op.type == "relu"}
    assert len(relus) == 3 and have == relus | {log["head"].label}
    log = tl.trace(model, args, grads=["linear_2_3:1"])
    log.backward(log.output.sum())
    assert [op.label for op in log if op.kind == "op" and op.grad is not None] == ["linear_2_3:1"]


class _ThroughIdentity(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ident, self.head = nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.ident(self.fc(x))).tanh()


@pytest.mark.parametrize("selector", ["ident", "ident:1"])
def test_selecting_a_module_whose_output_an_op_outside_it_made_keeps_that_gradient(selector):
    # nn.Identity makes no op: its output's gradient is that of fc's op, which grads=["ident"] must keep.
    model, x = _ThroughIdentity(), torch.randn(3, 4)
    full = tl.trace(model, x, grads=True)
    full.backward(full.output.sum())
    log = tl.trace(model, x, grads=[selector])
    log.backward(log.output.sum())
    call = next(c for c in log.module_calls if c.address == "ident")
    assert {op.label for op in log if op.kind == "op" and op.has_grad} == set(call.output_ops) == {"linear_1_1:1"}
    assert torch.equal(call.grad, full["linear_1_1:1"].grad)


@pytest.mark.parametrize("selector", ["output_1", "output_1:1", "output"])
def test_selecting_the_output_keeps_its_gradient(selector):
    # An output node shows its producer's gradient: selecting the output must keep that one.
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, grads=[selector])
    log.backward(log.output.pow(2).sum())
    assert torch.equal(log["output_1:1"].grad, 2 * log.output.detach())  # d sum(y^2) / dy
    assert {op.label for op in log if op.kind == "op" and op.has_grad} == {log["output_1:1"].parents[0]}


def test_unknown_grads_selector_raises_with_closest_labels():
    model, args, _ = zoo()["mlp"]
    with pytest.raises(KeyError, match="linear_2_3 ran 1 pass in this forward: linear_2_3:1"):
        tl.trace(model, args, grads=["linear_2_3:9"])
    with pytest.raises(KeyError, match="relu"):
        tl.trace(model, args, grads=["reluu"])


def test_a_grads_selector_is_checked_like_a_save_selector():
    # grads= and save= read one selection: a module call that never happened selects nothing, and
    # says so, rather than leaving the user with no gradient and no reason.
    model, args, _ = zoo()["mlp"]
    called = [mc.label for mc in tl.trace(model, args).module_calls]
    with pytest.raises(KeyError, match=r"grads= matched nothing.*: layers\.0:1"):
        tl.trace(model, args, grads=[called[0][:-1] + "3"])


def test_a_module_class_in_a_selection_or_a_key_is_answered_with_its_modules_addresses():
    class RMSNorm(nn.Module):  # a hand-written norm, as in T5 and LLaMA: no layer_norm op to select
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    model = nn.Sequential(nn.Linear(4, 4), RMSNorm(), nn.Linear(4, 4), RMSNorm())
    for option in ("save", "grads"):
        with pytest.raises(KeyError, match=rf"{option}= matched nothing.*not module classes: RMSNorm modules "
                                           r"are at 1, 3"):
            tl.trace(model, torch.randn(2, 4), **{option: ["rmsnorm"]})
    # log[...] and intervene= named nothing for a class: they now answer as the selections do.
    with pytest.raises(KeyError, match=r"a trace is keyed by module addresses, not module classes: RMSNorm modules "
                                       r"are at 1, 3"):
        tl.trace(model, torch.randn(2, 4))["RMSNorm"]
    with pytest.raises(KeyError, match=r"intervene= takes module addresses, not module classes: RMSNorm modules"):
        tl.trace(model, torch.randn(2, 4), intervene={"RMSNorm": tl.zero_ablate()})


def test_an_output_last_written_through_a_view_has_its_own_gradient(tmp_path):
    # Its producer, the in-place op on the view, made the view; the returned tensor's gradient is d loss /
    # d (what the model returned), as retain_grad() on it gives, live and once loaded.
    def scaled_then_shifted(x):
        y = x * 2
        y.t().sub_(3)
        return y

    x, weights = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    log = tl.trace(scaled_then_shifted, (x,), grads=True)
    log.backward((log.output * weights).sum())
    assert torch.equal(log["output_1:1"].grad, weights)
    assert torch.equal(log["input_1:1"].grad, 2 * weights)
    loaded = tl.load(log.save(tmp_path / "aliased"))
    assert torch.equal(loaded["output_1:1"].grad, weights)


class Sentinel(torch.autograd.Function):
    """Its ctx lives exactly as long as the autograd graph does: a weakref to ctx.token says when."""

    @staticmethod
    def forward(ctx, x):
        ctx.token = Token()
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Token:
    pass


class WithSentinel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.tokens = []

    def forward(self, x):
        h = self.fc(x)
        y = Sentinel.apply(h)
        self.tokens.append(weakref.ref(y.grad_fn.token))
        return y.tanh(), h


def test_hooks_neither_keep_the_graph_alive_nor_outlive_the_trace():
    model = WithSentinel()
    log = tl.trace(model, torch.randn(2, 4), grads=True, save="none")
    out, h = log.output
    log.backward(out.sum() + h.sum(), retain_graph=True)
    assert log.num_backwards == 1
    kept = weakref.ref(log[log._gradcap.order[-1]].grad)  # held by the trace alone
    trace_ref = weakref.ref(log)
    del log
    gc.collect()
    assert trace_ref() is None  # the graph the user still holds does not keep the trace alive
    assert kept() is None  # ... and no hook left in that graph holds what the trace kept
    assert not h._backward_hooks  # (a hook Python calls sits in this dict: none is left there)
    out.sum().backward()  # a later untraced backward is unaffected
    assert model.tokens[0]() is not None
    del out, h
    gc.collect()
    assert model.tokens[0]() is None  # nothing torchlens made keeps the graph alive


def test_cleanup_removes_hooks_and_keeps_statistics():
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, grads=True)
    out = log.output
    log.backward(out.sum(), retain_graph=True)
    norm = float(log["linear_1_1:1"].grad.norm())
    reached = [op.label for op in log.ops if op.has_grad]
    log.cleanup()
    frame = log.to_pandas().set_index("label")
    assert frame.loc["linear_1_1:1", "grad_norm"] == pytest.approx(norm)
    # has_grad says a gradient arrived, as a trace saved after cleanup() and loaded says: not whether one is held.
    assert [op.label for op in log.ops if op.has_grad] == reached and "linear_1_1:1" in reached
    with pytest.raises(tl.TraceCleanedUp, match="its gradients were released"):
        log["linear_1_1:1"].grad
    out.sum().backward()
    assert log.num_backwards == 1


def test_to_pandas_grad_columns():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    log = tl.trace(model, torch.randn(3, 4), grads=True)
    assert "grad_norm" not in log.to_pandas()
    log.backward(torch.sqrt(log.output - 1e6).sum())  # sqrt of negatives: NaN gradients below
    frame = log.to_pandas().set_index("label")
    g = log["linear_1_1:1"].grad
    assert frame.loc["linear_1_1:1", "grad_norm"] == pytest.approx(float(torch.linalg.vector_norm(g)), nan_ok=True)
    assert frame.loc["linear_1_1:1", "grad_min"] == pytest.approx(float(g.min()), nan_ok=True)
    assert frame.loc["linear_2_3:1", "grad_nonfinite"] == 3


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_and_second_order_backward_work():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    oracle = Oracle()
    with oracle:
        out = model(x)
    out.pow(2).sum().backward(create_graph=True)
    expected = [g.detach() if g is not None else None for g in oracle.grads()]
    model.zero_grad()
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.pow(2).sum(), create_graph=True)
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, expected)
    assert not any(g.requires_grad for g in got if g is not None)  # the trace keeps values, not graphs
    penalty = sum(p.grad.pow(2).sum() for p in model.parameters())
    penalty.backward()  # through the first backward's graph: works, and reaches the forward again
    assert log.num_backwards == 2


def test_autograd_grad_fills_gradients_like_retain_grad():
    model, (x,), _ = zoo()["mlp"]
    oracle = Oracle()
    x1 = x.clone().requires_grad_()
    with oracle:
        out = model(x1)
    torch.autograd.grad(out.sum(), [x1])
    expected = oracle.grads()
    x2 = x.clone().requires_grad_()
    log = tl.trace(model, x2, grads=True)
    (gx,) = torch.autograd.grad(log.output.sum(), [x2])
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, expected)
    assert torch.equal(log["input_1"].grad, gx)


def test_a_batched_backward_leaves_gradients_that_say_why_they_cannot_be_read(tmp_path):
    # torch.autograd.grad(..., is_grads_batched=True) runs the backward under vmap: tensor hooks (and
    # retain_grad()) receive a batched gradient that no reader can use once the backward has returned.
    model, (x,), _ = zoo()["mlp"]
    x = x.clone().requires_grad_()
    log = tl.trace(model, x, grads=True)
    outputs = log.output.shape[-1]
    rows = torch.eye(outputs).reshape(outputs, 1, outputs).expand(outputs, *log.output.shape)
    (jacobian,) = torch.autograd.grad(log.output, x, grad_outputs=rows, is_grads_batched=True, retain_graph=True)
    assert jacobian.shape == (outputs, *x.shape)  # what the user asked for is unaffected
    op = log.ops[-2]
    assert op.has_grad
    with pytest.raises(GradientUnavailable, match="is_grads_batched=True"):
        op.grad
    log.backward(log.output.sum())  # a later backward adds to the batched gradient: still unreadable
    with pytest.raises(GradientUnavailable, match="is_grads_batched=True"):
        op.grad
    assert log.to_pandas()["grad_norm"].isna().all()
    with pytest.raises(GradientUnavailable, match="is_grads_batched=True"):
        tl.debug.hot_path(log, by="grad_norm")
    with pytest.raises(GradientUnavailable, match="is_grads_batched=True"):
        tl.debug.nonfinite_origin(log, grads=True)
    loaded = tl.load(log.save(tmp_path / "trace"))
    with pytest.raises(GradientUnavailable, match="is_grads_batched=True"):
        loaded[op.label].grad


def test_a_trace_taken_inside_jacrev_says_its_batched_gradients_cannot_be_read():
    model, (x,), _ = zoo()["mlp"]
    kept = {}

    def traced(v):
        kept["log"] = tl.trace(model, v, grads=True)
        return kept["log"].output

    jacobian = torch.func.jacrev(traced)(x[0])
    assert torch.equal(jacobian, torch.func.jacrev(model)(x[0]))
    log = kept["log"]
    with pytest.raises(GradientUnavailable, match="under vmap"):
        log.ops[-2].grad
    assert log.to_pandas()["grad_norm"].isna().all()



def test_a_trace_taken_inside_torch_func_grad_says_its_wrapped_gradients_cannot_be_read():
    # torch.func.grad runs its backward on its own wrapped tensors: the hooks received its grad-tracking
    # wrappers, and op.grad handed one back as if it were d loss / d output.
    model, (x,), _ = zoo()["mlp"]
    kept = {}

    def traced(v):
        kept["log"] = tl.trace(model, v, grads=True)
        return kept["log"].output.sum()

    assert torch.equal(torch.func.grad(traced)(x[0]), torch.func.grad(lambda v: model(v).sum())(x[0]))
    log = kept["log"]
    for op in log.ops[1:]:
        with pytest.raises(GradientUnavailable, match="torch.func.grad around the trace"):
            op.grad
    assert log.to_pandas()["grad_norm"].isna().all()


def test_grads_inside_vmap_warn_of_the_transform_rather_than_of_no_grad():
    model, (x,), _ = zoo()["mlp"]
    with pytest.warns(UserWarning, match="inside a torch.func transform") as caught:
        torch.vmap(lambda row: tl.trace(model, row, grads=True).output)(x)
    assert not any("no_grad" in str(w.message) for w in caught)


def test_a_parameter_returned_as_an_output_has_its_gradient():
    class ReturnsWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.scale = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return self.fc(x), self.scale

    torch.manual_seed(0)
    model, x = ReturnsWeight(), torch.randn(2, 3)
    log = tl.trace(model, x, grads=True)
    out, scale = log.output
    log.backward(out.sum() + (scale * torch.arange(3.0)).sum())
    assert torch.equal(log["output_2"].grad, torch.arange(3.0))
    assert torch.equal(log["output_2"].grad, model.scale.grad)


class UnusedOutput(nn.Module):
    def forward(self, x):
        steps = (x * 2).unbind(1)
        return (steps[0] * steps[-1]).sum()


def test_an_output_the_backward_never_reaches_has_no_gradient():
    # autograd hands the hook of an unused output of a multi-output op None: nothing kept, no error.
    x = torch.randn(2, 3, requires_grad=True)
    oracle = Oracle()
    with oracle:
        UnusedOutput()(x).backward()
    log = tl.trace(UnusedOutput(), x.detach().requires_grad_(), grads=True)
    log.backward(log.output)
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, oracle.grads())
    assert [op.grad is None for op in ops if op.func_name == "unbind"] == [False, True, False]
    assert log.num_backwards == 1


def test_grads_with_stop_after_are_refused_before_the_model_runs():
    # A stopped forward has no output to backpropagate from, and its saved activations are detached: a
    # trace would hold gradients no backward could ever fill (backward then failed in torch's words).
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(3, 4)
    calls = []
    model[0].register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match=r"stop_after='1' stops the forward before it makes one"):
        tl.trace(model, x, stop_after="1", grads=True)
    assert not calls
    assert tl.trace(model, x, stop_after="1").stopped_after and tl.trace(model, x, grads=True).output is not None


def test_a_backward_that_reaches_no_op_of_the_trace_says_so():
    """``log.backward(loss)`` with a loss from another forward of the model (run untraced, or another trace's
    output) ran, reached none of this trace's ops, and left every ``.grad`` None with no word."""
    import warnings

    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    gpt2, ids = small_gpt2_lm(), torch.randint(0, 64, (1, 6))
    log = tl.trace(gpt2, ids, grads=True)
    with pytest.warns(UserWarning, match=r"reached no op of this trace .* from this trace's output \(log\.output\)"):
        log.backward(gpt2(ids).logits.sum())
    assert log.num_backwards == 0
    with pytest.warns(UserWarning, match="reached no op of this trace"):
        log.backward(tl.trace(gpt2, ids, grads=True).output.logits.sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log.backward(log.output.logits.sum())
    assert log.num_backwards == 1 and log["transformer.h.0"].grad is not None
    gpt2.zero_grad(set_to_none=True)


class _ScannedParams(list):
    """The trace's (address, parameter) list, counting the entries searched through."""

    searched = 0

    def __iter__(self):
        for entry in super().__iter__():
            _ScannedParams.searched += 1
            yield entry


def test_reading_every_parameters_gradient_does_not_search_the_parameter_list_per_parameter():
    # Param.grad searched the model's parameter list for its address: reading all P gradients (as
    # nonfinite_origin(grads=True) does) was P * P / 2 comparisons.  Each record now knows its place.
    from real_models import build

    model, args, kwargs = build("gpt2")
    log = tl.trace(model, args, kwargs, save="none", grads=True)
    log.output.logits.sum().backward()
    log._model_params = _ScannedParams(log._model_params)
    _ScannedParams.searched = 0
    grads = [param.grad for param in log.params]
    assert len(grads) > 20 and all(g is dict(model.named_parameters())[p.address].grad
                                   for p, g in zip(log.params, grads))
    str(tl.debug.nonfinite_origin(log, grads=True))
    assert _ScannedParams.searched <= len(grads)
