"""Saved traces keep every stride of a tensor they lay out again, a size-1 or empty dim's included."""

from __future__ import annotations

import torch
import torch.nn as nn

import torchlens as tl


class _Transposes(nn.Module):
    """Transposes whose outputs torch calls contiguous but whose strides are not the row-major ones: an (n, 1)
    turned (1, n) keeps stride 1 on its size-1 dim, a channels_last (N, C, 1, 1) keeps C on its, and an
    empty (0, n) turned (n, 0) keeps n."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 1)

    def forward(self, x):
        column = self.proj(x).t()
        square = (x.reshape(2, 4, 1, 1) * 1).contiguous(memory_format=torch.channels_last)
        empty = (x[:0] * 1).t()
        return column * 2, square, empty


def _strides(trace) -> dict:
    return {op.label: op.activation.stride() for op in trace.ops if op.has_activation}


def _odd(shape, strides) -> bool:
    """Strides torch calls contiguous that are not the row-major ones: what these tests need to see kept."""
    return torch.empty_strided(shape, strides).is_contiguous() and strides != torch.empty(shape).stride()


def _odd_strides(trace) -> dict:
    return {op.label: op.activation.stride() for op in trace.ops
            if op.has_activation and _odd(op.shape, op.activation.stride())}


def test_activations_keep_strides_of_size_one_and_empty_dims(tmp_path):
    live = tl.trace(_Transposes(), torch.randn(2, 4))
    assert len(_odd_strides(live)) >= 3  # the transpose, the channels_last copy and the empty transpose
    loaded = tl.load(live.save(tmp_path / "run"))
    assert _strides(loaded) == _strides(live)
    for op in live.ops:
        if op.has_activation:
            assert torch.equal(loaded[op.label].activation, op.activation)


def test_gradients_and_originals_keep_strides_of_size_one_dims(tmp_path):
    x = torch.randn(2, 4, requires_grad=True)
    live = tl.trace(_Transposes(), x, grads=True, intervene={"proj": tl.scale(2.0)})
    column, square, _ = live.output  # weighted, not summed: a sum's gradient is expanded, laid out row-major
    live.backward((column * torch.randn(column.shape)).sum() + (square * torch.randn(square.shape)).sum())
    loaded = tl.load(live.save(tmp_path / "run"))
    grads = {op.label: op.grad.stride() for op in live.ops if op.has_grad}
    originals = {op.label: op.original.stride() for op in live.ops if op.original is not None}
    assert any(_odd(live[label].shape, s) for label, s in grads.items())  # a gradient's odd stride to keep
    assert originals  # the intervention kept the value it replaced
    assert {label: loaded[label].grad.stride() for label in grads} == grads
    assert {label: loaded[label].original.stride() for label in originals} == originals
    for label in grads:
        assert torch.equal(loaded[label].grad, live[label].grad)


class _EmptySlices(nn.Module):
    """Empty slices keep their base's strides ((4, 0) of a (4, 3): (3, 1)), which no gapless layout of a
    non-empty tensor of their shape has: the loaded trace held them row-major, (1, 1)."""

    def forward(self, x):
        y = x * 2
        return y[:, :0], y.t()[:0], y.unsqueeze(0)[:, :, :0]


def test_empty_slices_keep_their_base_strides(tmp_path):
    live = tl.trace(_EmptySlices(), torch.randn(4, 3))
    kept = {op.label: op.activation.stride() for op in live.ops if op.has_activation and op.activation.numel() == 0}
    assert len(kept) >= 3 and all(s != torch.empty(live[label].shape).stride() for label, s in kept.items())
    loaded = tl.load(live.save(tmp_path / "run"))
    assert {label: loaded[label].activation.stride() for label in kept} == kept
    assert all(loaded[label].activation.shape == live[label].activation.shape for label in kept)
