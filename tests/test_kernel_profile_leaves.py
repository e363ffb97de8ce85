"""kernel_profile's own backward leaves every ``.grad`` it reaches as it was: the parameters' (in
tests/test_kernel_profile.py), and those of the other tensors the forward read that require grad, which an
optimizer may hold just as well (a learnt prompt given as the input, a steering vector the forward adds)."""

import pytest
import torch

import torchlens as tl


@pytest.fixture(scope="module")
def llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    return transformers.LlamaForCausalLM(config).eval()


def _prompted(model):
    """Prompt tuning: learnt embeddings put before the tokens' own, and a steering vector added to them."""
    tokens = model.get_input_embeddings()(torch.tensor([[3, 5, 7]])).detach()
    steering = torch.randn(16, requires_grad=True)

    def run(prompt):
        return model(inputs_embeds=torch.cat([prompt, tokens], 1) + steering).logits

    return run, steering


@pytest.mark.parametrize("backward", [True, lambda logits: logits.logsumexp(-1).mean().backward()],
                         ids=["all ones", "own loss"])
def test_a_profiled_backward_leaves_a_learnt_prompts_grad_as_it_was(llama, backward):
    run, steering = _prompted(llama)
    prompt = torch.randn(1, 4, 16, requires_grad=True)
    run(prompt).sum().backward()  # a training step's gradients, which the next optimizer step reads
    kept = {"prompt": prompt.grad, "steering": steering.grad}
    values = {name: g.clone() for name, g in kept.items()}
    kp = tl.report.kernel_profile(run, prompt, backward=backward)
    assert all(r["bwd_aten_ops"] > 0 for r in kp.ops if r["type"] == "linear")  # the backward did run
    assert prompt.grad is kept["prompt"] and torch.equal(prompt.grad, values["prompt"])
    assert steering.grad is kept["steering"] and torch.equal(steering.grad, values["steering"])


def test_a_profiled_backward_leaves_no_grad_where_there_was_none(llama):
    run, steering = _prompted(llama)
    prompt = torch.randn(1, 4, 16, requires_grad=True)
    llama.zero_grad(set_to_none=True)  # the other test's training step filled them
    tl.report.kernel_profile(run, prompt, backward=True)
    assert prompt.grad is None and steering.grad is None
    assert all(p.grad is None for p in llama.parameters())
