"""Real ``transformers`` architectures beyond the corpus of tests/real_models.py, each for what it alone exercises:

- Informer's ProbSparse attention samples keys with ``torch.randint`` in eval mode too (every corpus entry
  draws only in train mode): the trace draws what an untraced run draws, and validate names the draw;
- SEW-D's attention is a custom ``autograd.Function`` (``XSoftmax``) that writes its result in place before
  returning it, and its dropout another (``XDropout``) that draws inside ``forward``: the corpus's DeBERTa-v2
  no longer uses either;
- Switch Transformers' router multiplies its input by jitter noise in place through ``.to(float32)``, which
  returns that same tensor, so in training the write reaches the experts' input;
- LongT5's transient-global attention computes with einsums over ``...``, which the FLOPs registry counts
  as torch computes them.

Tiny configs with random weights, built once per module (``HF_HUB_OFFLINE`` set by real_models, nothing is
downloaded); the tests skip when ``transformers`` is not installed.
"""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
from grad_oracle import _loss
from real_models import VOCAB, _attention_mask, _tokens, seed
from real_models_nn import HIDDEN
from torchlens.tree import structures_equal
from accel_paths import PATHS, on_path

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def longt5():
    """LongT5 with transient-global attention: its block aggregates and attention scores are einsums over
    ``...`` (``...nd,...ng->...gd``, ``...qhd,...khd->...hqk``)."""
    torch.manual_seed(0)
    config = transformers.LongT5Config(d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                                       num_heads=4, vocab_size=VOCAB, local_radius=2, global_block_size=2,
                                       encoder_attention_type="transient-global", decoder_start_token_id=0,
                                       pad_token_id=0)
    model = transformers.LongT5ForConditionalGeneration(config).eval()
    model.config.use_cache = False
    return model, {"input_ids": _tokens(), "attention_mask": _attention_mask(), "decoder_input_ids": _tokens(seq=5)}


@pytest.mark.parametrize("compiled", PATHS)
def test_flops_vs_dispatch_counts_longt5s_einsums_over_ellipses_as_flop_counter_mode_does(longt5, compiled):
    # Einsums over ``...`` had no formula: listed as unknown, their products missing from the torchlens side.
    model, kwargs = longt5
    with on_path(compiled):
        result = tl.report.flops_vs_dispatch(model, (), kwargs)
        log = tl.trace(model, (), kwargs, save="none")
    einsums = [op for op in log.ops if op.func_name == "einsum"]
    assert any("..." in op.args[0] for op in einsums)
    assert all(tl.report.flops.op_flops_by_family(op)["matmul"] > 0 for op in einsums)
    assert result.torchlens_total.complete and result.witness["products_match"] and result.witness["outputs_match"]
    matmul = next(row for row in result.families if row["family"] == "matmul")
    assert matmul["difference"] == 0 and matmul["native"] > 0  # T5's projections have no bias to tell them apart


def _param_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _untraced(model, kwargs):
    """The output, the generator state after it and the parameters' gradients of a run from seed 1."""
    model.zero_grad(set_to_none=True)
    seed(1)
    out = model(**kwargs)
    after = torch.get_rng_state()
    _loss(out).backward()
    return out, after, _param_grads(model)


def _traced(model, kwargs):
    """The same as ``_untraced``, from a trace with gradients, and the trace."""
    model.zero_grad(set_to_none=True)
    seed(1)
    log = tl.trace(model, (), kwargs, grads=True)
    after = torch.get_rng_state()
    log.backward(_loss(log.output))
    return log, after, _param_grads(model)


def _assert_same_run(model, kwargs):
    """A trace with gradients gives the untraced output, draws as much, and leaves the same parameter
    gradients; returns the trace."""
    out, after, grads = _untraced(model, kwargs)
    log, traced_after, traced_grads = _traced(model, kwargs)
    same, why = structures_equal(log.output, out)
    assert same, why
    assert torch.equal(traced_after, after), "the trace drew a different amount from the RNG"
    assert grads and grads.keys() == traced_grads.keys()
    assert [n for n in grads if not torch.equal(grads[n], traced_grads[n])] == []
    return log


