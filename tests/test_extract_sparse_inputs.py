"""Extraction of models that take sparse, nested or quantized inputs (a graph network's sparse adjacency): the
inputs are hashed, for the resume check, through the dense tensors that define them, since they have no bytes
of their own."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.io import ResumeMismatchError
from torchlens.io.extract import inputs_fingerprint
from streams import interrupted


class GraphConv(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, adj):
        return torch.sparse.mm(adj, self.fc(x))


def _graphs(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 4, generator=g), (torch.rand(5, 5, generator=g) > 0.6).float().to_sparse())
            for _ in range(n)]


def test_a_model_taking_a_sparse_adjacency_extracts_and_resumes(tmp_path):
    # The resume check's hash read each input's bytes, which a sparse tensor has not: every extraction of such a
    # model failed before its first batch with torch's "unsupported memory format option Contiguous".
    model, graphs = GraphConv().eval(), _graphs()
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(graphs, 3), ["fc", "sparsemm_1_2"], tmp_path / "f", shard_bytes=1,
                   progress=False)
    tl.extract(model, graphs, ["fc", "sparsemm_1_2"], tmp_path / "f", shard_bytes=1, progress=False)
    arrays = tl.load_extracted(tmp_path / "f", as_torch=True)
    with torch.no_grad():
        assert torch.equal(arrays["sparsemm_1_2"], torch.cat([model(x, adj) for x, adj in graphs]))
    changed = _graphs()[:2] + [(graphs[2][0], graphs[2][1] * 2)] + graphs[3:]  # the adjacency at the boundary
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(graphs, 3), ["fc"], tmp_path / "g", shard_bytes=1, progress=False)
    with pytest.raises(ResumeMismatchError, match="input batch 2 differs"):
        tl.extract(model, changed, ["fc"], tmp_path / "g", shard_bytes=1, progress=False)


def test_a_sparse_keyword_argument_is_part_of_the_job(tmp_path):
    model, graphs = GraphConv().eval(), _graphs()
    features, adj = [x for x, _ in graphs], graphs[0][1]
    tl.extract(model, features, ["fc"], tmp_path / "f", kwargs={"adj": adj}, progress=False)
    with pytest.raises(ResumeMismatchError, match="kwargs_sha256"):
        tl.extract(model, features, ["fc"], tmp_path / "f", kwargs={"adj": adj * 2}, progress=False)
    assert tl.load_extracted(tmp_path / "f")["fc"].shape == (20, 3)


@pytest.mark.parametrize("make", [
    lambda x: x.to_sparse(), lambda x: x.to_sparse_csr(), lambda x: x.to_sparse_csc(),
    lambda x: torch.nested.nested_tensor([x, x[:1]]),
    lambda x: torch.nested.nested_tensor([x, x[:1]], layout=torch.jagged),
    lambda x: torch.quantize_per_tensor(x, 0.1, 0, torch.qint8),
    lambda x: torch.quantize_per_channel(x, torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.qint8),
], ids=["coo", "csr", "csc", "nested", "jagged", "quantized", "per_channel"])
def test_inputs_of_other_layouts_hash_by_their_values(make):
    x = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]])
    assert inputs_fingerprint((make(x),)) == inputs_fingerprint((make(x.clone()),))
    assert inputs_fingerprint((make(x),)) != inputs_fingerprint((make(x * 3),))


class PoolTokens(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 2)

    def forward(self, tokens):
        return self.fc(tokens).sum(dim=1)


def test_a_model_taking_jagged_nested_sequences_extracts(tmp_path):
    # A jagged nested tensor is a tensor subclass whose values live in the tensors it holds: the resume check
    # refused it as a wrapper "with no storage of its own", saying to pass a plain tensor the model cannot take.
    g = torch.Generator().manual_seed(0)
    batches = [torch.nested.nested_tensor([torch.randn(n, 4, generator=g) for n in lengths], layout=torch.jagged)
               for lengths in ((2, 3, 1), (4, 1))]
    model = PoolTokens().eval()
    tl.extract(model, batches, ["sum_1_2"], tmp_path / "f", progress=False)
    with torch.no_grad():
        expected = torch.cat([model(tokens) for tokens in batches])
    assert torch.equal(tl.load_extracted(tmp_path / "f", as_torch=True)["sum_1_2"], expected)


class PadThenPool(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 2)

    def forward(self, tokens):
        return torch.nested.to_padded_tensor(self.fc(tokens), 0.0).sum(dim=1)


def _strided_nested_batches():
    g = torch.Generator().manual_seed(0)
    return [torch.nested.nested_tensor([torch.randn(n, 4, generator=g) for n in lengths])
            for lengths in ((2, 3, 1), (4, 1))]


def test_a_model_taking_strided_nested_sequences_extracts(tmp_path):
    # A strided nested tensor raises on .shape ("NestedTensorImpl doesn't support sizes"): reading a batch's size
    # from it failed every extraction of such a model with torch's internal error, before its first batch.
    batches, model = _strided_nested_batches(), PadThenPool().eval()
    tl.extract(model, batches, ["sum_1_3"], tmp_path / "f", progress=False)
    with torch.no_grad():
        expected = torch.cat([model(tokens) for tokens in batches])
    assert torch.equal(tl.load_extracted(tmp_path / "f", as_torch=True)["sum_1_3"], expected)


def test_an_input_batch_dim_that_is_ragged_in_every_nested_input_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"input_batch_dim=1, but the sizes of dim 1 differ between the components "
                                         r"of each nested input tensor \(their shapes: \['3x\?x4'\]\)"):
        tl.extract(PadThenPool().eval(), _strided_nested_batches(), ["sum_1_3"], tmp_path / "f", input_batch_dim=1,
                   progress=False)
