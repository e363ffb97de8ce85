"""Everyday interpretability workflows on a transformers GPT-2 built from a small config, each checked against
the same computation done by hand with forward hooks: caching activations over a tokenized dataset, and
patching tokenized clean and corrupted inputs."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from real_models import small_gpt2_lm  # noqa: E402


@pytest.fixture(scope="module")
def gpt2():
    pytest.importorskip("transformers")
    return small_gpt2_lm()


def _hooked_blocks(model, ids, mask):
    """Each block's output from forward hooks on an untraced run."""
    kept = {}
    handles = [block.register_forward_hook(lambda module, args, out, i=i: kept.__setitem__(i, out.detach().clone()))
               for i, block in enumerate(model.transformer.h)]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    return [kept[i] for i in range(len(kept))]


def _hooked_gradients(model, batch):
    """Block 0's output and the gradient of the last position's logit 3 with respect to it, by a forward hook."""
    kept = {}
    handle = model.transformer.h[0].register_forward_hook(lambda module, args, out: kept.setdefault("out", out))
    try:
        logits = model(**batch).logits
    finally:
        handle.remove()
    return kept["out"].detach(), torch.autograd.grad(logits[:, -1, 3].sum(), kept["out"])[0]


def test_extracting_a_block_over_padded_and_unpadded_batches_keeps_each_blocks_output_and_gradient(gpt2, tmp_path):
    # A batch with a padded row makes transformers build an attention mask that an all-ones batch skips, so the
    # block's output is another op (add_8_79 against add_6_58): this was refused as "earlier batches gave ...",
    # for the activation and then for its gradient.
    ids = torch.randint(1, 64, (4, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 3:] = 0
    batches = [{"input_ids": ids[:2], "attention_mask": mask[:2]}, {"input_ids": ids[2:], "attention_mask": mask[2:]}]
    tl.extract(gpt2, batches, ["transformer.h.0", "transformer.h.1:1"], tmp_path / "feats", kwargs_of=dict,
               grads=True, loss_fn=lambda output, batch: output.logits[:, -1, 3].sum(), progress=False)
    features = tl.load_extracted(tmp_path / "feats")
    hooked = [_hooked_gradients(gpt2, batch) for batch in batches]
    assert np.array_equal(features["transformer.h.0"], torch.cat([out for out, _ in hooked]).numpy())
    assert np.array_equal(features["grad:transformer.h.0"], torch.cat([grad for _, grad in hooked]).numpy())
    assert np.array_equal(features["transformer.h.1:1"], _hooked_blocks(gpt2, ids, mask)[1].numpy())


def test_an_op_label_that_names_another_op_in_a_later_batch_is_still_refused(gpt2, tmp_path):
    # Named by its label, the op is the one the first batch gave, and a batch whose forward runs another op there
    # is refused rather than stacked under the same name.
    ids = torch.randint(1, 64, (4, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 3:] = 0
    label = tl.trace(gpt2, (), {"input_ids": ids[:2], "attention_mask": mask[:2]})["transformer.h.0"].label
    batches = [{"input_ids": ids[:2], "attention_mask": mask[:2]}, {"input_ids": ids[2:], "attention_mask": mask[2:]}]
    with pytest.raises((KeyError, ValueError), match="batch 1"):
        tl.extract(gpt2, batches, [label], tmp_path / "feats", kwargs_of=dict, progress=False)


def _logit_diff(output):
    return output.logits[0, -1, 11] - output.logits[0, -1, 12]


@pytest.mark.parametrize("report", ["activation_patching", "attribution_patching"])
def test_tokenized_clean_and_corrupt_inputs_are_answered_with_how_to_give_their_keywords(gpt2, report):
    # tl.trace's note said to pass the batch as kwargs=, which both runs of an experiment share: no way to give
    # two inputs' keyword arguments.
    clean = {"input_ids": torch.tensor([[5, 9, 13, 21]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    corrupt = {**clean, "input_ids": torch.tensor([[5, 40, 13, 21]])}
    with pytest.raises(Exception) as refused:
        getattr(tl.report, report)(gpt2, clean, corrupt, _logit_diff)
    note = refused.value.__notes__[-1]
    assert note.startswith(f"torchlens: {report} takes clean and corrupt as the positional arguments")
    assert "clean['input_ids'] and corrupt['input_ids'], with kwargs={'attention_mask': ...}" in note
    assert (f"{report}(lambda input_ids, attention_mask: model(input_ids=input_ids, attention_mask=attention_mask), "
            "(clean[...], ...), (corrupt[...], ...), metric, root=model)") in note


def test_the_callable_the_note_gives_patches_inputs_whose_masks_differ(gpt2):
    ids = torch.tensor([[5, 9, 13, 21]])
    mask = torch.ones_like(ids)
    corrupt_ids, corrupt_mask = torch.tensor([[5, 40, 13, 21]]), torch.tensor([[0, 1, 1, 1]])
    table = tl.report.activation_patching(
        lambda input_ids, attention_mask: gpt2(input_ids=input_ids, attention_mask=attention_mask),
        (ids, mask), (corrupt_ids, corrupt_mask), _logit_diff, sites=["transformer.h.0"], progress=False, root=gpt2)
    clean_block = _hooked_blocks(gpt2, ids, mask)[0]
    handle = gpt2.transformer.h[0].register_forward_hook(lambda module, args, out: clean_block.clone())
    try:
        with torch.no_grad():
            expected = _logit_diff(gpt2(input_ids=corrupt_ids, attention_mask=corrupt_mask)).item()
    finally:
        handle.remove()
    assert table.metric[0] == pytest.approx(expected, abs=1e-6)
    assert table.metric[0] != pytest.approx(table.attrs["clean"], abs=1e-6)  # the corrupted mask still acts


def test_a_t5_layer_returning_its_position_bias_is_refused_naming_it_not_eager_attention():
    # T5 already runs sdpa; the refusal told its users that attention returning no weights, 'sdpa', would make
    # the layer a site again, while the tensor read inside is the position bias its attention added.
    pytest.importorskip("transformers")
    import transformers

    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=1, num_decoder_layers=1, num_heads=2, d_model=16, d_kv=8, d_ff=32, vocab_size=32,
        decoder_start_token_id=0, pad_token_id=0)).eval()
    ids, decoder_ids = torch.tensor([[5, 9, 13]]), torch.tensor([[0, 3]])
    kwargs = {"decoder_input_ids": decoder_ids}
    with pytest.raises(tl.InterventionError) as refused:
        tl.trace(t5, (ids,), kwargs, intervene={"encoder.block.0.layer.0": tl.scale(0.5)})
    assert "a T5 attention layer, and the blocks around it, return a position bias" in str(refused.value)
    call = next(c for c in tl.trace(t5, (ids,), kwargs).module_calls if c.label == "encoder.block.0.layer.0:1")
    handle = t5.encoder.block[0].layer[0].register_forward_hook(lambda m, i, o: (o[0] * 0.5,) + tuple(o[1:]))
    try:  # with gradients on, as the trace runs: T5's attention takes another kernel without them
        expected = t5(ids, **kwargs).logits
    finally:
        handle.remove()
    edited = tl.trace(t5, (ids,), kwargs, intervene={call.output_ops[0]: tl.scale(0.5)})
    assert torch.equal(edited.output.logits, expected)


def _bert_with_hidden_states() -> tuple:
    """The corpus's BERT in eval mode and its inputs, asking for every layer's hidden state."""
    pytest.importorskip("transformers")
    import real_models

    torch.manual_seed(0)
    model, _, kwargs = real_models.bert()
    return model.eval(), {**kwargs, "output_hidden_states": True}


def _doubled_by_a_hook_added_last(model, kwargs):
    """``model``'s output with layer 0's output doubled by a forward hook registered after the model's first call,
    which installs transformers' hidden-state recording hooks."""
    model(**kwargs)
    handle = model.bert.encoder.layer[0].register_forward_hook(lambda m, i, o: o * 2.0)
    try:
        return model(**kwargs)
    finally:
        handle.remove()


def test_a_bert_layers_hidden_state_recorded_by_its_own_hook_is_the_value_before_a_module_sites_edit():
    # transformers collects BERT's output_hidden_states by forward hooks of its own on each layer, registered before
    # a module site's: hidden_states[1] is layer 0's output before the edit, as a hook registered last leaves it,
    # while a label site at the layer's output op edits the value that hook records.
    model, kwargs = _bert_with_hidden_states()
    expected = _doubled_by_a_hook_added_last(model, kwargs)
    by_module = tl.trace(model, kwargs=kwargs, intervene={"bert.encoder.layer.0": tl.scale(2.0)})
    site = by_module["bert.encoder.layer.0"]
    assert torch.equal(by_module.output.logits, expected.logits)
    assert all(torch.equal(a, b) for a, b in zip(by_module.output.hidden_states, expected.hidden_states))
    assert torch.equal(by_module.output.hidden_states[1], site.original)
    by_label = tl.trace(model, kwargs=kwargs, intervene={site.label: tl.scale(2.0)})
    assert torch.equal(by_label.output.hidden_states[1], site.activation)
    assert torch.equal(by_label.output.logits, expected.logits)


def test_a_module_sites_edit_follows_the_hooks_a_models_first_call_installs():
    # transformers installs its hidden-state recording hooks during a model's first call, after a module site's edit
    # hook was registered: traced first, the edit ran before the recording hook and hidden_states[1] was the edited
    # value, while every later trace of the same call recorded the value before the edit.
    import copy

    model, kwargs = _bert_with_hidden_states()
    # The same weights, called first: its first call installs the recording hooks.
    expected = _doubled_by_a_hook_added_last(copy.deepcopy(model), kwargs)
    for _ in range(2):  # the first trace is the model's first call
        edited = tl.trace(model, kwargs=kwargs, intervene={"bert.encoder.layer.0": tl.scale(2.0)})
        assert torch.equal(edited.output.logits, expected.logits)
        assert all(torch.equal(a, b) for a, b in zip(edited.output.hidden_states, expected.hidden_states))
