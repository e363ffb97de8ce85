"""Models that wrap or modify their modules: adapters around a layer, norms that cast their input, and
ops that hand back the tensor they were given (``x.to()`` of the dtype it has, eval-mode dropout).

Such an op returns its argument itself, so the tensor the module's caller still holds is the very object
the op returned.  The record must keep the caller's reads on the value's own producer: only the code after
the op inside that module call reads it as the op's result, unless the call returns it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl

from accel_paths import PATHS, on_path
from trusted import assert_trusted


class CastingNorm(nn.Module):
    """An RMS norm written as Llama's: the input cast to float32 first, which returns it itself."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Residual(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.norm = CastingNorm(d)
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        residual = self.embed(x)
        return residual + self.mlp(self.norm(residual))


class Adapter(nn.Module):
    """A LoRA adapter written by hand: the frozen layer plus a low-rank update of a dropped-out input."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base
        self.dropout = nn.Dropout(0.1)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(self.dropout(x)))


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v = Adapter(nn.Linear(d, d)), Adapter(nn.Linear(d, d)), Adapter(nn.Linear(d, d))

    def forward(self, x):
        weights = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1)
        return weights @ self.v(x)


def _op(log, type_, address):
    return next(op for op in log.ops if op.type == type_ and op.module_address == address)


@pytest.mark.parametrize("compiled", PATHS)
def test_a_value_returned_unchanged_inside_a_module_stays_its_producers_for_the_caller(compiled):
    torch.manual_seed(0)
    model, x = Residual(8), torch.randn(2, 8)
    with on_path(compiled):
        log = tl.trace(model, x)
    cast, embed = _op(log, "to", "norm"), log["embed"]
    assert cast.parents == [embed.label]
    # Inside the norm, its code reads the cast's result ...
    assert _op(log, "pow", "norm").parents == [cast.label]
    # ... while the caller's residual is still the embedding's output, and the norm's call says so.
    add = next(op for op in log.ops if op.type == "add" and op.module_address is None)
    assert add.parents[0] == embed.label
    assert log.module_calls[1].label == "norm:1" and log.module_calls[1].input_ops == [embed.label]
    assert torch.equal(log.output, model(x))
    assert_trusted(tl.validate(model, x))


class Broadcasting(nn.Module):
    """Broadcasts a column against its input: ``torch.broadcast_tensors`` hands back the input itself, already
    of the broadcast shape, as the second of the tensors it returns."""

    def forward(self, x):
        column, same = torch.broadcast_tensors(x[:, :1], x)
        return column * 2 + same


class BroadcastingResidual(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.mix = Broadcasting()

    def forward(self, x):
        residual = self.embed(x)
        return self.mix(residual) + residual


@pytest.mark.parametrize("compiled", PATHS)
def test_an_input_returned_among_several_outputs_stays_its_producers_for_the_caller(compiled):
    torch.manual_seed(0)
    model, x = BroadcastingResidual(4), torch.randn(3, 4)
    with on_path(compiled):
        log = tl.trace(model, x)
    embed = log["embed"]
    same = next(op for op in log.ops if op.type == "broadcasttensors" and op.multi_output_index == 1)
    # Inside the module, its code reads the tensor broadcast_tensors returned ...
    assert log["mix"].parents[1] == same.label
    # ... while the caller's residual is still the embedding's output.
    assert log.ops[-2].parents == [log["mix"].label, embed.label]
    assert torch.equal(log.output, model(x))
    assert_trusted(log.validate())

@pytest.mark.parametrize("compiled", PATHS)
def test_adapters_reading_one_input_read_it_from_its_producer_not_from_another_adapters_dropout(compiled):
    torch.manual_seed(0)
    model, x = Attention(8).eval(), torch.randn(1, 3, 8)  # eval: each adapter's dropout returns x itself
    with on_path(compiled):
        log = tl.trace(model, x)
    calls = {call.label: call for call in log.module_calls}
    for name in "qkv":
        assert calls[f"{name}:1"].input_ops == ["input_1:1"]
        assert calls[f"{name}.base:1"].input_ops == ["input_1:1"]
        dropout = _op(log, "dropout", f"{name}.dropout")
        # The dropout module returned it: the adapter reads the dropout's output, and nothing else does.
        assert calls[f"{name}.dropout:1"].output_ops == [dropout.label]
        assert calls[f"{name}.down:1"].input_ops == [dropout.label]
        assert dropout.children == [log[f"{name}.down"].label]
    assert torch.equal(log.output, model(x))
    assert_trusted(log.validate())
    # Ablating one adapter's dropout output changes that adapter alone, and its record says so.
    edited = tl.trace(model, x, intervene={"q.dropout": tl.zero_ablate()})
    assert edited["k.base:1"].parents == ["input_1:1"]
    assert torch.equal(edited["k"].activation, log["k"].activation)
    assert torch.equal(edited["q"].activation, model.q.base(x))


def test_llamas_residuals_read_the_layer_input_not_the_norms_cast():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.tensor([[1, 5, 9, 3]])
    log = tl.trace(model, ids)
    for layer in range(2):
        block = f"model.layers.{layer}"
        into = next(call for call in log.module_calls if call.label == f"{block}:1").input_ops[0]
        adds = [op for op in log.ops if op.type == "add" and op.module_address == block]
        # hidden_states = residual + attention output, then + MLP output: residual is what entered the block
        assert adds[0].parents[0] == into
        assert adds[1].parents[0] == adds[0].label
        cast = _op(log, "to", f"{block}.input_layernorm")
        assert cast.parents == [into] and _op(log, "pow", f"{block}.input_layernorm").label in cast.children
        assert all(log[child].module_address == f"{block}.input_layernorm" for child in cast.children)
    assert torch.equal(log.output.logits, model(ids).logits)


@pytest.mark.parametrize("wrap", ["DataParallel", "compile"])
def test_a_wrapper_traced_as_its_module_is_refused_when_it_has_hooks_of_its_own(wrap):
    torch.manual_seed(0)
    inner, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    model = nn.DataParallel(inner) if wrap == "DataParallel" else torch.compile(inner, backend="eager")
    handle = model.register_forward_hook(lambda module, args, output: output * 10)
    untraced = model(x)
    assert torch.equal(untraced, inner(x) * 10)
    for run in (lambda: tl.trace(model, x), lambda: tl.validate(model, x)):
        with pytest.raises(TypeError, match=r"wrapper itself has forward hooks.*register them on \."):
            run()
    handle.remove()  # without them, the wrapper is traced as the module it wraps
    log = tl.trace(model, x)
    assert torch.equal(log.output, model(x)) and [call.label for call in log.module_calls] == ["0:1", "1:1"]


class CallsForwardDirectly(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.inner.forward(x))  # bypasses inner's __call__: no module call, no hooks


class _RunsItsForward(nn.Linear):
    """A class whose own ``__call__`` runs its forward directly, never reaching nn.Module's."""

    def __call__(self, x):
        return self.forward(x) * 2


