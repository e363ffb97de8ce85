"""Extraction of layers whose batch dim is not dim 0: named with ``batch_dim=``, and refused when a dim 0 that
had the batch's size by coincidence stops following it."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.io import ResumeMismatchError
from streams import interrupted


class Streams(nn.Module):
    """Two streams of every row kept as one (2, B, H) tensor, as transformers' gemma3n keeps its altup streams."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return torch.stack([self.a(x), self.b(x)])


class AltUp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.streams, self.head = Streams(), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.streams(x).mean(0))


def rows(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 4, generator=g) for n in sizes]


def streams_by_row(model, data):
    """Each example's (2, 4) streams, in dataset order: what a row per example of the layer holds."""
    with torch.no_grad():
        return torch.cat([model.streams(x).movedim(1, 0) for x in data])


def test_a_layer_whose_batch_dim_is_not_dim_0_is_stored_a_row_per_example_with_its_gradient(tmp_path):
    # Batches of 2, the number of streams: dim 0 of (2, B, 4) has the batch's size, and it was stacked as the batch,
    # each "row" one stream of both examples. batch_dim= names the batch dim, which is moved first.
    model, data = AltUp().eval(), rows([2, 2, 2])
    tl.extract(model, data, ["streams", "head"], tmp_path / "x", batch_dim={"streams": 1}, grads=True,
               loss_fn=lambda output, batch: output.sum(), progress=False)
    got = tl.load_extracted(tmp_path / "x", as_torch=True)
    assert got["streams"].shape == (6, 2, 4)
    assert torch.equal(got["streams"], streams_by_row(model, data))
    with torch.no_grad():
        assert torch.equal(got["head"], torch.cat([model(x) for x in data]))  # other layers stay as they were
    # d sum(head(mean of the streams)) / d streams: each stream of a row gets half of the head's column sums.
    expected_grad = (model.head.weight.sum(0) / 2).detach().expand(6, 2, 4)
    assert torch.allclose(got["grad:streams"], expected_grad)
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert [layer["shape"] for layer in manifest["layers"]] == [[6, 2, 4], [6, 3], [6, 2, 4], [6, 3]]


def test_a_dim_0_that_stops_following_the_batch_size_is_refused_as_not_the_batch_dim(tmp_path):
    # Batches of 2 passed; the batch of 3 made the streams (2, 3, 4), refused for their "rows" of [3, 4] against
    # [2, 4] with advice to pad inputs to one length, which hid that dim 0 had never been the batch.
    model, data = AltUp().eval(), rows([2, 2, 3])
    with pytest.raises(ValueError, match=r"^batch 2: streams \(stack_1_3:1\) has shape \(2, 3, 4\), whose batch dim 0 "
                                         r"has 2 entries, but the batch has 3 rows \(dim 0 of the input args\.0.*"
                                         r"pass batch_dim=\{'streams': 1\} if it is the batch\. Earlier batches passed "
                                         r"only because dim 0 had their size by coincidence"):
        tl.extract(model, data, ["streams"], tmp_path / "x", shard_bytes=1, progress=False)
    # The committed batches' rows are not examples: resuming them under batch_dim= is refused as another job.
    with pytest.raises(ResumeMismatchError, match=r"batch_dim: None then, \{'streams': 1\} now"):
        tl.extract(model, data, ["streams"], tmp_path / "x", batch_dim={"streams": 1}, progress=False)
    tl.extract(model, data, ["streams"], tmp_path / "y", batch_dim={"streams": 1}, progress=False)
    assert torch.equal(tl.load_extracted(tmp_path / "y", as_torch=True)["streams"], streams_by_row(model, data))


@pytest.mark.parametrize("batch_dim, error, message", [
    (1, TypeError, r"tl\.extract: batch_dim= maps a layer to its batch dim when that is not dim 0 \(batch_dim="
                   r"\{'streams': 1\}\), got int"),
    ({"stream": 1}, ValueError, r"batch_dim= names 'stream', which layers= does not list \(\['streams'\]\)"),
    ({"streams": 1.0}, TypeError, r"batch_dim\['streams'\] is 1\.0, not a dim"),
    ({"streams": True}, TypeError, r"batch_dim\['streams'\] is True, not a dim"),
])
def test_a_batch_dim_that_names_no_layer_or_no_dim_is_refused_before_the_first_batch(tmp_path, batch_dim, error,
                                                                                    message):
    model, forwards = AltUp().eval(), []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.raises(error, match=message):
        tl.extract(model, rows([2]), ["streams"], tmp_path / "x", batch_dim=batch_dim, progress=False)
    assert not forwards and not (tmp_path / "x").exists()


