"""Models whose modules compute or change their weights, inputs or outputs outside forward(): parametrizations,
the hook-based weight norm and pruning, quantization-aware training's fake-quantize modules, and hooks the user
registered.  Their traces must leave the model's output and state as an untraced forward does, and replay."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import torchlens as tl

from accel_paths import PATHS, on_path
from trusted import assert_trusted


class Symmetric(nn.Module):
    """A parametrization of a square weight: its upper triangle mirrored."""

    def forward(self, weight):
        return weight.triu() + weight.triu(1).transpose(0, 1)


def _transformed(kind):
    """A small MLP whose first Linear computes its weight outside its forward, in training mode (spectral norm
    then updates its power-iteration vectors in place), and the module address of the ops computing it."""
    import torch.nn.utils.parametrize as parametrize
    import torch.nn.utils.prune as prune
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3)).train()
    transforms = {
        "custom": lambda m: parametrize.register_parametrization(m, "weight", Symmetric()),
        "orthogonal": parametrizations.orthogonal,
        "weight_norm": parametrizations.weight_norm,
        "spectral_norm": parametrizations.spectral_norm,
        "hooked_weight_norm": torch.nn.utils.weight_norm,
        "hooked_spectral_norm": torch.nn.utils.spectral_norm,
        "pruned": lambda m: prune.l1_unstructured(m, "weight", amount=0.5),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the hook-based weight_norm is deprecated
        transforms[kind](model[0])
    return model, "0.parametrizations.weight.0" if parametrize.is_parametrized(model[0]) else "0"


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("kind", ["custom", "orthogonal", "weight_norm", "spectral_norm", "hooked_weight_norm",
                                  "hooked_spectral_norm", "pruned"])
def test_a_weight_computed_outside_forward_is_traced_as_an_untraced_forward_computes_it(compiled, kind):
    (traced, weight_module), (untraced, _) = _transformed(kind), _transformed(kind)
    x, computed = torch.randn(2, 4), []
    if weight_module != "0":  # a parametrization recomputes the weight at each read: kept as the forward read it
        untraced[0].parametrizations.weight.register_forward_hook(lambda module, args, out: computed.append(out))
    with on_path(compiled):
        log = tl.trace(traced, x, grads=True)
    expected = untraced(x)
    if weight_module == "0":  # the hook-based transforms leave the weight they set as an attribute
        computed.append(untraced[0].weight)
    assert torch.equal(log.output, expected)
    assert all(torch.equal(a, b) for a, b in zip(traced.state_dict().values(), untraced.state_dict().values()))
    linear = next(op for op in log.ops if op.type == "linear")
    weight = log[linear.parent_arg_positions[1]]  # the weight the first linear read: computed, not a parameter
    assert weight.module_address == weight_module and weight.modules[0] == "0:1"
    assert torch.equal(weight.activation, computed[0])
    assert_trusted(log.validate())
    log.backward(log.output.square().sum())
    expected.square().sum().backward()
    for (name, got), want in zip(traced.named_parameters(), untraced.parameters()):
        assert torch.equal(got.grad, want.grad), name


def _qat_model():
    """A QAT model with the unfused FakeQuantize modules: their first forward resizes the per-channel scale
    and zero point (``resize_``) before filling them."""
    import torch.ao.quantization as quantization

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).train()
    per_channel = quantization.MovingAveragePerChannelMinMaxObserver
    model.qconfig = quantization.QConfig(
        activation=quantization.FakeQuantize.with_args(observer=quantization.MovingAverageMinMaxObserver),
        weight=quantization.FakeQuantize.with_args(observer=per_channel, quant_min=-128, quant_max=127,
                                                   dtype=torch.qint8, qscheme=torch.per_channel_symmetric))
    return quantization.prepare_qat(model)


@pytest.mark.parametrize("compiled", PATHS)
def test_a_fake_quantize_model_replays_skipping_only_the_resizes_that_grew_a_buffer(compiled):
    model, x = _qat_model(), torch.randn(2, 4)
    with on_path(compiled):
        log = tl.trace(model, x)
    result = log.validate()
    assert_trusted(result)
    grown = [label for label, reason in result.not_replayed if "resize_ grew" in reason]
    assert grown and all(log[label].func_name == "resize_" for label in grown)
    assert len(grown) == len(result.not_replayed)


def test_a_label_site_on_a_fake_quantize_model_leaves_its_grown_buffers_as_one_forward_does():
    # The extra pass that resolves label sites copied each buffer back into the one its first forward had grown:
    # a per-channel observer's empty min_val failed the copy with torch's "size of tensor a (8) must match the
    # size of tensor b (0)", and a scale grown from 1 to 8 entries was broadcast back, keeping the new size.
    import copy

    model, x = _qat_model(), torch.randn(2, 4)
    by_hand = copy.deepcopy(model)
    by_hand[1].register_forward_hook(lambda module, args, out: out * 0.5)
    expected = by_hand(x)
    log = tl.trace(model, x, intervene={(lambda op: op.type == "relu"): tl.scale(0.5)})
    assert torch.equal(log.output, expected)
    after, by_hand_after = model.state_dict(), by_hand.state_dict()
    assert all(torch.equal(after[key], by_hand_after[key]) for key in by_hand_after)


def test_a_label_site_inside_parametrize_cached_resolves_against_a_forward_that_computes_the_weight():
    # The extra pass that resolves label sites filled parametrize.cached()'s cache, so the intervened run read the
    # weight from it without computing it, and was refused as taking "another path than the reference trace".
    import torch.nn.utils.parametrize as parametrize

    model, _ = _transformed("weight_norm")
    x = torch.randn(2, 4)
    with parametrize.cached():
        expected = model[2](model[1](model[0](x)) * 0.5)
    with parametrize.cached():
        log = tl.trace(model, x, intervene={(lambda op: op.type == "relu"): tl.scale(0.5)})
        assert len(parametrize._cache) == 1  # filled once, by the forward traced
    assert torch.equal(log.output, expected)
    assert [op.type for op in log.ops if op.kind == "op"] == ["weightnorm", "linear", "relu", "linear"]


def test_a_resize_that_shrinks_or_keeps_the_size_is_replayed():
    def resized(x):
        shrunk = (torch.ones(6) * x.sum()).resize_(2)
        grown = (torch.ones(1) * x.sum()).resize_(4)
        return shrunk.sum() + grown.copy_(x)

    result = tl.trace(resized, torch.randn(4)).validate()
    assert_trusted(result)
    assert [label for label, _ in result.not_replayed] == ["resize_2_8:1"]


class Fallback(nn.Module):
    """A model that catches its submodule's exception and carries on without it, as an untraced run does."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        try:
            h = self.a(x)
        except ValueError:
            h = x
        return self.b(h)


