"""The real-model corpus: standard architectures at tiny sizes, with random weights.

Each entry builds ``(model, args, kwargs)``: ``transformers`` models from small configs (no download,
no pretrained weights, ``HF_HUB_OFFLINE`` set; the vision entries are built in ``real_models_vision``, the
time-series ones in ``real_models_series``) and
the recurrent and transformer layers of ``torch.nn`` (built in ``real_models_nn``).  Sizes are tiny (hidden
32, one or two layers, sequences of 8, images of 32 pixels) so the whole corpus traces and validates in
seconds.  Builders import ``transformers`` lazily:
the ``torch.nn`` entries work without it.

Dropout is left at each config's default except where noted, so train mode covers both active dropout
(GPT-2, BERT, T5, BART, DETR, Llama's attention, Swin's and DINOv2's stochastic depth, BigBird, the
``torch.nn`` entries) and dropout with ``p=0`` (Whisper, ViT, Mistral, Qwen2), which draws nothing and is
deterministic.
wav2vec2 in train mode also draws its SpecAugment masks from NumPy's global generator: ``seed(n)`` seeds
torch's, NumPy's and Python's generators, and every run the tests compare starts from it.

``build(name)`` is cached, so tests and ``scripts/validate_corpus.py`` share one model per entry;
``in_mode(model, mode)`` sets one of ``MODES`` up around a run, and callers seed the RNG before each run.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random

import numpy
import torch
import torch.nn as nn

from real_models_nn import HIDDEN, SEQ, gru, lstm, transformer_encoder, transformer_encoder_padded
from real_models_series import time_series_transformer, timesfm
from real_models_vision import (IMAGE, _image, beit, convnext, deformable_detr, detr, dinov2, focalnet, hiera,
                                mobilevit, regnet, resnet, segformer, swin, vit)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing here may reach the network

VOCAB = 99


def _tokens(batch=2, seq=SEQ, vocab=VOCAB):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _attention_mask(batch=2, seq=SEQ):
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, -3:] = 0  # the second sequence is padded: masking paths run, not just the all-ones shortcut
    return mask


_DECODER = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)


# One encoder and one decoder layer, for the BART-style encoder-decoders.
_SEQ2SEQ = dict(d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
                max_position_embeddings=64)


def _seq2seq_inputs():
    return {"input_ids": _tokens(), "attention_mask": _attention_mask(), "decoder_input_ids": _tokens(seq=5)}


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=HIDDEN, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    return GPT2LMHeadModel(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def small_gpt2_lm():
    """A GPT-2 language model for token ids below 64 (the intervention and cache tests' own, apart from the
    corpus), seeded, in eval mode."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def cache_steps(name):
    """``(model, prefix kwargs, next-step kwargs without the cache, the cache's keyword)`` for a corpus
    entry that keeps a key/value cache: the prefix fills the cache, the step decodes one token more
    (an encoder-decoder reads its whole input both times).  Seeded, in eval mode."""
    torch.manual_seed(0)
    model, _, kwargs = CORPUS[name]()
    kwargs = {k: v for k, v in kwargs.items() if k not in ("attention_mask", "labels")}
    key = "cache_params" if name == "mamba" else "past_key_values"
    if "decoder_input_ids" in kwargs or name == "t5":
        decoder = kwargs.pop("decoder_input_ids", _tokens(seq=4))
        prefix = {**kwargs, "decoder_input_ids": decoder[:, :-1]}
        return model.eval(), prefix, {**kwargs, "decoder_input_ids": decoder[:, -1:]}, key
    ids = kwargs["input_ids"]
    step = {"input_ids": ids[:, -1:]}
    if name == "mamba":
        step["cache_position"] = torch.tensor([ids.shape[1] - 1])
    return model.eval(), {"input_ids": ids[:, :-1]}, step, key


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        vocab_size=VOCAB, max_position_embeddings=64)
    return BertForSequenceClassification(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    # Attention dropout on: train mode draws inside SDPA (dropout_p > 0) with grouped-query attention.
    config = LlamaConfig(**_DECODER, attention_dropout=0.1)
    return LlamaForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_DECODER, sliding_window=4)), (), {"input_ids": _tokens()}


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_DECODER)), (), {"input_ids": _tokens(),
                                                            "attention_mask": _attention_mask()}


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                      vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0)
    kwargs = {"input_ids": _tokens(), "attention_mask": _attention_mask(), "labels": _tokens(seq=5)}
    return T5ForConditionalGeneration(config), (), kwargs


