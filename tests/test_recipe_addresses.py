"""The addresses an interpretability recipe types, on transformers models from small configs: a wrong guess is
answered with the address meant.  A module address written from inside the model (``h.1``, as the
block's own code and other libraries name it, for ``transformer.h.1`` of a ``GPT2LMHeadModel``) is the usual
first guess, and every lookup that takes addresses names the full one."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from real_models import build  # noqa: E402


@pytest.fixture(scope="module")
def models():
    pytest.importorskip("transformers")
    built = {}
    for name in ("gpt2", "llama"):
        model, args, kwargs = build(name)
        built[name] = model.eval(), (args[0] if args else kwargs["input_ids"])
    return built


@pytest.mark.parametrize("name, guess, meant", [
    ("gpt2", "h.1", "transformer.h.1"), ("gpt2", "h.1:1", "transformer.h.1:1"), ("gpt2", "mlp", "transformer.h.0.mlp"),
    ("llama", "mlp", "model.layers.0.mlp"), ("llama", "o_proj", "model.layers.0.self_attn.o_proj")])
def test_an_address_written_from_inside_the_model_is_answered_with_the_full_address(models, name, guess, meant):
    model, ids = models[name]
    log = tl.trace(model, ids)
    hint = rf"closest: [^;]*\b{meant}\b"
    with pytest.raises(KeyError, match=hint):
        log[guess]
    with pytest.raises(KeyError, match=hint):
        tl.trace(model, ids, intervene={guess: tl.zero_ablate()})
    with pytest.raises(KeyError, match=hint):
        tl.trace(model, ids, save=[guess])
    with pytest.raises(KeyError, match=hint):
        tl.trace(model, ids, grads=[guess])


def test_a_container_selected_for_gradients_or_extraction_is_named_as_a_container(models, tmp_path):
    """``model.layers`` (an ``nn.ModuleList``) is never called, so it has no output; the refusal says so and names
    the blocks, rather than blaming a forward called as ``module.forward(...)``, which its blocks' ops suggest."""
    model, ids = models["llama"]
    container = r"'model.layers' is a ModuleList, a container .* never called.*\(model.layers.0, model.layers.1\)"
    for option in ("save", "grads"):
        with pytest.raises(tl.UnmatchedSelection, match=container) as refused:
            tl.trace(model, ids, **{option: ["model.layers"]})
        assert "module.forward" not in str(refused.value)
    with pytest.raises(tl.UnmatchedSelection, match=container):
        tl.extract(model, [ids], ["model.layers"], tmp_path / "features", progress=False)


def test_an_attention_module_returning_its_weights_is_refused_naming_them_and_the_outputs_to_use():
    """Eager attention returns ``(output, weights)`` and its own matmul read the weights, so the module is no site
    (the record could not say which value that read saw).  The refusal names the tensor read inside and where
    the call's outputs are listed; the first of them, used as the site, is what a forward hook editing
    ``output[0]`` gives."""
    pytest.importorskip("transformers")
    import real_models

    torch.manual_seed(0)
    model, _, kwargs = real_models.gpt2()
    model.eval().config._attn_implementation = "eager"
    ids = kwargs["input_ids"]
    with pytest.raises(tl.InterventionError, match=r"transformer.h.1.attn:1 read the tensor it returns at output\.1 "
                                                   r"\(of shape \(2, 4, 8, 8\).*module_calls entry labelled "
                                                   r"'transformer.h.1.attn:1' lists them in return order"):
        tl.trace(model, ids, intervene={"transformer.h.1.attn": tl.scale(0.5)})
    plain = tl.trace(model, ids)
    call = next(call for call in plain.module_calls if call.label == "transformer.h.1.attn:1")
    handle = model.transformer.h[1].attn.register_forward_hook(lambda m, i, o: (o[0] * 0.5,) + tuple(o[1:]))
    try:
        with torch.no_grad():
            expected = model(ids).logits
    finally:
        handle.remove()
    edited = tl.trace(model, ids, intervene={call.output_ops[0]: tl.scale(0.5)})
    assert torch.equal(edited.output.logits, expected)


@pytest.mark.parametrize("name, attention", [("gpt2", "transformer.h.1.attn"), ("llama", "model.layers.1.self_attn")])
def test_an_attention_module_address_names_its_output_not_the_weights_it_also_returns(name, attention):
    """Eager attention returns ``(output, weights)``: ``log[address]`` is the output, what a forward hook reads as
    ``output[0]`` (the attention output of every reading recipe), never the attention weights returned after it."""
    pytest.importorskip("transformers")
    import real_models

    torch.manual_seed(0)
    model, _, kwargs = getattr(real_models, name)()
    model.eval().config._attn_implementation = "eager"
    ids = kwargs["input_ids"]
    module = model.get_submodule(attention)
    seen = []
    handle = module.register_forward_hook(lambda m, i, o: seen.append(o[0].detach().clone()))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    log = tl.trace(model, ids)
    assert torch.equal(log[attention].activation, seen[0])
    assert torch.equal(log[f"{attention}:1"].activation, seen[0])


def test_an_unknown_site_is_never_answered_with_a_call_of_a_container(models):
    """``transformer.h[1]`` is answered with the blocks and their calls, not with ``transformer.h:1``, a call of
    the ``ModuleList`` that never happens (following that suggestion is refused in turn)."""
    model, ids = models["gpt2"]
    with pytest.raises(KeyError, match=r"closest: .*transformer\.h\.1") as refused:
        tl.trace(model, ids, intervene={"transformer.h[1]": tl.zero_ablate()})
    assert "transformer.h:1" not in str(refused.value)
