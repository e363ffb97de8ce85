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
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import torchlens as tl
from torchlens.capture.mode import _NOT_OPS
from torchlens.record.errors import GradientUnavailable
from zoo import LoopRNN, zoo


class Oracle(TorchFunctionMode):
    """Untraced reference: keeps each torch call's output tensors in order and their gradients.

    ``how="retain_grad"`` calls ``retain_grad()``; ``how="hook"`` registers a hook per output, which is
    what PyTorch defines for a tensor modified in place afterwards (the gradient of that version)."""

    def __init__(self, how="retain_grad"):
        super().__init__()
        self.how = how
        self.outputs = []  # (tensor or None, requires_grad)
        self.hooked: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _NOT_OPS:
            return out
        if isinstance(out, torch.Tensor):
            leaves = [out]
        elif func is torch.Tensor.__setitem__:
            leaves = [args[0]]
        elif isinstance(out, (tuple, list)):
            leaves = _flat(out)
        else:
            return out
        for t in leaves:
            k = len(self.outputs)
            self.outputs.append((t, t.requires_grad))
            if t.requires_grad:
                if self.how == "retain_grad":
                    t.retain_grad()
                else:
                    t.register_hook(lambda g, k=k: self._keep(k, g))
        return out

    def _keep(self, k, g):
        self.hooked[k] = g.clone() if k not in self.hooked else self.hooked[k] + g

    def grads(self):
        if self.how == "retain_grad":
            return [t.grad if rg else None for t, rg in self.outputs]
        return [self.hooked.get(k) for k in range(len(self.outputs))]


def _flat(out):
    """Every tensor inside nested tuples, lists and dicts, in order."""
    found = []
    for item in (out.values() if isinstance(out, dict) else out):
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list, dict)):
            found.extend(_flat(item))
    return found


def _loss(output):
    """A loss reaching every floating output, weighted so that gradients differ per element."""
    leaves = [t for t in _flat([output]) if t.is_floating_point() and t.requires_grad]
    g = torch.Generator().manual_seed(7)
    return sum((t * torch.randn(t.shape, generator=g)).sum() for t in leaves)


# Models without parameters: their inputs require grad, so that there is a backward at all.
_INPUT_GRAD = {"functional", "multi_output"}


def _case(name):
    model, args, kwargs = zoo()[name]
    if name in _INPUT_GRAD:
        args = tuple(a.clone().requires_grad_() for a in args)
    return model, args, kwargs


def _reference(name, how="retain_grad", case=_case):
    model, args, kwargs = case(name)
    oracle = Oracle(how)
    torch.manual_seed(1)
    with oracle:
        out = model(*args, **kwargs)
    _loss(out).backward()
    return oracle, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _traced(name, case=_case, **options):
    model, args, kwargs = case(name)
    torch.manual_seed(1)
    log = tl.trace(model, args, kwargs, grads=True, **options)
    log.backward(_loss(log.output))
    return log, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _op_grads(log):
    ops = [op for op in log if op.kind == "op"]
    return ops, [op.grad if op.requires_grad else None for op in ops]


def _assert_bit_identical(ops, got, expected):
    assert len(got) == len(expected), (len(got), len(expected))
    assert any(e is not None for e in expected), "the reference run produced no gradient to compare"
    for op, g, e in zip(ops, got, expected):
        if e is None:
            assert g is None, op.label
        else:
            assert g is not None, op.label
            assert g.dtype == e.dtype and g.shape == e.shape == op.shape, op.label
            assert torch.equal(g, e), op.label


# Models without in-place writes: retain_grad() on every output is the reference.
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


def test_unknown_grads_selector_raises_with_closest_labels():
    model, args, _ = zoo()["mlp"]
    with pytest.raises(KeyError, match="closest: linear_2_3:1"):
        tl.trace(model, args, grads=["linear_2_3:9"])
    with pytest.raises(KeyError, match="relu"):
        tl.trace(model, args, grads=["reluu"])


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
    assert len(h._backward_hooks) == 1
    trace_ref = weakref.ref(log)
    del log
    gc.collect()
    assert trace_ref() is None  # the graph the user still holds does not keep the trace alive
    assert len(h._backward_hooks) == 0  # ... and the trace took its hooks with it
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
    log.cleanup()
    frame = log.to_pandas().set_index("label")
    assert frame.loc["linear_1_1:1", "grad_norm"] == pytest.approx(norm)
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


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


