"""A distributed ``tl.extract`` counts each batch's rows as the single-process one does: by the input that
counted the first batch, so that the sample indices match the rows written; it finds each rank's samples through
the DistributedSampler given, refusing ranks that would shard the dataset differently or run different models, and
joins round-robin shares only when their rows cover the stream once each."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import torchlens as tl
from torchlens.distributed.extraction import sample_index
from distributed_workers import LAYERS, extract_batch_sampled, extract_fsdp2_uneven, launch
from test_distributed import single_process, values

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")


class WithTable(nn.Module):
    """Reads a batch ``x`` and a table of 5 rows that is no batch (its dim 0 is not the examples')."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, table):
        return self.fc(x) + table.sum()


def _batches():
    """Two examples, then a last batch of one: there the table's 5 rows are the first dim 0 that is not 1."""
    torch.manual_seed(0)
    return [(torch.randn(2, 4), torch.randn(5, 3)), (torch.randn(1, 4), torch.randn(5, 3))]


def test_a_last_batch_of_one_is_counted_by_the_input_that_counted_the_first(tmp_path):
    model = WithTable()
    single = tl.extract(model, _batches(), ["fc"], tmp_path / "one", args_of=lambda b: b, progress=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # its round-robin share read the table's 5 rows, and refused: "batch 1 has 1 rows but (5,) sample indices"
        ranks = tl.extract(model, _batches(), ["fc"], tmp_path / "ranks", args_of=lambda b: b, progress=False)
    finally:
        dist.destroy_process_group()
    assert sample_index(ranks).tolist() == [0, 1, 2]
    rows = tl.load_extracted(ranks, as_torch=True)["fc"]
    assert rows.shape == (3, 3) and torch.equal(rows, tl.load_extracted(single, as_torch=True)["fc"])


@pytest.mark.path_independent  # how ranks share the batches, not what capture records
def test_a_distributed_sampler_given_through_batch_sampler_shards_by_its_indices(tmp_path):
    # The loader's own sampler is then a default one: the ranks' streams were refused as "different inputs" (and on
    # one rank a shuffled stream was indexed by position, each row under another sample's index).
    out = str(tmp_path / "dist")
    assert values(launch(extract_batch_sampled, 2, str(tmp_path), out, 21, 4)) == ["extracted", "extracted"]
    assert sample_index(out).tolist() == list(range(21))
    expected = single_process(21, 4, tmp_path)
    for name in LAYERS:  # other batch shapes: the same rows, up to matmul rounding
        np.testing.assert_allclose(tl.load_extracted(out)[name], expected[name], rtol=1e-6, atol=1e-6)


def extract_stream_of_its_own_length(rank, world, out, extra_on_rank_1, batch_size=4):
    """A stream of 40 rows in batches of ``batch_size`` shared batch by batch, ``extra_on_rank_1`` batches longer (or
    shorter, if negative) on rank 1: what each rank's tl.extract says."""
    from distributed_workers import KilledAfter, dataset

    batches = list(dataset(40).tensors[0].split(batch_size))
    if rank == 1 and extra_on_rank_1:
        batches = batches + batches[:extra_on_rank_1] if extra_on_rank_1 > 0 else batches[:extra_on_rank_1]
    try:
        tl.extract(KilledAfter(0).eval(), batches, LAYERS, out, progress=False)
    except ValueError as exc:
        return str(exc)
    return "extracted"


@pytest.mark.path_independent  # how ranks share the batches, not what capture records
@pytest.mark.parametrize("extra, gap", [(2, "rows 40, 41, 42 ..."), (-3, "rows 28, 29, 30 ...")])
def test_ranks_given_streams_of_different_lengths_are_refused_before_the_join(tmp_path, extra, gap):
    # Each rank took the batches at its own positions of its own stream: the join left the rows of the batches no
    # rank had out (and took rank 1's extra batches as rows of the dataset), silently.
    out = str(tmp_path / "dist")
    refused = values(launch(extract_stream_of_its_own_length, 2, str(tmp_path), out, extra))
    assert refused[0] == refused[1]
    assert f"streams of different lengths or batch sizes: {gap} of the stream were extracted by no rank" in refused[0]
    assert not os.path.exists(os.path.join(out, "manifest.json"))  # nothing joined


@pytest.mark.path_independent
def test_a_stream_of_fewer_batches_than_ranks_is_refused_on_every_rank_alike(tmp_path):
    # Rank 1 had no batch: it said "inputs yielded no batches", and rank 0 that rank 1 died, hung or raised.
    refused = values(launch(extract_stream_of_its_own_length, 2, str(tmp_path), str(tmp_path / "dist"), 0, 40))
    assert refused[0] == refused[1] == (
        "the stream holds 1 batch, fewer than the 2 ranks that share it batch by batch: rank 1 would have none to "
        "extract. Split it into at least 2 batches, or give a DataLoader with a DistributedSampler, which gives every "
        "rank a share")


@pytest.mark.path_independent
def test_an_fsdp2_model_given_fewer_batches_than_ranks_is_refused_before_any_forward(tmp_path):
    # Rank 0 ran its batch's forward, whose all-gather waited for rank 1, which had found the stream too short at
    # its end and raised: rank 0 failed there with gloo's "connection closed".
    out = str(tmp_path / "fsdp2-short")
    for got in values(launch(extract_fsdp2_uneven, 2, str(tmp_path), out, 1, timeout=45)):
        assert got["forwards"] == 0
        assert got["error"].startswith("the stream holds 1 batch, fewer than the 2 ranks that share it batch by "
                                       "batch: rank 1 would have none to extract")


def extract_own_order(rank, world, out, setting):
    """A distributed extraction whose shuffling DistributedSampler has a ``setting`` ("seed" or "epoch") of each
    rank's own: what each rank's tl.extract says."""
    from torch.utils.data import DataLoader, DistributedSampler

    from distributed_workers import KilledAfter, dataset

    ds = dataset(20)
    sampler = DistributedSampler(ds, shuffle=True, seed=rank if setting == "seed" else 0)
    sampler.set_epoch(rank if setting == "epoch" else 0)
    try:
        tl.extract(KilledAfter(0).eval(), DataLoader(ds, batch_size=4, sampler=sampler), LAYERS, out,
                   args_of=lambda b: b[0], progress=False)
    except ValueError as exc:
        return str(exc)
    return "extracted"


@pytest.mark.path_independent
@pytest.mark.parametrize("setting", ["seed", "epoch"])
def test_distributed_samplers_ordering_the_dataset_differently_are_refused_on_every_rank(tmp_path, setting):
    # Each rank drew its share from its own order: the shares overlapped, and the join dropped the overlap as the
    # sampler's padding, leaving out the samples no rank drew without a word.
    out = str(tmp_path / "dist")
    refused = values(launch(extract_own_order, 2, str(tmp_path), out, setting))
    assert refused[0] == refused[1]
    assert refused[0].startswith(f"the ranks shard the dataset differently ({setting}: 0 on rank 0, 1 on rank 1)")
    assert not os.path.exists(os.path.join(out, "manifest.json"))


def extract_own_model(rank, world, out):
    """A distributed extraction of a model each rank initialised with its own seed: what each rank's tl.extract
    says."""
    from torch.utils.data import DataLoader, DistributedSampler

    from distributed_workers import KilledAfter, dataset

    model = KilledAfter(0).eval()
    with torch.no_grad():
        model.inner.fc1.weight.add_(rank)  # as a model built before seeding every rank alike
    ds = dataset(8)
    try:
        tl.extract(model, DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=False)), LAYERS, out,
                   args_of=lambda b: b[0], progress=False)
    except ValueError as exc:
        return str(exc)
    return "extracted"