class OverridesCall(CallsForwardDirectly):
    def __init__(self):
        super().__init__()
        self.inner = _RunsItsForward(4, 4)

    def forward(self, x):
        return self.head(self.inner(x))


@pytest.mark.parametrize("build", [CallsForwardDirectly, OverridesCall])
def test_a_module_run_only_through_its_forward_is_named_with_the_ops_that_used_its_parameters(build):
    # log["inner"] said that 'inner' "is a module of the model that never ran in this forward", though it ran.
    model, x = build(), torch.randn(2, 4)
    log = tl.trace(model, x)
    users = [op.label for op in log.ops if "inner.weight" in op.params]
    assert users and [call.label for call in log.module_calls] == ["head:1"]
    for run in (lambda: tl.trace(model, x, save=["inner"]), lambda: tl.trace(model, x, grads=["inner"]),
                lambda: tl.trace(model, x, intervene={"inner": tl.zero_ablate()}), lambda: log["inner"]):
        with pytest.raises((tl.InterventionError, KeyError), match=rf"made no module call.*{users[0]}.*forward\("):
            run()
    edited = tl.trace(model, x, intervene={users[0]: tl.zero_ablate()})  # the way the message names
    assert torch.equal(edited.output, model.head(torch.zeros(2, 4)))


class _OwnCallImpl(nn.Linear):
    """A class whose own _call_impl hands the call on to nn.Module's, as some wrappers do."""

    def _call_impl(self, *args, **kwargs):
        return super()._call_impl(*args, **kwargs)


class _HoldsOwnCallImpl(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = _OwnCallImpl(4, 4)

    def forward(self, x):
        return self.fc(x).relu()


def test_a_module_whose_call_impl_calls_nn_modules_is_one_call():
    log = tl.trace(_HoldsOwnCallImpl(), torch.randn(2, 4))
    assert [c.label for c in log.module_calls] == ["fc:1"]
    assert [m.num_calls for m in log.modules if m.address == "fc"] == [1]
    assert log["fc:1"].label == "linear_1_1:1"