def test_checkpoint_regions():
    x = torch.randn(3, 4, requires_grad=True)
    model = Checkpointed(reentrant=False)
    oracle = Oracle()
    with oracle:
        out = model(x)
    out.sum().backward()
    expected, ref_params = oracle.grads(), {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    log = tl.trace(model, x.detach().requires_grad_(), grads=True)
    log.backward(log.output.sum())
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, expected)  # non-reentrant: the original graph carries every gradient
    assert all(torch.equal(p.grad, ref_params[n]) for n, p in model.named_parameters())

    model = Checkpointed(reentrant=True)
    log = tl.trace(model, x.detach().requires_grad_(), grads=True)
    log.backward(log.output.sum())
    assert log["head"].grad is not None
    inner = [op for op in log if op.module and op.module.startswith("block")]
    assert inner
    for op in inner:  # a reentrant region runs its forward under no_grad: said clearly
        with pytest.raises(GradientUnavailable, match="does not require grad"):
            op.grad


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class UsesCustomFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return Square.apply(self.fc(x)).sum(-1)


def test_custom_autograd_function_output_gets_its_gradient():
    model = UsesCustomFunction()
    x = torch.randn(3, 4)
    oracle = Oracle()
    with oracle:
        out = model(x)
    out.sum().backward()
    expected = oracle.grads()
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, expected)
    assert log["fc"].grad is not None


def test_inplace_after_save_still_refused_as_autograd_refuses_it():
    def f(x):
        y = x.exp()
        y.add_(1)  # exp saved y for backward: autograd refuses the backward
        return y

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        f(x).sum().backward()
    log = tl.trace(f, x, grads=True, saved_for_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        log.backward(log.output.sum())


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
    x.requires_grad_()
    log = tl.trace(model, x, saved_for_backward=True)
    assert log["0"].saved_for_backward_bytes == (3 * 4 + 8 * 4) * fp  # now the weight is kept for x's gradient


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
    saved = tl.debug.hot_path(log, by="saved_for_backward", group="module")
    assert {r["address"]: r["total"] for r in saved} == {
        mc.label: mc.saved_for_backward_bytes for mc in log.module_calls}
    with pytest.raises(GradientUnavailable, match="grads=True"):
        tl.debug.hot_path(tl.trace(model, args), by="grad_norm")


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
    clean = tl.trace(SqrtOfZero(), torch.randn(3, 4), grads=["b"])
    clean.backward(clean.output.sum())
    assert not tl.debug.nonfinite_origin(clean, grads=True)


def test_save_and_load_keep_gradients(tmp_path):
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, grads=True, saved_for_backward=True)
    log.backward(log.output.sum())
    log.save(tmp_path / "t")
    loaded = tl.load(tmp_path / "t")
    assert loaded.num_backwards == 1
    for op in log:
        if op.has_grad:
            assert torch.equal(loaded[op.label].grad, op.grad), op.label
    assert torch.equal(loaded._param_grads["head.weight"], model.head.weight.grad)
    assert loaded.saved_for_backward_bytes == log.saved_for_backward_bytes
    assert loaded["linear_1_1:1"].saved_for_backward_bytes == log["linear_1_1:1"].saved_for_backward_bytes
    frame, original = loaded.to_pandas(), log.to_pandas()
    assert frame["grad_norm"].equals(original["grad_norm"])
    manifest = (tmp_path / "t" / "manifest.json").read_text()
    assert "gradients.safetensors" in manifest
    # Statistics survive a save after cleanup(); non-finite values round-trip through JSON.
    bad = tl.trace(model, args, grads=True)
    bad.backward(torch.sqrt(bad.output - 1e6).sum())
    bad.cleanup()
    bad.save(tmp_path / "c")
    reread = tl.load(tmp_path / "c").to_pandas().set_index("label")
    assert reread["grad_nonfinite"].equals(bad.to_pandas().set_index("label")["grad_nonfinite"])
    assert reread["grad_norm"].isna().any()
    plain = tl.trace(model, args)
    plain.save(tmp_path / "p")
    assert tl.load(tmp_path / "p")._gradcap is None
    packed_only = tl.trace(model, args, saved_for_backward=True)
    packed_only.save(tmp_path / "s")
    reread = tl.load(tmp_path / "s")
    assert reread._gradcap is None and reread.saved_for_backward_bytes == packed_only.saved_for_backward_bytes


