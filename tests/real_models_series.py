"""The time-series entries of the real-model corpus (tests/real_models.py): two forecasters from small configs
with random weights, on series drawn from a fixed generator.  Builders import ``transformers`` lazily."""

from __future__ import annotations

import torch

from real_models_nn import HIDDEN


def _series(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(8))


def time_series_transformer():
    from transformers import TimeSeriesTransformerConfig, TimeSeriesTransformerForPrediction

    # Mean scaling, lagged copies of the series gathered as features, and a Student-t head whose negative
    # log-likelihood of the future values is the loss.
    config = TimeSeriesTransformerConfig(prediction_length=4, context_length=8, lags_sequence=[1, 2], d_model=16,
                                         encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                         decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                         num_time_features=1)
    kwargs = {"past_values": _series(2, 10), "past_time_features": _series(2, 10, 1),
              "past_observed_mask": torch.ones(2, 10), "future_values": _series(2, 4),
              "future_time_features": _series(2, 4, 1)}
    return TimeSeriesTransformerForPrediction(config), (), kwargs


def timesfm():
    from transformers import TimesFmConfig, TimesFmModelForPrediction

    # A list of series of different lengths, padded to the context, masked in patches and rescaled by their own
    # statistics, with a quantile forecast per horizon step.
    config = TimesFmConfig(patch_length=4, context_length=16, horizon_length=4, hidden_size=HIDDEN,
                           intermediate_size=64, head_dim=8, num_attention_heads=4, num_hidden_layers=1)
    return TimesFmModelForPrediction(config), (), {"past_values": [_series(16), _series(12)]}
