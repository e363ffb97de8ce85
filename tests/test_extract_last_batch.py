"""Extraction over a DataLoader whose last batch holds one example: a forward that calls ``squeeze()`` with no
dim drops that batch's dim of size 1, and the refusal says so (not that the earlier batches' rows were no
examples), and the same folder then resumes with the batch of one left out."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import torchlens as tl


class SqueezeAll(nn.Module):
    """Reads (B, 1, 4) inputs through ``squeeze()``: (B, 4) rows, but a batch of one comes out (4,)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.proj(x.squeeze()).relu()


class Score(nn.Module):
    """One score per example, squeezed to (B,): a batch of one scores as a scalar."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(x).squeeze()


SQUEEZE_ALL, SCORE = SqueezeAll().eval(), Score().eval()
DATA = torch.randn(5, 1, 4, generator=torch.Generator().manual_seed(1))


def loader(data, **kwargs):
    return DataLoader(TensorDataset(data), batch_size=2, **kwargs)


def batched(layer, data):
    """What ``layer`` gives the loader's batches of 2, one batch at a time (as extraction runs them)."""
    with torch.no_grad():
        return torch.cat([layer(chunk) for chunk in data.split(2)])


def extract(model, batches, layers, out):
    tl.extract(model, batches, layers=layers, out=out, args_of=lambda batch: batch[0], progress=False)


def test_a_last_batch_of_one_whose_batch_dim_was_squeezed_is_refused_saying_so(tmp_path):
    with pytest.raises(ValueError, match=r"batch 2 has one example .* has shape \(4,\), the shape of one row of the "
                                         r"earlier batches, with no batch dim.*drop_last=True") as refused:
        extract(SQUEEZE_ALL, loader(DATA), ["proj"], tmp_path / "x")
    assert "coincidence" not in str(refused.value)  # the earlier batches' rows are examples
    extract(SQUEEZE_ALL, loader(DATA, drop_last=True), ["proj"], tmp_path / "x")  # resumes without the batch of one
    stored = tl.load_extracted(tmp_path / "x", as_torch=True)["proj"]
    assert torch.equal(stored, batched(SQUEEZE_ALL.proj, DATA[:4, 0]))


def test_a_squeezed_scalar_in_a_last_batch_of_one_is_refused_saying_so(tmp_path):
    with pytest.raises(ValueError, match=r"batch 2 has one example .* output \(output_1:1\) has shape \(\), the shape "
                                         r"of one row of the earlier batches"):
        extract(SCORE, loader(DATA[:, 0]), ["output"], tmp_path / "x")


def test_a_scalar_in_a_first_batch_of_one_names_the_batch_and_the_squeeze(tmp_path):
    with pytest.raises(ValueError, match=r"batch 0: output \(output_1:1\) is a scalar.*this batch has one example: a "
                                         r"squeeze\(\) with no dim"):
        extract(SCORE, DataLoader(TensorDataset(DATA[:, 0]), batch_size=1), ["output"], tmp_path / "x")


def test_a_layer_that_follows_the_batch_dim_is_stored_whole_with_a_last_batch_of_one(tmp_path):
    extract(SCORE, loader(DATA[:, 0]), ["head"], tmp_path / "x")
    assert torch.equal(tl.load_extracted(tmp_path / "x", as_torch=True)["head"], batched(SCORE.head, DATA[:, 0]))