def _random_ops(result) -> list:
    return [label for label, reason in result.not_replayed if "random" in reason.lower()]


@pytest.fixture(scope="module")
def informer():
    torch.manual_seed(0)
    config = transformers.InformerConfig(prediction_length=4, context_length=8, lags_sequence=[1, 2], d_model=16,
                                         encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
                                         decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                         num_time_features=1, attention_type="prob", sampling_factor=2, distil=True)
    g = torch.Generator().manual_seed(2)
    past = 8 + 2  # the context and the largest lag
    kwargs = {"past_values": torch.randn(2, past, generator=g),
              "past_time_features": torch.randn(2, past, 1, generator=g), "past_observed_mask": torch.ones(2, past),
              "future_values": torch.randn(2, 4, generator=g),
              "future_time_features": torch.randn(2, 4, 1, generator=g)}
    return transformers.InformerForPrediction(config).eval(), kwargs


def test_informer_samples_keys_in_eval_mode_and_validate_names_each_draw(informer):
    model, kwargs = informer
    log = _assert_same_run(model, kwargs)
    draws = [op.label for op in log.ops if op.func_name == "randint"]
    assert draws
    seed(1)
    result = tl.validate(model, (), kwargs)
    assert result.outputs_match is True and result.mismatched == [], str(result)
    assert set(draws) <= set(_random_ops(result)), str(result)


@pytest.fixture(scope="module")
def sew_d():
    torch.manual_seed(0)
    config = transformers.SEWDConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, vocab_size=VOCAB, conv_dim=(8, 8), conv_kernel=(10, 3),
                                     conv_stride=(5, 2), squeeze_factor=1, num_conv_pos_embeddings=8,
                                     num_conv_pos_embedding_groups=2, max_position_embeddings=64, position_buckets=8,
                                     hidden_dropout=0.1, attention_dropout=0.1, activation_dropout=0.1)
    audio = torch.randn(2, 400, generator=torch.Generator().manual_seed(5))  # 400 samples -> 39 frames
    return transformers.SEWDForCTC(config).train(), {"input_values": audio}


def test_sew_d_custom_functions_trace_with_their_gradients_and_draws(sew_d):
    model, kwargs = sew_d
    log = _assert_same_run(model, kwargs)
    # XSoftmax's output is its in-place masked_fill_, moved to the Function's backward node as apply returns.
    filled = [op for op in log.ops if op.func_name == "masked_fill_" and op.module.endswith("attention.self:1")]
    assert len(filled) == 2 and all(op.requires_grad and op.grad is not None for op in filled)
    seed(1)
    result = tl.validate(model, (), kwargs)
    assert result.outputs_match is True and result.mismatched == [], str(result)
    assert [label for label in _random_ops(result) if label.startswith("bernoulli_")], str(result)


@pytest.fixture(scope="module")
def switch():
    torch.manual_seed(0)
    config = transformers.SwitchTransformersConfig(
        d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=VOCAB,
        num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
        decoder_start_token_id=0, pad_token_id=0, router_jitter_noise=0.01)
    model = transformers.SwitchTransformersForConditionalGeneration(config).train()
    model.config.use_cache = False
    kwargs = {"input_ids": _tokens(), "attention_mask": _attention_mask(), "decoder_input_ids": _tokens(seq=5)}
    return model, kwargs


def test_switch_router_jitter_written_through_an_alias_reaches_the_experts(switch):
    model, kwargs = switch
    log = _assert_same_run(model, kwargs)
    jitter = [op for op in log.ops if op.func_name == "mul_" and ".router:" in op.module]
    assert len(jitter) == 2 and all(op.grad is not None for op in jitter)
    # The experts read the written value: the write's children reach outside the router.
    assert all(any(".router" not in log[child].module for child in op.children) for op in jitter)
    seed(1)
    result = tl.validate(model, (), kwargs)
    assert result.outputs_match is True and result.mismatched == [], str(result)
    # (labels of validate's own trace: the router's Module.to now also converts the gradients)
    assert [label for label in _random_ops(result) if label.startswith("uniform_")], str(result)