def test_extract_streams_gradients_beside_activations(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,))) for _ in range(3)]

    def loss_fn(output, batch):
        return F.cross_entropy(output, batch[1], reduction="sum")

    with pytest.raises(ValueError, match="loss_fn"):
        tl.extract(model, batches, ["0"], tmp_path / "x", grads=True, progress=False)
    out = tl.extract(model, batches, ["0", "2"], tmp_path / "e", args_of=lambda b: b[0], grads=True,
                     loss_fn=loss_fn, progress=False)
    arrays = tl.load_extracted(out, as_torch=True)
    assert set(arrays) == {"0", "2", "grad:0", "grad:2"}
    expected_acts, expected_grads = [], []
    for x, y in batches:
        hidden = model[0](x)
        hidden.retain_grad()
        logits = model[2](model[1](hidden))
        logits.retain_grad()
        F.cross_entropy(logits, y, reduction="sum").backward()
        expected_acts.append(hidden.detach())
        expected_grads.append((hidden.grad, logits.grad))
    assert torch.equal(arrays["0"], torch.cat(expected_acts))
    assert torch.equal(arrays["grad:0"], torch.cat([g for g, _ in expected_grads]))
    assert torch.equal(arrays["grad:2"], torch.cat([g for _, g in expected_grads]))
    model.zero_grad(set_to_none=True)
    tl.extract(model, batches, ["2"], tmp_path / "f", args_of=lambda b: b[0], grads=True, loss_fn=loss_fn,
               progress=False)
    assert all(p.grad is None for p in model.parameters())  # extraction leaves the model as it was


def test_kernel_profile_reuses_a_grads_trace_and_reports_backward_per_module_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    fresh = tl.report.kernel_profile(model, x, backward=True)
    model.zero_grad()
    log = tl.trace(model, x, grads=True)
    reused = tl.report.kernel_profile(log, backward=True)
    assert log.num_backwards == 1 and log["linear_1_1:1"].grad is not None  # the profiled backward filled them
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


def test_loaded_trace_gives_parameters_and_their_gradients_back(tmp_path):
    model, args, _ = zoo()["mlp"]
    model.zero_grad(set_to_none=True)
    log = tl.trace(model, args, grads=True)
    log.backward(log.output.sum())
    log.save(tmp_path / "t")
    loaded = tl.load(tmp_path / "t")
    assert [p.address for p in loaded.params] == [p.address for p in log.params]
    for live, back in zip(log.params, loaded.params, strict=True):
        assert (back.shape, back.dtype, back.requires_grad, back.op_labels) == \
            (live.shape, live.dtype, live.requires_grad, live.op_labels)
        assert torch.equal(back.grad, live.grad), live.address
    assert loaded.params.to_pandas().equals(log.params.to_pandas())
    # Saved without the tensors, or without gradients at all: the loaded Param says so.
    log.save(tmp_path / "meta", activations=False)
    with pytest.raises(GradientUnavailable, match="activations=False"):
        tl.load(tmp_path / "meta").params[0].grad
    plain = tl.trace(model, args)
    plain.save(tmp_path / "plain")
    reread = tl.load(tmp_path / "plain")
    assert reread.params[0].address == log.params[0].address
    with pytest.raises(GradientUnavailable, match="without grads="):
        reread.params[0].grad
    log.cleanup()
    log.save(tmp_path / "cleaned")
    cleaned = tl.load(tmp_path / "cleaned")
    assert [p.op_labels for p in cleaned.params] == [p.op_labels for p in log.params]
    with pytest.raises(GradientUnavailable, match="cleanup"):
        cleaned.params[0].grad
