"""The vision entries of the real-model corpus (tests/real_models.py): image classifiers, detectors and
segmenters from small configs with random weights, on images of ``IMAGE`` pixels.  Builders import
``transformers`` lazily."""

from __future__ import annotations

import torch

from real_models_nn import HIDDEN

IMAGE = 32


def _image(batch=2, size=IMAGE, channels=3):
    return torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(2))


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       image_size=IMAGE, patch_size=8, num_labels=3)
    return ViTForImageClassification(config), (_image(),), {}


def swin():
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                        window_size=4, num_labels=3)
    return SwinForImageClassification(config), (_image(),), {}


def convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3)
    return ConvNextForImageClassification(config), (_image(),), {}


def resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                          num_labels=3)
    return ResNetForImageClassification(config), (_image(),), {}


def detr():
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig

    # A transformers ResNet backbone from its config: no timm, no pretrained download.
    backbone = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                            out_features=["stage2"])
    config = DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone,
                        d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=5,
                        num_labels=3)
    return DetrForObjectDetection(config), (), {"pixel_values": _image(size=64)}


def segformer():
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    # Overlapping patch embeddings, attention over spatially reduced keys, depthwise convolutions in the MLP.
    config = SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                             num_attention_heads=[1, 2], decoder_hidden_size=32, patch_sizes=[7, 3], strides=[4, 2],
                             mlp_ratios=[2, 2], num_labels=3)
    return SegformerForSemanticSegmentation(config), (), {"pixel_values": _image()}


def beit():
    from transformers import BeitConfig, BeitForImageClassification

    # A relative position bias table indexed per window, layer scale on each residual branch.  Not in the corpus:
    # the index is memoized for the whole process, so a forward after the first reads it from outside the
    # trace and runs fewer ops (tests/test_capture_honesty.py checks that the trace says so).
    config = BeitConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        image_size=IMAGE, patch_size=8, use_relative_position_bias=True, num_labels=3)
    return BeitForImageClassification(config), (_image(),), {}


def mobilevit():
    from transformers import MobileViTConfig, MobileViTForImageClassification

    # Convolutions, then feature maps unfolded into patches for a transformer and folded back.
    config = MobileViTConfig(image_size=IMAGE, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
                             num_labels=3)
    return MobileViTForImageClassification(config), (), {"pixel_values": _image()}


def regnet():
    from transformers import RegNetConfig, RegNetForImageClassification

    # Grouped convolutions with squeeze-and-excitation.
    config = RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8, num_labels=3)
    return RegNetForImageClassification(config), (_image(),), {}


def dinov2():
    from transformers import Dinov2Config, Dinov2ForImageClassification

    # Layer scale on each residual branch, and stochastic depth (drop path) drawn in train mode.
    config = Dinov2Config(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=IMAGE,
                          patch_size=8, num_labels=3, layerscale_value=0.5, drop_path_rate=0.1)
    return Dinov2ForImageClassification(config), (_image(),), {}


def deformable_detr():
    from transformers import DeformableDetrConfig, DeformableDetrForObjectDetection, ResNetConfig

    # Multi-scale deformable attention: sampling offsets read with grid_sample from two feature levels.
    backbone = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                            out_features=["stage1", "stage2"])
    config = DeformableDetrConfig(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone,
                                  d_model=HIDDEN, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=5,
                                  num_labels=3, num_feature_levels=2, encoder_n_points=2, decoder_n_points=2)
    return DeformableDetrForObjectDetection(config), (), {"pixel_values": _image(size=64)}


def hiera():
    from transformers import HieraConfig, HieraForImageClassification

    # Tokens unrolled into mask units, attention within each unit, and queries max-pooled as a stage begins.
    config = HieraConfig(embed_dim=16, image_size=[IMAGE, IMAGE], patch_size=[3, 3], patch_stride=[2, 2],
                         patch_padding=[1, 1], depths=[1, 1], num_heads=[1, 2], query_stride=[2, 2],
                         masked_unit_size=[4, 4], num_query_pool=1, num_labels=3, embed_dim_multiplier=2.0)
    return HieraForImageClassification(config), (_image(),), {}


def focalnet():
    from transformers import FocalNetConfig, FocalNetForImageClassification

    # Focal modulation instead of attention: depthwise convolutions at growing ranges, gated and summed.
    config = FocalNetConfig(image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], focal_levels=[2, 2],
                            focal_windows=[3, 3], num_labels=3)
    return FocalNetForImageClassification(config), (_image(),), {}
