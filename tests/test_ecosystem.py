"""Models traced through the Hugging Face libraries users wrap them in: peft's adapters (LoRA, prefix and
prompt tuning, IA3), accelerate's offloading hooks, and diffusers' UNets, schedulers and VAEs.

Each wraps or rewires the model in its own way: peft inserts adapter modules around the layers it targets
(``base_model.model....lora_A.default``) and builds a key/value cache for its virtual tokens; accelerate
replaces each module's ``forward`` and loads its weights from the CPU or disk for the length of a call; a
denoising loop calls one UNet once per step.  The traces must run the model exactly as untraced, name
what ran by the addresses the wrappers give it, replay, and leave every wrapper's hooks where they were.
Each test skips when its library is not installed (they are pinned in the ``dev`` extra).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from accel_paths import PATHS, on_path
from trusted import assert_trusted
from untouched import assert_untouched, snapshot

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing here may reach the network

LAYER0_QKV = "base_model.model.transformer.h.0.attn.c_attn"


def _tokens():
    return torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))


def _gpt2_with_lora():
    """A two-layer GPT-2 with a LoRA adapter on its attention projections, non-zero from the start."""
    transformers, peft = pytest.importorskip("transformers"), pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    lora = peft.LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False,
                           fan_in_fan_out=True)
    return peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora).eval()


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=32, vocab_size=50,
                                      max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


def _lora_calls(log) -> list:
    return [call.label for call in log.module_calls if ".lora_" in call.label]


@pytest.mark.parametrize("compiled", PATHS)
def test_lora_runs_as_untraced_names_its_adapters_and_replays(compiled):
    model, ids = _gpt2_with_lora(), _tokens()
    with torch.no_grad():
        expected = model(ids).logits
    before = snapshot(model, [ids])
    with on_path(compiled):
        log = tl.trace(model, ids)
    assert_untouched(before, snapshot(model, [ids]))
    assert torch.equal(log.output.logits, expected)
    assert _lora_calls(log)[:3] == [f"{LAYER0_QKV}.lora_dropout.default:1", f"{LAYER0_QKV}.lora_A.default:1",
                                    f"{LAYER0_QKV}.lora_B.default:1"]
    assert log[f"{LAYER0_QKV}.lora_B.default"].params == (f"{LAYER0_QKV}.lora_B.default.weight",)
    trainable = {p.address for p in log.params if p.requires_grad}
    assert trainable and all(".lora_" in address for address in trainable)  # peft froze the base model
    assert_trusted(log.validate())


def test_lora_gradients_match_a_plain_backward_and_reach_only_the_adapters():
    model, ids = _gpt2_with_lora(), _tokens()
    seen = {}

    def keep_gradient(module, args, output):  # returns None: the output stays as it was
        output.retain_grad()
        seen["lora_B"] = output

    handle = model.get_submodule(f"{LAYER0_QKV}.lora_B.default").register_forward_hook(keep_gradient)
    model(ids).logits.pow(2).sum().backward()
    handle.remove()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    log = tl.trace(model, ids, grads=True)
    log.output.logits.pow(2).sum().backward()
    got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys() and all(".lora_" in name for name in got)
    assert all(torch.equal(got[name], expected[name]) for name in got)
    assert torch.equal(log[f"{LAYER0_QKV}.lora_B.default"].grad, seen["lora_B"].grad)


def test_an_intervention_at_a_lora_module_or_its_label_edits_what_that_adapter_adds():
    model, ids = _gpt2_with_lora(), _tokens()
    lora_b = model.get_submodule(f"{LAYER0_QKV}.lora_B.default")
    with torch.no_grad():
        saved = lora_b.weight.clone()
        lora_b.weight.zero_()  # the adapter of layer 0 adds zeros: what ablating its output does
        expected = model(ids).logits
        lora_b.weight.copy_(saved)
        untouched = model(ids).logits
    label = tl.trace(model, ids)[f"{LAYER0_QKV}.lora_B.default"].label
    for site in (f"{LAYER0_QKV}.lora_B.default", label):
        edited = tl.trace(model, ids, intervene={site: tl.zero_ablate()})
        assert torch.equal(edited.output.logits, expected), site
    assert not torch.equal(expected, untouched) and torch.equal(lora_b.weight, saved)


def test_switched_disabled_and_merged_adapters_are_traced_as_they_run():
    peft = pytest.importorskip("peft")
    model, ids = _gpt2_with_lora(), _tokens()
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["c_attn"], init_lora_weights=False,
                                                fan_in_fan_out=True))
    model.set_adapter("second")
    with torch.no_grad():
        expected = model(ids).logits
    log = tl.trace(model, ids)
    assert torch.equal(log.output.logits, expected)
    assert f"{LAYER0_QKV}.lora_A.second:1" in _lora_calls(log)
    assert not any(".default" in label for label in _lora_calls(log))
    with model.disable_adapter(), torch.no_grad():
        plain = model(ids).logits
        log = tl.trace(model, ids)
    assert torch.equal(log.output.logits, plain) and _lora_calls(log) == []
    model.base_model.merge_adapter()
    with torch.no_grad():
        merged = model(ids).logits
    log = tl.trace(model, ids)
    assert torch.equal(log.output.logits, merged) and _lora_calls(log) == []
    assert_trusted(log.validate())


@pytest.mark.parametrize("kind", ["prefix", "prompt", "ia3"])
def test_virtual_token_and_ia3_adapters_run_as_untraced_and_their_gradients_match(kind):
    peft = pytest.importorskip("peft")
    config = {"prefix": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
              "prompt": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
              "ia3": lambda: peft.IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "down_proj"],
                                            feedforward_modules=["down_proj"])}[kind]()
    model, ids = peft.get_peft_model(_tiny_llama(), config).eval(), _tokens()
    model(ids).logits.pow(2).sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    log = tl.trace(model, ids, grads=True)
    log.output.logits.pow(2).sum().backward()
    got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys() and all(torch.equal(got[name], expected[name]) for name in got)
    with torch.no_grad():
        assert torch.equal(log.output.logits, model(ids).logits)
    result = log.validate()
    assert_trusted(result)
    # the virtual tokens' indices are a plain tensor peft holds, made before the forward
    assert all("outside the trace" in reason for _, reason in result.not_replayed)


def test_a_lora_trace_saves_and_loads_with_its_adapter_addresses(tmp_path):
    model, ids = _gpt2_with_lora(), _tokens()
    log = tl.trace(model, ids)
    loaded = tl.load(log.save(tmp_path / "lora"))
    site = f"{LAYER0_QKV}.lora_B.default"
    assert [call.label for call in loaded.module_calls] == [call.label for call in log.module_calls]
    assert loaded[site].label == log[site].label and torch.equal(loaded[site].activation, log[site].activation)
    assert torch.equal(loaded.output["logits"], log.output.logits)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 4)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _offloaded(how, tmp_path):
    """A model offloaded by one of accelerate's entry points, and the plain model it was made from."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    plain = _Net().eval()
    device_map = {"a": "cpu", "b": "disk", "c": "cpu"}
    if how == "cpu_offload":
        return accelerate.cpu_offload(copy.deepcopy(plain), execution_device="cpu"), plain
    if how == "disk_offload":
        return accelerate.disk_offload(copy.deepcopy(plain), tmp_path, execution_device="cpu"), plain
    if how == "dispatch_model":
        return accelerate.dispatch_model(copy.deepcopy(plain), device_map=device_map, offload_dir=tmp_path), plain
    torch.save(plain.state_dict(), tmp_path / "weights.bin")
    with accelerate.init_empty_weights():
        empty = _Net()
    return accelerate.load_checkpoint_and_dispatch(empty.eval(), str(tmp_path / "weights.bin"), device_map=device_map,
                                                   offload_folder=str(tmp_path / "offload")), plain