def _rejecting_hook(module, args, output):
    raise ValueError("output rejected")


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("option", ["intervene", "stop_after"])
def test_a_module_call_its_own_hook_aborted_is_no_site_reached(compiled, option):
    torch.manual_seed(0)
    model, x = Fallback(), torch.randn(2, 4)
    model.a.register_forward_hook(_rejecting_hook)
    kwargs = {"intervene": {"a": tl.scale(2.0)}} if option == "intervene" else {"stop_after": "a"}
    with on_path(compiled), pytest.raises(tl.InterventionError, match=r"never reached.*'a' was called \(a:1\)"):
        tl.trace(model, x, **kwargs)
    assert list(model.a._forward_hooks.values()) == [_rejecting_hook]
    assert not model.a._forward_pre_hooks and not model.a._forward_hooks_always_called


@pytest.mark.parametrize("compiled", PATHS)
def test_stop_after_a_module_whose_hook_raises_lets_the_exception_through(compiled):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    model[1].register_forward_hook(_rejecting_hook)
    with on_path(compiled), pytest.raises(ValueError, match="output rejected"):
        tl.trace(model, torch.randn(2, 4), stop_after="1")
    assert list(model[1]._forward_hooks.values()) == [_rejecting_hook]


def test_a_module_site_is_edited_in_a_trace_run_inside_an_except_block():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    try:
        raise KeyError("handled before the trace")
    except KeyError:
        log = tl.trace(model, x, intervene={"0": tl.zero_ablate()}, stop_after="1")
    assert [i.label for i in log.interventions] == ["linear_1_1:1"] and log.stopped_after == "1:1"