def bart():
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(**_SEQ2SEQ)), (), _seq2seq_inputs()


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
                           num_mel_bins=16, max_source_positions=16, max_target_positions=16,
                           decoder_start_token_id=1, pad_token_id=0)
    features = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))  # 32 frames -> 16 positions
    return WhisperForConditionalGeneration(config), (), {"input_features": features,
                                                         "decoder_input_ids": _tokens(seq=5)}


def wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    # In train mode its SpecAugment masks time steps drawn from NumPy's global generator (and from torch's
    # for feature masks): the entry that checks every extra run restores the host generators too.
    config = Wav2Vec2Config(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                            vocab_size=VOCAB, conv_dim=(8, 8), conv_kernel=(10, 3), conv_stride=(5, 2),
                            num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, mask_time_prob=0.5,
                            mask_time_length=2, mask_feature_prob=0.5, mask_feature_length=2)
    audio = torch.randn(2, 400, generator=torch.Generator().manual_seed(5))  # 400 samples -> 39 frames
    return Wav2Vec2ForCTC(config), (), {"input_values": audio}


def clip():
    from transformers import CLIPConfig, CLIPModel

    text = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=SEQ)
    vision = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  image_size=IMAGE, patch_size=8)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    kwargs = {"input_ids": _tokens(), "attention_mask": _attention_mask(), "pixel_values": _image()}
    return CLIPModel(config), (), kwargs


def mamba():
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(hidden_size=HIDDEN, state_size=8, num_hidden_layers=2, vocab_size=VOCAB, expand=2,
                         conv_kernel=4)
    return MambaForCausalLM(config), (), {"input_ids": _tokens()}


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    # A mixture of experts: each token is routed to 2 of 4 experts (topk, one_hot, index_add_ in the forward).
    config = MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(config), (), {"input_ids": _tokens()}


def deberta_v2():
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    # Disentangled relative-position attention (content-to-position and position-to-content terms).
    config = DebertaV2Config(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                             vocab_size=VOCAB, max_position_embeddings=64, relative_attention=True,
                             pos_att_type=["p2c", "c2p"], max_relative_positions=16)
    return DebertaV2ForSequenceClassification(config), (), {"input_ids": _tokens(),
                                                            "attention_mask": _attention_mask()}


def albert():
    from transformers import AlbertConfig, AlbertForMaskedLM

    # One layer's weights shared by both layers: each shared module is called twice (recurrence).
    config = AlbertConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          vocab_size=VOCAB, embedding_size=16, max_position_embeddings=64)
    return AlbertForMaskedLM(config), (), {"input_ids": _tokens()}


def rwkv():
    from transformers import RwkvConfig, RwkvForCausalLM

    # A linear-attention recurrence written as a Python loop over time steps (the CPU path).
    config = RwkvConfig(hidden_size=HIDDEN, num_hidden_layers=2, vocab_size=VOCAB, attention_hidden_size=HIDDEN,
                        intermediate_size=64, context_length=16)
    return RwkvForCausalLM(config), (), {"input_ids": _tokens()}


def gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    # Attention and MLP in parallel off one residual, rotary embeddings on part of each head.
    config = GPTNeoXConfig(**_DECODER, rotary_pct=0.5, attention_dropout=0.1, hidden_dropout=0.1)
    return GPTNeoXForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def opt():
    from transformers import OPTConfig, OPTForCausalLM

    # Learned positions offset by two, computed from the attention mask's cumulative sum.
    config = OPTConfig(hidden_size=HIDDEN, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                       max_position_embeddings=64, word_embed_proj_dim=HIDDEN)
    return OPTForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def bloom():
    from transformers import BloomConfig, BloomForCausalLM

    # ALiBi: a bias per head added to the scores with baddbmm, no position embeddings.
    config = BloomConfig(hidden_size=HIDDEN, n_layer=2, n_head=4, vocab_size=VOCAB, attention_dropout=0.1)
    return BloomForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def falcon():
    from transformers import FalconConfig, FalconForCausalLM

    # Multi-query attention (one key/value head) run in parallel with the MLP.
    config = FalconConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                          multi_query=True, parallel_attn=True)
    return FalconForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def phi():
    from transformers import PhiConfig, PhiForCausalLM

    return PhiForCausalLM(PhiConfig(**_DECODER, partial_rotary_factor=0.5)), (), {"input_ids": _tokens()}


def gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    # GeGLU feed-forward, RMSNorm scaled by (1 + weight), embeddings scaled by sqrt(hidden).
    return GemmaForCausalLM(GemmaConfig(**_DECODER, head_dim=8)), (), {"input_ids": _tokens(),
                                                                         "attention_mask": _attention_mask()}


def gptj():
    from transformers import GPTJConfig, GPTJForCausalLM

    # Rotary embeddings applied to interleaved pairs of channels.
    config = GPTJConfig(n_embd=HIDDEN, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, rotary_dim=4,
                        bos_token_id=0, eos_token_id=0)
    return GPTJForCausalLM(config), (), {"input_ids": _tokens()}


def roberta():
    from transformers import RobertaConfig, RobertaForMaskedLM

    # Position ids from the padding: a cumulative sum over the non-padding tokens.
    config = RobertaConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           vocab_size=VOCAB, max_position_embeddings=64)
    return RobertaForMaskedLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def mobilebert():
    from transformers import MobileBertConfig, MobileBertForSequenceClassification

    # Bottlenecks around each layer, stacked feed-forwards, and its elementwise NoNorm.
    config = MobileBertConfig(hidden_size=HIDDEN, embedding_size=16, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, vocab_size=VOCAB, true_hidden_size=16, intra_bottleneck_size=16,
                              num_feedforward_networks=2)
    return MobileBertForSequenceClassification(config), (), {"input_ids": _tokens(),
                                                             "attention_mask": _attention_mask()}


def xlnet():
    from transformers import XLNetConfig, XLNetLMHeadModel

    # Relative attention written with einsum, and relative-position shifts by reshaping.
    config = XLNetConfig(d_model=HIDDEN, n_layer=2, n_head=4, d_inner=64, vocab_size=VOCAB)
    return XLNetLMHeadModel(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def funnel():
    from transformers import FunnelConfig, FunnelForSequenceClassification

    # The sequence is pooled to half its length between blocks, then upsampled back by repetition.
    config = FunnelConfig(d_model=HIDDEN, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1], vocab_size=VOCAB)
    return FunnelForSequenceClassification(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def convbert():
    from transformers import ConvBertConfig, ConvBertForSequenceClassification

    # Span-based dynamic convolution beside self-attention (unfold over the sequence).
    config = ConvBertConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                            vocab_size=VOCAB, embedding_size=HIDDEN, max_position_embeddings=64)
    return ConvBertForSequenceClassification(config), (), {"input_ids": _tokens(),
                                                           "attention_mask": _attention_mask()}


def longformer():
    from transformers import LongformerConfig, LongformerForSequenceClassification

    # Sliding-window attention computed on overlapping chunks (as_strided views), global attention on one token.
    config = LongformerConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              vocab_size=VOCAB, max_position_embeddings=64, attention_window=4)
    mask = torch.ones(2, 2 * SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    return LongformerForSequenceClassification(config), (), {"input_ids": _tokens(seq=2 * SEQ), "attention_mask": mask}


def pegasus():
    from transformers import PegasusConfig, PegasusForConditionalGeneration

    # Sinusoidal positions, pre-norm encoder and decoder.
    return PegasusForConditionalGeneration(PegasusConfig(**_SEQ2SEQ)), (), _seq2seq_inputs()


def bigbird():
    from transformers import BigBirdConfig, BigBirdForSequenceClassification

    # Block-sparse attention (sequence 32 in blocks of 2): gathers of random key blocks, and an in-place
    # ``unsqueeze_`` on a matmul's output, whose gradient has the unsqueezed shape.
    config = BigBirdConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           vocab_size=VOCAB, max_position_embeddings=64, attention_type="block_sparse", block_size=2,
                           num_random_blocks=2)
    return BigBirdForSequenceClassification(config), (), {"input_ids": _tokens(seq=32)}


def mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM

    # The state-space duality scan in chunks of 4 (the PyTorch path: segment sums, cumsum, exp, einsum).
    config = Mamba2Config(hidden_size=HIDDEN, state_size=8, num_hidden_layers=2, vocab_size=VOCAB, expand=2,
                          conv_kernel=4, num_heads=8, head_dim=8, n_groups=1, chunk_size=4)
    return Mamba2ForCausalLM(config), (), {"input_ids": _tokens()}


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # Experts stored as one 3-D weight and run with torch._grouped_mm over the tokens sorted by expert.
    config = Qwen3MoeConfig(**_DECODER, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return Qwen3MoeForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # Multi-head latent attention (low-rank query and key/value projections, a rotary part split off each head),
    # a dense first layer, then routed experts chosen within groups beside a shared expert.
    config = DeepseekV3Config(**{**_DECODER, "num_key_value_heads": 4}, n_routed_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                              q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=2,
                              topk_group=1)
    return DeepseekV3ForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # Sliding-window and global layers with their own rotary bases, query/key norms, tied embeddings.
    config = Gemma3TextConfig(**_DECODER, head_dim=8, sliding_window=4)
    return Gemma3ForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def modernbert():
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    # Local (window 4) and global attention layers alternating, GLU feed-forwards, no biases.
    config = ModernBertConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              vocab_size=VOCAB, max_position_embeddings=64, global_attn_every_n_layers=2,
                              local_attention=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                              sep_token_id=2)
    return ModernBertForMaskedLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def siglip():
    from transformers import SiglipConfig, SiglipModel

    # Text and vision towers scored by a sigmoid (a learnt scale and bias), the vision side pooled by attention.
    text = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=SEQ)
    vision = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  image_size=IMAGE, patch_size=8)
    config = SiglipConfig(text_config=text, vision_config=vision)
    return SiglipModel(config), (), {"input_ids": _tokens(), "pixel_values": _image()}


def llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    # A vision-language model: CLIP patch features projected and scattered into the token embeddings at the
    # 16 image-token positions (masked_scatter), then a Llama decoder.
    vision = CLIPVisionConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=IMAGE, patch_size=8)
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_DECODER), image_token_index=VOCAB - 1,
                         vision_feature_layer=-1, projector_hidden_act="gelu", image_seq_length=16)
    ids = _tokens(seq=20) % (VOCAB - 1)
    ids[:, 2:18] = VOCAB - 1
    return LlavaForConditionalGeneration(config), (), {"input_ids": ids, "pixel_values": _image()}

def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # Eager attention with its scores soft-capped by tanh, sliding-window and global layers, capped final logits.
    config = Gemma2Config(**_DECODER, head_dim=8, sliding_window=4, attn_logit_softcapping=50.0,
                          final_logit_softcapping=30.0, attention_dropout=0.1)
    return Gemma2ForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def jamba():
    from transformers import JambaConfig, JambaForCausalLM

    # A Mamba layer (the selective scan as a Python loop over time) then an attention layer with routed experts.
    config = JambaConfig(**_DECODER, num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1,
                         attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                         mamba_dt_rank=4, use_mamba_kernels=False)
    return JambaForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # Gated delta-rule linear attention in chunks beside gated full attention; experts with a gated shared expert.
    config = Qwen3NextConfig(**_DECODER, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, linear_num_value_heads=4, linear_num_key_heads=2,
                             linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                             layer_types=["linear_attention", "full_attention"])
    return Qwen3NextForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def perceiver():
    from transformers import PerceiverConfig, PerceiverForMaskedLM

    # Cross-attention from the inputs into a fixed set of learned latents, self-attention among the latents, and
    # a decoder whose queries are position embeddings cross-attending back to them.
    config = PerceiverConfig(num_latents=8, d_latents=HIDDEN, d_model=HIDDEN, num_blocks=1,
                             num_self_attends_per_block=1, num_self_attention_heads=4, num_cross_attention_heads=4,
                             vocab_size=VOCAB, max_position_embeddings=SEQ)
    return PerceiverForMaskedLM(config), (), {"inputs": _tokens(), "attention_mask": _attention_mask()}


def led():
    from transformers import LEDConfig, LEDForConditionalGeneration

    # Longformer's windowed encoder attention (global attention padded in, chunked as_strided views) under a BART
    # decoder.
    config = LEDConfig(**_SEQ2SEQ, attention_window=4, max_encoder_position_embeddings=64,
                       max_decoder_position_embeddings=64)
    return LEDForConditionalGeneration(config), (), _seq2seq_inputs()


