"""Gradient capture through autograd's own extension points: checkpointed regions, custom
``autograd.Function``s, the user's tensor and module hooks, and what autograd refuses.  The reference for
every gradient is ``retain_grad()`` on an untraced run (``grad_oracle.Oracle``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.record.errors import GradientUnavailable
from grad_oracle import Oracle, _assert_bit_identical, _op_grads
from accel_paths import PATHS, on_path
from zoo import Square


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
    inner = [op for op in log if op.module and op.module.startswith("block")
             and not op.module.startswith("block.2")]  # (the region's output has its gradient: below)
    assert inner
    for op in inner:  # a reentrant region runs its forward under no_grad: said clearly
        with pytest.raises(GradientUnavailable, match="does not require grad"):
            op.grad


def test_reentrant_checkpoint_region_output_has_the_gradient_retain_grad_gives():
    # The region's output gets its backward node only when the checkpoint's Function returns: its
    # gradient is that of the returned tensor, as retain_grad() on it gives.
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = Checkpointed(reentrant=True)
    x = torch.randn(3, 4, requires_grad=True)
    region = checkpoint(model.block, x, use_reentrant=True)
    region.retain_grad()
    model.head(region).sum().backward()
    expected_params = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    log = tl.trace(model, x.detach().requires_grad_(), grads=True)
    log.backward(log.output.sum())
    assert torch.equal(log["block.2"].grad, region.grad)  # the region's last op: the tensor it returned
    assert torch.equal(log["input_1"].grad, x.grad)
    assert all(torch.equal(p.grad, expected_params[n]) for n, p in model.named_parameters())

    # A region that is the whole forward: the trace's output is that tensor.
    block = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())
    y = checkpoint(block, x, use_reentrant=True)
    y.retain_grad()
    y.pow(2).sum().backward()
    log = tl.trace(lambda v: checkpoint(block, v, use_reentrant=True), x.detach().requires_grad_(), grads=True)
    log.backward(log.output.pow(2).sum())
    assert torch.equal(log["output_1"].grad, y.grad)


def test_function_apply_is_wrapped_whether_torch_writes_it_in_python_or_c():
    # torch 2.14 made Function.apply torch's C apply itself: reading its Python code failed at import.
    from torchlens.capture.function_outputs import _calls_super_apply, _unbound

    c_apply = torch._C._FunctionBase.__dict__["apply"]
    assert not _calls_super_apply(c_apply)
    python_apply = vars(torch.autograd.Function)["apply"]
    assert _calls_super_apply(python_apply) == ("super" in python_apply.__func__.__code__.co_names)
    x = torch.randn(3, requires_grad=True)
    via_c = _unbound(c_apply)(Square, x)  # what the wrapper calls when it wraps torch's C apply
    assert torch.equal(via_c, x * x) and type(via_c.grad_fn).__name__ == "SquareBackward"
    via_c.sum().backward()
    assert torch.equal(x.grad, 2 * x.detach())


def test_a_torch_that_runs_function_apply_in_c_is_named_at_a_trace_with_gradients(monkeypatch):
    # There an apply bound before the trace runs unseen: a trace with gradients says so, once per trace.
    import warnings

    from torchlens.capture import function_outputs

    assert (function_outputs.BOUND_APPLY_UNSEEN is None) == function_outputs._calls_super_apply(
        torch.autograd.Function.apply)
    monkeypatch.setattr(function_outputs, "BOUND_APPLY_UNSEEN", "runs autograd.Function.apply in C")
    model = nn.Linear(4, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tl.trace(model, torch.randn(3, 4), grads=True)
        tl.trace(model, torch.randn(3, 4))  # no gradients: Function.apply is not wrapped, nothing to say
    assert [str(w.message) for w in caught if "Function.apply" in str(w.message)] == [
        "runs autograd.Function.apply in C"]


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


class PassThrough(torch.autograd.Function):
    """Returns its input: autograd makes the output a view of it, then gives that view this node."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 3