@pytest.mark.path_independent
def test_ranks_whose_models_differ_are_refused_before_extracting(tmp_path):
    # Each rank's rows were computed by its own weights, and the join put them together as one model's rows.
    out = str(tmp_path / "dist")
    refused = values(launch(extract_own_model, 2, str(tmp_path), out))
    assert refused[0] == refused[1]
    assert refused[0].startswith("the ranks' KilledAfter models differ (their parameters or buffers: checksums ")
    assert not os.path.exists(os.path.join(out, "manifest.json"))


def extract_checking_slowly(rank, world, out):
    """A stream of equal length on every rank, whose rank 1 is slow to check that the shares cover it."""
    from torchlens.distributed import extraction

    check = extraction._refuse_uncovered_stream

    def slow_check(*args):
        time.sleep(2.0 * rank)
        check(*args)

    extraction._refuse_uncovered_stream = slow_check
    return extract_stream_of_its_own_length(rank, world, out, 0)


@pytest.mark.path_independent
def test_the_join_waits_for_every_rank_to_check_the_shares_it_removes(tmp_path):
    # Rank 0 joined and removed the rank folders while rank 1 still read their sample indices.
    out = str(tmp_path / "dist")
    assert values(launch(extract_checking_slowly, 2, str(tmp_path), out)) == ["extracted", "extracted"]
    assert sample_index(out).tolist() == list(range(40))