def _hooks_of(model) -> dict:
    """What accelerate installed on each module: its hook, the replaced forward and the original one."""
    return {name: [vars(module).get(key) for key in ("_hf_hook", "forward", "_old_forward")]
            for name, module in model.named_modules()}


@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload", "dispatch_model", "load_checkpoint_and_dispatch"])
def test_offloaded_models_run_as_untraced_and_keep_accelerates_hooks(how, tmp_path):
    model, plain = _offloaded(how, tmp_path)
    x = torch.randn(2, 8)
    hooks = _hooks_of(model)
    log = tl.trace(model, x)
    before = snapshot(model, [x])  # after a first trace: torch imports its compiler lazily during one
    assert torch.equal(log.output, plain(x))
    assert [call.label for call in log.module_calls] == ["a:1", "b:1", "b.0:1", "b.1:1", "c:1"]
    forward = tl.trace(model.forward, x)  # accelerate's replaced forward: a wrapper of the bound one
    assert [call.label for call in forward.module_calls] == [call.label for call in log.module_calls]
    # the weights loaded for each call are named by the offloaded parameter each stands for
    assert log["b.0"].params == ("b.0.weight", "b.0.bias") and log["c"].params == ("c.weight", "c.bias")
    assert log["b.0"].label in next(p for p in log.params if p.address == "b.0.weight").op_labels
    result = log.validate()
    assert_trusted(result)
    assert {reason for _, reason in result.not_replayed} <= {"meta tensors hold no values to compare",
                                                              "a tensor argument came from outside the trace"}
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        tl.trace(model, torch.randn(2, 5))  # raises inside accelerate's replaced forward
    assert all(all(a is b for a, b in zip(hooks[name], now)) for name, now in _hooks_of(model).items())
    assert_untouched(before, snapshot(model, [x]))


