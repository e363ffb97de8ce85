"""The reference runs of validation work on copies of the inputs, made so that they compute what the traced
forward computed: views of one storage stay views of one copy, and inputs inside packed sequences,
dataclasses and dict subclasses are copied too.  A wrong copy would compare the trace with a forward no
one ran.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from trusted import assert_trusted  # noqa: E402


class PreallocatedCacheStep(nn.Module):
    """One decoding step over a key cache allocated once by the caller: the step writes its key into the
    cache and attends over the filled part, which the caller passes as a view of that cache."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.key, self.query = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, cache, filled, position: int):
        cache[:, position] = self.key(x)
        scores = torch.einsum("bd,bsd->bs", self.query(x), filled)
        return torch.einsum("bs,bsd->bd", scores.softmax(-1), filled)


def test_inputs_that_view_one_storage_stay_views_of_one_copy_in_the_reference_run():
    """The reference forward runs on copies of the inputs; a view of another input must stay a view of that
    input's copy, or a write through one would not show in the other and the untraced run the trace is
    compared with would compute what no forward did (a false 'outputs differ')."""
    model, x = PreallocatedCacheStep(), torch.randn(2, 8)
    cache = torch.zeros(2, 4, 8)
    cache[:, :2] = torch.randn(2, 2, 8)
    written_once = cache.clone()
    written_once[:, 2] = model.key(x).detach()
    result = tl.validate(model, (x, cache, cache[:, :3], 2))
    assert_trusted(result)
    assert result.outputs_match is True
    assert torch.equal(cache, written_once)  # the caller's cache is written once, by the traced run


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(3, 4, batch_first=True)

    def forward(self, packed):
        out, (h, _) = self.rnn(packed)
        return out, h


def test_a_packed_sequence_input_is_copied_for_the_reference_runs():
    """``PackedSequence`` is a named tuple whose constructor refuses the skeleton the inputs' copy is built
    from (a ``None`` where its data goes): validation and a label site's reference pass raised an internal
    AssertionError instead of running."""
    from torch.nn.utils.rnn import pack_padded_sequence

    model = PackedLSTM().eval()
    packed = pack_padded_sequence(torch.randn(3, 5, 3), torch.tensor([3, 5, 2]), batch_first=True, enforce_sorted=False)
    log = tl.trace(model, (packed,))
    assert [op.io_path for op in log.inputs] == [f"input.packed.{i}" for i in range(4)]
    assert type(log.output[0]) is type(packed)
    result = tl.validate(model, (packed,))
    assert_trusted(result)
    assert result.outputs_match is True
    edited = tl.trace(model, (packed,), intervene={"lstm_1_4": tl.zero_ablate()})  # the packed output's data
    assert [a.label for a in edited.interventions] == ["lstm_1_4:1"]
    assert torch.equal(edited.output[0].data, torch.zeros(10, 4))


@dataclasses.dataclass
class ImageBatch:
    pixels: torch.Tensor


class NormalizesInPlace(nn.Module):
    """Scales its batch's pixels in place before the convolution, as a preprocessing step folded into forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, batch):
        pixels = batch.pixels if isinstance(batch, ImageBatch) else batch["pixels"]
        pixels.div_(255.0)
        return self.conv(pixels).relu()


@pytest.mark.parametrize("container", [ImageBatch, lambda pixels: collections.OrderedDict(pixels=pixels)],
                         ids=["dataclass", "OrderedDict"])
def test_inputs_in_dataclasses_and_dict_subclasses_are_copied_for_the_extra_runs(container):
    """A dataclass or a dict subclass holding the inputs was handed to the reference runs as it was, the
    caller's tensors in it: the reference forward wrote them, the traced one wrote them again, validation
    reported 'outputs differ' and an intervened run computed from inputs written twice."""
    pixels = torch.full((1, 3, 5, 5), 255.0)
    once = pixels / 255.0
    result = tl.validate(NormalizesInPlace(), (container(pixels),))
    assert_trusted(result)
    assert result.outputs_match is True and torch.equal(pixels, once)  # the caller's pixels written once
    pixels = torch.full((1, 3, 5, 5), 255.0)
    expected = NormalizesInPlace()(container(pixels.clone()))
    edited = tl.trace(NormalizesInPlace(), (container(pixels),), intervene={"relu_1_3": tl.scale(1.0)})
    assert [a.label for a in edited.interventions] == ["relu_1_3:1"]
    assert torch.equal(edited.output, expected) and torch.equal(pixels, once)