def test_a_batch_dim_the_layer_lacks_is_refused_naming_its_shape(tmp_path):
    with pytest.raises(ValueError, match=r"batch_dim= gives streams \(stack_1_3:1\) the batch dim 3, but its "
                                         r"activation has shape \(2, 2, 4\), of 3 dims"):
        tl.extract(AltUp().eval(), rows([2]), ["streams"], tmp_path / "x", batch_dim={"streams": 3}, progress=False)
    # A negative dim counts from the end, as torch's do.
    tl.extract(AltUp().eval(), rows([2, 3]), ["streams"], tmp_path / "y", batch_dim={"streams": -2}, progress=False)
    assert tl.load_extracted(tmp_path / "y")["streams"].shape == (5, 2, 4)


def test_a_resume_keeps_the_batch_dim_and_a_folder_without_one_resumes_as_batch_major(tmp_path):
    model, data = AltUp().eval(), rows([2, 3, 2, 3])
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 2), ["streams"], tmp_path / "x", batch_dim={"streams": 1},
                   shard_bytes=1, progress=False)
    with pytest.raises(ResumeMismatchError, match=r"batch_dim: \{'streams': 1\} then, None now"):
        tl.extract(model, data, ["streams"], tmp_path / "x", progress=False)
    tl.extract(model, data, ["streams"], tmp_path / "x", batch_dim={"streams": 1}, progress=False)
    assert torch.equal(tl.load_extracted(tmp_path / "x", as_torch=True)["streams"], streams_by_row(model, data))
    # A folder started before batch_dim= existed records no batch_dim: its layers are batch-major, as now by default.
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 2), ["head"], tmp_path / "old", shard_bytes=1, progress=False)
    progress = pathlib.Path(tmp_path / "old" / "progress.json")
    state = json.loads(progress.read_text())
    del state["arguments"]["batch_dim"]
    progress.write_text(json.dumps(state))
    tl.extract(model, data, ["head"], tmp_path / "old", progress=False)
    with torch.no_grad():
        expected = torch.cat([model(x) for x in data])
    assert torch.equal(tl.load_extracted(tmp_path / "old", as_torch=True)["head"], expected)


@pytest.fixture(scope="module")
def gemma3n():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma3nTextConfig"):
        pytest.skip("this transformers has no gemma3n")
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextModel

    config = transformers.Gemma3nTextConfig(
        vocab_size=64, vocab_size_per_layer_input=64, hidden_size=16, hidden_size_per_layer_input=4,
        intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        altup_num_inputs=2, laurel_rank=4, num_kv_shared_layers=0, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.0, 0.0])
    torch.manual_seed(0)
    return Gemma3nTextModel(config).eval()


def test_gemma3n_altup_layers_are_extracted_a_row_per_example_and_refused_at_another_batch_size(tmp_path, gemma3n):
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 64, (2, 5), generator=g) for _ in range(2)]
    tl.extract(gemma3n, data, ["layers.0"], tmp_path / "x", batch_dim={"layers.0": 1}, progress=False)
    outputs = []
    handle = gemma3n.layers[0].register_forward_hook(lambda module, args, output: outputs.append(output))
    with torch.no_grad():
        for ids in data:
            gemma3n(ids)
    handle.remove()
    assert [tuple(o.shape) for o in outputs] == [(2, 2, 5, 16)] * 2  # (altup streams, batch, sequence, hidden)
    got = tl.load_extracted(tmp_path / "x", as_torch=True)["layers.0"]
    assert torch.equal(got, torch.cat([o.movedim(1, 0) for o in outputs]))
    mixed = data + [torch.randint(0, 64, (3, 5), generator=g)]
    with pytest.raises(ValueError, match=r"^batch 2: layers\.0 \(\S+\) has shape \(2, 3, 5, 16\), whose batch dim 0 "
                                         r"has 2 entries, but the batch has 3 rows.*batch_dim=\{'layers\.0': 1\}"):
        tl.extract(gemma3n, mixed, ["layers.0"], tmp_path / "y", progress=False)