def test_a_custom_function_output_has_the_gradient_retain_grad_gives():
    # Made under no_grad inside Function.forward (Square) or a view made after it (PassThrough), its
    # backward node is set once the Function returns.
    torch.manual_seed(0)
    fc = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    kept = {}

    def f(v):
        squared = Square.apply(fc(v))
        passed = PassThrough.apply(squared * 2)
        kept["squared"], kept["passed"] = squared, passed
        return passed.tanh().sum(-1)

    out = f(x)
    for t in kept.values():
        t.retain_grad()
    out.sum().backward()
    expected = {k: t.grad for k, t in kept.items()}
    expected_weight = fc.weight.grad.clone()
    fc.zero_grad(set_to_none=True)

    log = tl.trace(f, x, grads=True)
    log.backward(log.output.sum())
    assert torch.equal(log["mul_1_2:1"].grad, expected["squared"])  # x * x inside Square.forward
    assert torch.equal(log["viewas_1_4:1"].grad, expected["passed"])  # the view PassThrough returned
    assert torch.equal(fc.weight.grad, expected_weight)


square = Square.apply  # bound once, before any trace, as libraries export their fused ops


class UsesBoundApply(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(square(self.fc1(x)))


def test_a_function_applied_through_an_apply_bound_before_the_trace_has_its_gradient():
    torch.manual_seed(0)
    model, x = UsesBoundApply(), torch.randn(3, 4)
    squared = square(model.fc1(x))
    squared.retain_grad()
    model.fc2(squared).sum().backward()

    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    assert log["mul_1_2:1"].requires_grad
    assert torch.equal(log["mul_1_2:1"].grad, squared.grad)


class InplaceLeakyRelu(torch.autograd.Function):
    """An in-place activation (as InPlace-ABN's): writes its input, marks it dirty and returns it."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(torch.where(x > 0, 1.0, 0.1))
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * torch.where(y > 0, 1.0, 0.1)


class InplaceActivationMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(InplaceLeakyRelu.apply(self.fc1(x)).tanh())


def test_a_function_that_writes_its_input_in_place_has_the_gradient_of_what_it_returned(recwarn):
    # torch moves a dirty input's version counter once more as apply returns: the in-place op inside the
    # Function still holds the value (its parent link, activation and hook follow it to the new node).
    torch.manual_seed(0)
    model, x = InplaceActivationMLP(), torch.randn(3, 4)
    activated = InplaceLeakyRelu.apply(model.fc1(x))
    activated.retain_grad()
    model.fc2(activated.tanh()).sum().backward()

    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    written = log["mul_1_4:1"]
    assert written.is_inplace and log["tanh_1_5:1"].parents == [written.label]
    assert torch.equal(written.grad, activated.grad)
    assert not torch.equal(log["linear_1_1:1"].grad, activated.grad)  # the Function's backward between them
    assert torch.equal(written.activation, activated.detach())
    assert not [w for w in recwarn if "dropped saved activations" in str(w.message)]


def test_full_backward_hooks_keep_module_call_gradients():
    # nn.Module.register_full_backward_hook (Captum, Opacus) wraps each call's output in a Function.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    seen = []
    for sub in model:
        sub.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(grad_out[0]))
    x = torch.randn(3, 4, requires_grad=True)
    outputs, h = [], x
    for sub in model:
        h = sub(h)
        h.retain_grad()
        outputs.append(h)
    h.sum().backward()
    expected_params = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    seen.clear()

    log = tl.trace(model, x.detach().requires_grad_(), grads=True)
    log.backward(log.output.sum())
    for call, expected in zip(log.module_calls, outputs, strict=True):
        assert torch.equal(call.grad, expected.grad), call.label
    assert torch.equal(log["output_1"].grad, outputs[-1].grad)
    assert len(seen) == 3  # the user's hooks still ran
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected_params))


class HookedFunctionOutput(nn.Module):
    """The user's own hook, registered in forward on a Function's output, scales its gradient."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = PassThrough.apply(self.fc(x))
        h.register_hook(lambda g: g * 10)
        return h * 3


def test_a_user_hook_on_a_function_output_still_runs():
    # The trace must not change what autograd computes: parameter gradients bit-identical.
    torch.manual_seed(0)
    model, x = HookedFunctionOutput(), torch.randn(2, 4)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))