def test_a_pruning_mask_as_a_site_is_refused_naming_the_ops_that_read_it():
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    mask = tl.trace(model, x)["buffer_1:1"]
    assert mask.io_path == "0.weight_mask"
    with pytest.raises(KeyError, match=rf"buffer buffer_1:1, which no op .*read it \({mask.children[0]}\)"):
        tl.trace(model, x, intervene={"buffer_1:1": tl.zero_ablate()})
    masked = tl.trace(model, x, intervene={"mul_1_2:1": tl.zero_ablate()})  # the pruned weight, masked
    assert torch.equal(masked.output, model[1](model[0].bias.expand(2, 4)))
    with pytest.raises(KeyError, match=r"output output_1:1: name the op that produces it \(relu_1_4:1\)"):
        tl.trace(model, x, intervene={"output_1:1": tl.zero_ablate()})


class Halved(nn.Module):
    """A parametrization with a right inverse: assigning the weight stores half of it in the original."""

    def forward(self, weight):
        return weight * 2

    def right_inverse(self, weight):
        return weight / 2


class ClippedInForward(nn.Module):
    """Clips its parametrized weight at each forward by assigning it, which ``set_``s the original, a call
    that reaches no ``__torch_function__``."""

    def __init__(self):
        super().__init__()
        import torch.nn.utils.parametrize as parametrize

        self.fc = nn.Linear(4, 4)
        parametrize.register_parametrization(self.fc, "weight", Halved())

    def forward(self, x):
        with torch.no_grad():
            self.fc.weight = self.fc.weight.clamp(-0.3, 0.3)
        return self.fc(x)


@pytest.mark.parametrize("compiled", PATHS)
def test_ops_reading_a_parameter_set_during_the_forward_are_not_replayed_saying_why(compiled):
    torch.manual_seed(0)
    model, x = ClippedInForward(), torch.randn(2, 4)
    with on_path(compiled):
        log = tl.trace(model, x)
    result = log.validate()
    assert_trusted(result)
    unseen = [label for label, reason in result.not_replayed if "capture cannot see (Tensor.set_" in reason]
    assert unseen == ["mul_1_1:1", "mul_1_1:2"]  # the weight computed from the original, before and after
    assert result.replayed >= 3  # the clamp, the right inverse and the linear still replay


def _offload(module):
    """Keeps ``module``'s parameters on the meta device between calls and registers a loaded copy in place of
    each only while it runs, as accelerate's offloading hooks (``cpu_offload``, ``disk_offload``) do."""
    stored = {name: p.detach().clone() for name, p in module._parameters.items()}

    def load(module, args):
        for name, value in stored.items():
            module._parameters[name] = nn.Parameter(value.clone())

    def unload(module, args, output):
        for name in stored:
            module._parameters[name] = nn.Parameter(module._parameters[name].detach().to("meta"))

    unload(module, None, None)
    module.register_forward_pre_hook(load)
    module.register_forward_hook(unload)


@pytest.mark.parametrize("compiled", PATHS)
def test_weights_loaded_for_each_call_in_place_of_meta_parameters_are_named_by_their_address(compiled):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2)), torch.randn(2, 4)
    expected = model(x)
    for module in model:
        _offload(module)
    with on_path(compiled):
        log = tl.trace(model, x)
    assert torch.equal(log.output, expected)
    assert log["0"].params == ("0.weight", "0.bias") and log["2"].params == ("2.weight", "2.bias")
    users = {p.address: p.op_labels for p in log.params}
    assert log["0"].label in users["0.weight"] and log["2"].label in users["2.bias"]  # and the hook's detach
    # a norm's weight and bias are alike (shape, dtype): which copy stood for which cannot be told, so neither
    # is named as either
    assert log["1"].params == ("<unregistered parameter (3,)>",) * 2 and users["1.weight"] == []
