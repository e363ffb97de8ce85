"""Extraction of a sequence-first model, whose inputs are ``(S, B, E)``: ``input_batch_dim=1`` says where the batch
is in the inputs, so its size is not read from the sequence length and its layers are stored a row per example."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import torchlens as tl
from torchlens.io import ResumeMismatchError
from streams import interrupted


class SeqFirst(nn.Module):
    """A transformer encoder layer in torch's default sequence-first layout, pooled over the sequence."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0)  # batch_first=False
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.encoder(x).mean(0))


MODEL = SeqFirst().eval()
DATA = [torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]  # (S=5, B=3, E=8)
LAYERS, BY_EXAMPLE = ["encoder", "head"], {"input_batch_dim": 1, "batch_dim": {"encoder": 1}}


def hooked(model, data):
    """Each example's encoder output (S, E) and head output, in dataset order, as forward hooks see them."""
    seen = []
    handles = [m.register_forward_hook(lambda m, args, out: seen.append(out)) for m in (model.encoder, model.head)]
    try:
        with torch.no_grad():
            for x in data:
                model(x)
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([t.movedim(1, 0) for t in seen[0::2]]), torch.cat(seen[1::2])


def test_a_sequence_first_model_is_stored_a_row_per_example(tmp_path):
    # Without input_batch_dim= the batch size was read as S (5), and (S, B, E) stored a row per position.
    tl.extract(MODEL, DATA, LAYERS, tmp_path / "x", progress=False, **BY_EXAMPLE)
    got = tl.load_extracted(tmp_path / "x", as_torch=True)
    encoder, head = hooked(MODEL, DATA)
    assert got["encoder"].shape == (9, 5, 8) and got["head"].shape == (9, 3)
    assert torch.equal(got["encoder"], encoder) and torch.equal(got["head"], head)


def test_a_sequence_first_layer_left_at_dim_0_is_refused_naming_its_batch_dim(tmp_path):
    with pytest.raises(ValueError, match=r"batch 0: encoder \(.*\) has shape \(5, 3, 8\), whose batch dim 0 has 5 "
                                         r"entries, but the batch has 3 rows \(dim 1 of the input args\.0, the first "
                                         r"input whose dim 1 is not 1\).*pass batch_dim=\{'encoder': 1\}"):
        tl.extract(MODEL, DATA, LAYERS, tmp_path / "x", input_batch_dim=1, progress=False)


@pytest.mark.parametrize(("value", "error", "problem"), [
    ("1", TypeError, "is a str, not an int"), (True, TypeError, "is a bool, not an int"),
    (1.0, TypeError, "is a float, not an int"), (-1, ValueError, "is negative")])
def test_an_input_batch_dim_that_is_not_a_dim_is_refused_before_the_first_batch(tmp_path, value, error, problem):
    # A negative dim was a TypeError, where every other option's negative number is a ValueError.
    def never():
        raise AssertionError("a batch was read")
        yield

    with pytest.raises(error, match=rf"tl\.extract: input_batch_dim={value!r} {problem}; give the dim of the inputs "
                                    r"that counts the batch's examples \(1 for sequence-first inputs of shape "
                                    r"\(S, B, E\)\)"):
        tl.extract(MODEL, never(), LAYERS, tmp_path / "x", input_batch_dim=value, progress=False)


def test_a_numpy_integer_input_batch_dim_is_a_dim(tmp_path):
    # It was refused as no dim index, where other options take NumPy integers as ints.
    numpy = pytest.importorskip("numpy")
    options = {**BY_EXAMPLE, "input_batch_dim": numpy.int64(1)}
    folder = tl.extract(MODEL, DATA, LAYERS, tmp_path / "np", progress=False, **options)
    same = tl.extract(MODEL, DATA, LAYERS, tmp_path / "int", progress=False, **BY_EXAMPLE)
    rows, expected = tl.load_extracted(folder, as_torch=True), tl.load_extracted(same, as_torch=True)
    assert rows.keys() == expected.keys()
    assert all(torch.equal(rows[name], expected[name]) for name in expected)


def test_an_input_batch_dim_no_input_has_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"input_batch_dim=3, but no input tensor has a dim 3 \(their shapes: "
                                         r"\[\(5, 3, 8\)\]\)"):
        tl.extract(MODEL, DATA, LAYERS, tmp_path / "x", input_batch_dim=3, progress=False)


def test_a_resume_with_another_input_batch_dim_is_refused(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        tl.extract(MODEL, interrupted(DATA, 2), LAYERS, tmp_path / "x", shard_bytes=1, progress=False, **BY_EXAMPLE)
    with pytest.raises(ResumeMismatchError, match=r"input_batch_dim: 1 then, None now"):
        tl.extract(MODEL, DATA, LAYERS, tmp_path / "x", batch_dim={"encoder": 1}, progress=False)
    tl.extract(MODEL, DATA, LAYERS, tmp_path / "x", progress=False, **BY_EXAMPLE)
    assert torch.equal(tl.load_extracted(tmp_path / "x", as_torch=True)["encoder"], hooked(MODEL, DATA)[0])


def test_distributed_extraction_reads_each_batch_size_from_the_input_batch_dim(tmp_path):
    # A stream shared batch by batch gives each row its sample index from the batch size: read as S, every batch
    # had 5 indices for its 3 rows.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tl.extract(MODEL, DATA, LAYERS, str(tmp_path / "dist"), progress=False, **BY_EXAMPLE)
    finally:
        dist.destroy_process_group()
    got = tl.load_extracted(tmp_path / "dist", as_torch=True)
    assert torch.equal(got["encoder"], hooked(MODEL, DATA)[0]) and torch.equal(got["head"], hooked(MODEL, DATA)[1])