def test_a_user_hook_changing_the_gradient_is_seen_as_retain_grad_sees_it():
    # retain_grad() keeps the gradient after every tensor hook; a hook the forward registers runs first.
    torch.manual_seed(0)
    fc, fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
    kept = {}

    def f(v):
        y = fc(v)
        y.register_hook(lambda g: g * 10)
        kept["y"] = y
        return fc2(y)

    x = torch.randn(3, 4)
    out = f(x)
    kept["y"].retain_grad()
    out.sum().backward()
    expected = kept["y"].grad
    log = tl.trace(f, x, grads=True)
    log.backward(log.output.sum())
    assert torch.equal(log["linear_1_1:1"].grad, expected)


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


class PerturbedEmbeddings(nn.Module):
    """Adversarial training's perturbation of a GPT-2's input embeddings: a leaf made in the forward, whose
    gradient a hook registered there normalises (its first hook: torch empties the leaf's hook list)."""

    def __init__(self):
        super().__init__()
        import real_models

        self.lm = real_models.small_gpt2_lm()
        self.delta = None

    def forward(self, ids):
        embeds = self.lm.transformer.wte(ids)
        self.delta = torch.zeros_like(embeds).requires_grad_()
        self.delta.register_hook(lambda g: g / g.norm())
        return self.lm(inputs_embeds=embeds + self.delta).logits


def test_a_hook_the_forward_registers_on_a_leaf_is_run_before_the_leafs_gradient_is_kept():
    pytest.importorskip("transformers")
    model, ids = PerturbedEmbeddings(), torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    model(ids).pow(2).sum().backward()
    expected = model.delta.grad
    log = tl.trace(model, ids, grads=True)
    log.backward(log.output.pow(2).sum())
    (delta,) = [op for op in log if op.func_name == "zeros_like"]
    assert torch.equal(delta.grad, expected) and torch.equal(delta.grad, model.delta.grad)
    assert torch.allclose(delta.grad.norm(), torch.tensor(1.0))  # after the user's hook, as .grad is


class _InputGradient(nn.Module):
    """Adds torch.func.grad of a function of its input, which refuses saved-tensor hooks."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + torch.func.grad(lambda row: (row ** 2).sum())(x[0])


@pytest.mark.parametrize("compiled", PATHS)
def test_a_forward_refusing_saved_tensor_hooks_says_saved_for_backward_is_why(compiled):
    # torch.func.grad raises on any saved-tensor hook, and saved_for_backward=True is what installs one: the
    # error says so, where torch's own message only asks for an issue, and the forward traces without it.
    model, x = _InputGradient(), torch.randn(2, 4)
    with on_path(compiled):
        with pytest.raises(RuntimeError, match="saved tensor hooks") as raised:
            tl.trace(model, x, saved_for_backward=True)
        log = tl.trace(model, x)
    assert any("trace it without saved_for_backward=True" in note for note in raised.value.__notes__)
    assert torch.equal(log.output, model(x))


class _PhysicsInformed(nn.Module):
    """A physics-informed network: its forward runs a backward of its own, d u / d x, kept in the graph."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        u = self.net(x)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return (du.pow(2).sum(-1) - u.squeeze(-1)).pow(2).mean()


_PHYSICS_INFORMED = _PhysicsInformed()


