"""The real-model corpus's ``torch.nn`` entries: two-layer LSTM and GRU models and a two-layer
``nn.TransformerEncoder`` (with and without a padding mask), at the corpus's tiny sizes.  Each builds
``(model, args, kwargs)`` as the ``transformers`` entries of ``real_models`` do."""

import torch
import torch.nn as nn

SEQ = 8  # the corpus's sequence length and hidden width, shared with real_models
HIDDEN = 32


class Recurrent(nn.Module):
    """Two-layer LSTM and GRU, with dropout between layers (active in train mode)."""

    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(12, HIDDEN, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(HIDDEN, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _sequence(batch=2, seq=SEQ, width=12):
    return torch.randn(batch, seq, width, generator=torch.Generator().manual_seed(4))


def lstm():
    return Recurrent(nn.LSTM), (_sequence(),), {}


def gru():
    return Recurrent(nn.GRU), (_sequence(),), {}


def _encoder():
    layer = nn.TransformerEncoderLayer(HIDDEN, nhead=4, dim_feedforward=64, batch_first=True)  # dropout 0.1
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)


def transformer_encoder():
    return _encoder(), (_sequence(width=HIDDEN),), {}


def transformer_encoder_padded():
    padding = torch.zeros(2, SEQ, dtype=torch.bool)
    padding[1, -3:] = True
    return _encoder(), (_sequence(width=HIDDEN),), {"src_key_padding_mask": padding}
