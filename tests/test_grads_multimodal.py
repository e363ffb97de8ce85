"""Gradients and interventions on a multimodal model: Qwen2-VL, whose vision tower merges patches into tokens
scattered into the text embeddings (``masked_scatter``) and whose text model rotates them by a multimodal rope
(``mm_token_type_ids`` picks each token's temporal, height and width positions).  Every op's gradient is the one a
hook on each output gives untraced, and a module site's edit is the one a forward hook makes, gradients included.

A tiny config with random weights, built once for the module (``HF_HUB_OFFLINE``: nothing is downloaded); the
tests skip without ``transformers``.
"""

from __future__ import annotations

import os

import pytest
import torch

import torchlens as tl
from accel_paths import PATHS, on_path
from grad_oracle import Oracle, _assert_bit_identical, _loss, _op_grads

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

_IMAGE_TOKEN = 150


@pytest.fixture(scope="module")
def qwen2_vl():
    torch.manual_seed(0)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=160, max_position_embeddings=128,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, in_channels=3, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, mlp_ratio=2)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=_IMAGE_TOKEN,
                                        video_token_id=151, vision_start_token_id=152)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    # One image of 4 x 4 patches, merged 2 x 2 into the 4 image tokens of the prompt.
    ids = torch.tensor([[1, 2, 152] + [_IMAGE_TOKEN] * 4 + [3, 4, 5]])
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 4]]),
              "mm_token_type_ids": (ids == _IMAGE_TOKEN).long()}
    return model, kwargs


def _param_grads(model) -> dict:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same_grads(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys() and expected
    assert all(torch.equal(got[name], expected[name]) for name in expected)


@pytest.mark.parametrize("compiled", PATHS)
def test_every_op_of_qwen2_vl_has_the_gradient_a_hook_on_its_output_gets(qwen2_vl, compiled):
    model, kwargs = qwen2_vl
    oracle = Oracle("hook")
    with oracle:
        out = model(**kwargs)
    _loss(out).backward()
    expected = _param_grads(model)
    with on_path(compiled):
        log = tl.trace(model, (), kwargs, grads=True)
    log.backward(_loss(log.output))
    _assert_same_grads(_param_grads(model), expected)
    ops, got = _op_grads(log)
    assert any(op.func_name == "masked_scatter" for op in ops)  # the image tokens' way into the text
    _assert_bit_identical(ops, got, oracle.grads())


@pytest.mark.parametrize("compiled", PATHS)
def test_a_module_site_on_qwen2_vl_is_the_edit_a_forward_hook_makes(qwen2_vl, compiled):
    # The merger's output is scattered into the text embeddings: the edit reaches the text model through it.
    model, kwargs = qwen2_vl
    with on_path(compiled):
        log = tl.trace(model, (), kwargs, grads=True, intervene={"model.visual.merger": tl.scale(1.5)})
    log.backward(_loss(log.output))
    got = _param_grads(model)
    edited = log["model.visual.merger"]
    assert torch.equal(edited.activation, 1.5 * edited.original)
    handle = model.model.visual.merger.register_forward_hook(lambda module, args, output: output * 1.5)
    try:
        out = model(**kwargs)
    finally:
        handle.remove()
    _loss(out).backward()
    assert torch.equal(log.output.logits, out.logits)
    _assert_same_grads(got, _param_grads(model))