def recurrent_gemma():
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    # A real-gated linear recurrence (the RG-LRU, a scan over time) beside local sliding-window attention, and
    # logits soft-capped after the head.
    config = RecurrentGemmaConfig(**_DECODER, lru_width=HIDDEN, attention_window_size=4, head_dim=8,
                                  block_types=["recurrent", "attention"])
    return RecurrentGemmaForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def canine():
    from transformers import CanineConfig, CanineModel

    # Characters hashed into several embedding buckets, a local transformer, a strided convolution that
    # downsamples, and an upsampling that repeats the molecules back to characters.
    config = CanineConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          max_position_embeddings=64, downsampling_rate=4, local_transformer_stride=4,
                          num_hash_buckets=64, num_hash_functions=2)
    return CanineModel(config), (), {"input_ids": _tokens(vocab=1000), "attention_mask": _attention_mask()}


def gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    # Attention with a learnt sink logit per head, sliding-window and full layers, clamped SwiGLU experts.
    config = GptOssConfig(**_DECODER, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                          layer_types=["sliding_attention", "full_attention"])
    return GptOssForCausalLM(config), (), {"input_ids": _tokens(), "attention_mask": _attention_mask()}


def prophetnet():
    from transformers import ProphetNetConfig, ProphetNetForConditionalGeneration

    # A main stream and two predicting streams in the decoder, with bucketed relative positions.
    config = ProphetNetConfig(hidden_size=HIDDEN, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=1,
                              num_decoder_layers=1, num_encoder_attention_heads=4, num_decoder_attention_heads=4,
                              vocab_size=VOCAB, max_position_embeddings=64, ngram=2, num_buckets=8,
                              relative_max_distance=16)
    return ProphetNetForConditionalGeneration(config), (), _seq2seq_inputs()


def nllb_moe():
    from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration

    # Top-2 experts with a capacity per expert in both the encoder and the decoder.
    config = NllbMoeConfig(**_SEQ2SEQ, num_experts=4, expert_capacity=8, sparse_step=1)
    return NllbMoeForConditionalGeneration(config), (), _seq2seq_inputs()


TRANSFORMERS = {f.__name__: f for f in (
    gpt2, bert, llama, mistral, qwen2, t5, bart, whisper, wav2vec2, vit, swin, convnext, resnet, detr, clip, mamba,
    mixtral, deberta_v2, albert, rwkv, gpt_neox, opt, bloom, falcon, phi, gemma, gptj, roberta, mobilebert, xlnet,
    funnel, convbert, longformer, pegasus, segformer, mobilevit, regnet, bigbird, mamba2, qwen3_moe, deepseek_v3,
    gemma3, modernbert, dinov2, siglip, llava, gemma2, jamba, qwen3_next, deformable_detr, perceiver, led,
    recurrent_gemma, canine, gpt_oss, prophetnet, nllb_moe, hiera, focalnet, time_series_transformer, timesfm)}
TORCH_NN = {f.__name__: f for f in (lstm, gru, transformer_encoder, transformer_encoder_padded)}
CORPUS = {**TRANSFORMERS, **TORCH_NN}


@functools.lru_cache(maxsize=None)
def build(name):
    """``(model, args, kwargs)`` for corpus entry ``name``, built once per process with seed 0."""
    torch.manual_seed(0)
    model, args, kwargs = CORPUS[name]()
    if hasattr(model, "config"):
        model.config.use_cache = False  # a KV cache object in the output is not what the corpus tests
    return model, args, kwargs


# eval with gradients on (the LSTM/GRU and attention paths that pick kernels by requires_grad), eval under
# no_grad (the standard inference path: the fast MHA path and nested tensors), and train (dropout active).
MODES = ("eval", "eval_no_grad", "train")


def seed(value: int) -> None:
    """Seed every generator a corpus forward draws from: torch's, and NumPy's and Python's (wav2vec2)."""
    numpy.random.seed(value)
    random.seed(value)
    torch.manual_seed(value)


@contextlib.contextmanager
def in_mode(model, mode):
    """Put ``model`` in ``mode`` (one of ``MODES``) for the duration of the block."""
    model.train(mode == "train")
    grad = torch.no_grad() if mode == "eval_no_grad" else torch.enable_grad()
    try:
        with grad:
            yield
    finally:
        model.eval()