@pytest.mark.parametrize("compiled", PATHS)
def test_a_backward_inside_the_forward_adds_its_gradients_as_retain_grad_does(compiled):
    # The inner torch.autograd.grad reaches the hooks of the ops before it while the forward runs: they hold
    # d u.sum() / d output when the trace returns, the loss's backward adds to it, as to retain_grad() tensors,
    # and the input's record holds both where its .grad holds only the loss's share.
    model = _PHYSICS_INFORMED
    x = torch.randn(5, 2, generator=torch.Generator().manual_seed(0)).requires_grad_()
    oracle = Oracle()
    with oracle:
        out = model(x)
    out.backward()
    model.zero_grad()
    x.grad = None
    with on_path(compiled):
        log = tl.trace(model, x, grads=True)
    assert log.num_backwards == 1
    inner = log["input_1"].grad.clone()
    assert torch.equal(log["linear_2_3:1"].grad, torch.ones(5, 1))  # d u.sum() / d u
    log.backward(log.output)
    assert log.num_backwards == 2
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, oracle.grads())
    assert not torch.equal(log["input_1"].grad, x.grad)
    assert torch.allclose(log["input_1"].grad - inner, x.grad)


def _t5gemma_checkpointed():
    """A tiny T5Gemma whose layers are checkpointed with ``use_reentrant=True``.  Its norms scale by ``1 +
    self.weight.float()``, and ``float()`` of a float32 weight returns the parameter itself: an op whose output
    is a leaf, inside a region whose forward torch runs again, in a backward of its own, to take the gradient."""
    from transformers import T5GemmaConfig, T5GemmaForConditionalGeneration, T5GemmaModuleConfig

    stack = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=99, max_position_embeddings=64)
    config = T5GemmaConfig(encoder=T5GemmaModuleConfig(**stack), decoder=T5GemmaModuleConfig(**stack), vocab_size=99,
                           use_cache=False)
    torch.manual_seed(0)
    model = T5GemmaForConditionalGeneration(config).train()
    model.activation_checkpointing_enable({"use_reentrant": True})
    ids = torch.randint(0, 99, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "decoder_input_ids": ids[:, :5]}


# Each sink the hooks may write into: the C++ hooks', the C hooks' (where ``_autograd`` is left out), Python's.
SINKS = [pytest.param((True, ()), id="cpp"), pytest.param((True, ("_autograd",)), id="c"),
         pytest.param((False, ()), id="python")]


@pytest.mark.parametrize("path", SINKS)
def test_a_parameter_an_op_returns_in_a_reentrant_checkpoint_has_the_parameters_gradient(path):
    # The recomputing backward reaches no record but the parameter: its gradient was dropped as a later forward's.
    pytest.importorskip("transformers")
    model, kwargs = _t5gemma_checkpointed()
    with on_path(*path):
        log = tl.trace(model, (), kwargs, grads=True)
    log.backward(log.output.logits.pow(2).mean())
    returned = [op for op in log if op.func_name == "float" and op.params]  # weight.float(): the weight itself
    assert any(".layers." in op.module for op in returned), "no norm weight returned inside a checkpointed layer"
    for op in returned:
        assert torch.equal(op.grad, model.get_parameter(op.params[0]).grad), op.label
    assert log.num_backwards == 1
    kept = [op.grad for op in returned]
    model(**kwargs).logits.pow(2).mean().backward()  # a later forward, untraced, recomputing its regions too
    assert log.num_backwards == 1
    assert all(op.grad is grad for op, grad in zip(returned, kept))


@pytest.mark.parametrize("path", SINKS)
def test_an_input_a_reentrant_region_reads_unhanded_has_its_whole_gradient(path):
    # The region reads x without being handed it: its recomputing backward sends x a share of its own.
    from torch.utils.checkpoint import checkpoint

    head = nn.Linear(4, 1)

    def forward(x):
        return head(checkpoint(lambda a: a * x, x * 2, use_reentrant=True)).sum()

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
    forward(x).backward()
    expected, x.grad = x.grad, None
    with on_path(*path):
        log = tl.trace(forward, x, grads=True)
    log.backward(log.output)
    assert torch.equal(x.grad, expected)
    assert torch.allclose(log["input_1"].grad, expected)
    assert log.num_backwards == 1