def test_a_hook_added_with_add_hook_to_module_runs_inside_its_module_call():
    hooks = pytest.importorskip("accelerate.hooks")

    class Doubled(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return tuple(a * 2 for a in args), kwargs

    torch.manual_seed(0)
    model, x = _Net().eval(), torch.randn(2, 8)
    expected = model.c(model.b(model.a(x) * 2))
    hooks.add_hook_to_module(model.b, Doubled())
    replaced = vars(model.b)["forward"]
    log = tl.trace(model, x, intervene={"b.0": tl.zero_ablate()})
    assert torch.equal(log.output, model.c(torch.zeros(2, 16)))
    log = tl.trace(model, x)
    assert torch.equal(log.output, expected) and vars(model.b)["forward"] is replaced
    b_call = next(call for call in log.module_calls if call.label == "b:1")
    assert b_call.op_labels == ["mul_1_2:1", "linear_2_3:1", "relu_1_4:1"]  # the hook's doubling inside


def _unet():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                 block_out_channels=(8, 16), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                 up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4,
                                 attention_head_dim=4).eval()


def test_a_denoising_loop_traced_as_one_callable_is_one_pass_of_the_unet_per_step():
    diffusers = pytest.importorskip("diffusers")
    unet, x = _unet(), torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    scheduler = diffusers.DDIMScheduler(num_train_timesteps=50)
    scheduler.set_timesteps(2)

    def denoise(sample):
        for t in scheduler.timesteps:
            sample = scheduler.step(unet(sample, t).sample, t, sample).prev_sample
        return sample

    denoise(x).pow(2).sum().backward()
    expected = {name: p.grad.clone() for name, p in unet.named_parameters()}
    unet.zero_grad(set_to_none=True)
    log = tl.trace(denoise, x, root=unet, grads=True)
    log.output.pow(2).sum().backward()
    assert all(torch.equal(p.grad, expected[name]) for name, p in unet.named_parameters())
    with torch.no_grad():
        assert torch.equal(log.output, denoise(x))
    calls = [call.label for call in log.module_calls]
    assert [c for c in calls if c.startswith(("self:", "conv_in:"))] == [
        "self:1", "conv_in:1", "self:2", "conv_in:2"]
    assert [op.label for op in log["conv_in:1"].layer.ops] == [
        log[f"conv_in:{step}"].label for step in (1, 2)]  # each step a pass of the same layer
    assert_trusted(log.validate())
    # zeroing the second step's input convolution is what a hook doing it untraced gives
    steps = iter(range(1, 3))
    handle = unet.conv_in.register_forward_hook(lambda m, a, out: out * 0 if next(steps) == 2 else out)
    with torch.no_grad():
        expected = denoise(x)
    handle.remove()
    edited = tl.trace(denoise, x, root=unet, intervene={"conv_in:2": tl.zero_ablate()})
    assert torch.equal(edited.output, expected)


def test_a_conditional_unet_and_a_sampling_vae_run_as_untraced_and_replay():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=12, norm_num_groups=4, attention_head_dim=4).eval()
    latents, text = torch.randn(1, 4, 8, 8), torch.randn(1, 5, 12)
    log = tl.trace(unet, (latents, 5), {"encoder_hidden_states": text})
    with torch.no_grad():
        assert torch.equal(log.output.sample, unet(latents, 5, encoder_hidden_states=text).sample)
    assert "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k:1" in [c.label for c in log.module_calls]
    assert_trusted(log.validate())
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=2,
        norm_num_groups=4, layers_per_block=1, sample_size=8).eval()
    image = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        expected = vae(image, sample_posterior=True, generator=torch.Generator().manual_seed(0)).sample
    log = tl.trace(vae, (image,), {"sample_posterior": True, "generator": torch.Generator().manual_seed(0)})
    assert torch.equal(log.output.sample, expected)
    result = log.validate()
    assert_trusted(result)
    assert [log[label].type for label, _ in result.not_replayed] == ["randn"]  # the posterior's draw