class MeanPool(nn.Module):
    """Takes a list of token sequences of different lengths, one per example, and pools each."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 4), nn.Linear(4, 2)

    def forward(self, sequences):
        return self.head(torch.stack([self.embed(s).mean(0) for s in sequences]))


def test_a_batch_of_ragged_sequences_is_refused_saying_to_pad_them(tmp_path):
    # The batch's size is read from a tensor's dim: here the first sequence's length, 5, for a batch of 3. The
    # refusal said that no dim of the (3, 2) head output had the batch's size and advised choosing another layer.
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 20, (n,), generator=g) for n in (5, 7, 3)]
    with pytest.raises(ValueError, match=r"the batch has 5 rows \(dim 0 of the input args\.0\.0, .*\): that input is "
                                         r"one of the tensors of args\.0, whose dim 0 sizes differ .* padded to one "
                                         r"length") as refused:
        tl.extract(MeanPool(), [sequences], ["head"], tmp_path / "f", progress=False)
    assert "choose a layer with a row per example" not in str(refused.value)
    padded = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)  # batch-major: (3, 7), read as 3 rows
    tl.extract(nn.Sequential(nn.Embedding(20, 4), nn.Linear(4, 2)), [padded], ["1"], tmp_path / "g", progress=False)
    assert tl.load_extracted(tmp_path / "g")["1"].shape == (3, 7, 2)


class FeaturesFirst(nn.Module):
    """Returns its rows as columns: a (3, B) activation, whose batch dim is 1, or -1 counted from the end."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x).t()


def test_a_batch_dim_counted_from_the_end_is_the_same_job_as_counted_from_the_front(tmp_path):
    # batch_dim={"fc_t": -1} and {"fc_t": 1} extract the same rows of a 2-d layer, but named the job apart: the
    # resume of an interrupted run written the other way was refused, as was the call into the complete folder.
    model, data = nn.Sequential(FeaturesFirst(), nn.Tanh()).eval(), rows([2, 3, 2])
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 2), ["0"], tmp_path / "x", batch_dim={"0": -1}, shard_bytes=1,
                   progress=False)
    tl.extract(model, data, ["0"], tmp_path / "x", batch_dim={"0": 1}, shard_bytes=1, progress=False)
    with torch.no_grad():
        expected = torch.cat([model[0](x).t() for x in data])
    assert torch.equal(tl.load_extracted(tmp_path / "x", as_torch=True)["0"], expected)
    tl.extract(model, data, ["0"], tmp_path / "x", batch_dim={"0": -1}, progress=False)  # the folder, complete
    with pytest.raises(ResumeMismatchError, match=r"batch_dim: \{'0': -1\} then, \{'0': -2\} now"):
        tl.extract(model, data, ["0"], tmp_path / "x", batch_dim={"0": -2}, progress=False)  # dim 0: another job


class WithTable(nn.Module):
    """Takes the batch and a table of 5 rows that is no batch (a codebook, class prototypes)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, table):
        return self.fc(x) @ self.fc(table).t()


def test_a_last_batch_of_one_example_is_counted_by_the_input_that_counted_the_others(tmp_path):
    # The batch size was read from the first input whose dim 0 is not 1: in a last batch of one example, the table.
    # The batch was refused, saying that the earlier batches' rows were not examples either (they were).
    model, table = WithTable().eval(), torch.randn(5, 4)
    data = [(x, table) for x in rows([2, 2, 1])]
    tl.extract(model, data, ["fc:1", "output_1"], tmp_path / "x", args_of=lambda batch: batch, progress=False)
    got = tl.load_extracted(tmp_path / "x", as_torch=True)
    with torch.no_grad():
        assert torch.equal(got["fc:1"], torch.cat([model.fc(x) for x, _ in data]))
        assert torch.equal(got["output_1"], torch.cat([model(x, t) for x, t in data]))
    assert got["output_1"].shape == (5, 5)


def test_a_resumed_extraction_counts_its_last_batch_of_one_by_the_same_input(tmp_path):
    model, table = WithTable().eval(), torch.randn(5, 4)
    data = [(x, table) for x in rows([2, 2, 1])]
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 2), ["fc:1"], tmp_path / "x", args_of=lambda batch: batch, shard_bytes=1,
                   progress=False)
    tl.extract(model, data, ["fc:1"], tmp_path / "x", args_of=lambda batch: batch, shard_bytes=1, progress=False)
    with torch.no_grad():
        assert torch.equal(tl.load_extracted(tmp_path / "x", as_torch=True)["fc:1"],
                           torch.cat([model.fc(x) for x, _ in data]))
