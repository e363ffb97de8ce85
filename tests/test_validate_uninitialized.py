"""Validation and uninitialized memory: ``torch.empty`` and kin return whatever bits the allocator left, so
replay can never reproduce them.  Each test is a faithful trace that validation once reported as a mismatch
because it replayed such an op, or compared such an output.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from accel_paths import PATHS, on_path
from trusted import assert_trusted

os.environ.setdefault("HF_HUB_OFFLINE", "1")

UNDEFINED = "uninitialized memory (torch.empty and kin): its contents are not defined"


class PermutedScratch(nn.Module):
    """Fills part of a scratch buffer made by ``torch.empty_permuted``, whose other elements hold whatever the
    allocator left there."""

    def forward(self, x):
        scratch = torch.empty_permuted((4, 6), (1, 0))
        scratch[:, :3] = x
        return scratch[:, :3] * 2


def test_an_empty_permuted_buffer_is_not_replayed_as_uninitialized_memory():
    # Replayed, it made other garbage than the forward's, reported as a mismatch of a faithful trace.
    result = tl.validate(PermutedScratch(), torch.randn(4, 3))
    assert_trusted(result)
    assert dict(result.not_replayed) == {"emptypermuted_1_1:1": "uninitialized memory (torch.empty and kin): its "
                                                                "contents are not defined"}


class ReturnsScratch(nn.Module):
    """Returns a buffer of uninitialized memory beside its result, as a kernel wrapper returns its workspace."""

    def forward(self, x):
        return x * 2, torch.empty_like(x)


def test_an_output_of_uninitialized_memory_is_left_out_of_the_output_comparison():
    # The untraced run's buffer held other bits than the traced one's: "outputs equal: False", on a faithful trace.
    result = tl.validate(ReturnsScratch(), torch.randn(64, 64))
    assert result.passed and result.outputs_match, result
    assert result.outputs_differ.startswith("not compared: output.1, uninitialized memory"), result
    alone = tl.validate(lambda x: torch.empty_like(x), torch.randn(64, 64))
    assert alone.status == "nothing to replay" and alone.outputs_match is None, alone
    assert "outputs not compared: output, uninitialized memory" in str(alone)


def test_a_view_of_uninitialized_memory_returned_is_left_out_too():
    # A transpose of the workspace is as undefined as the workspace: its bits differed between the two runs.
    result = tl.validate(lambda x: (x * 2, torch.empty(32, 64).t()), torch.randn(64, 64))
    assert result.passed and result.outputs_match, result
    assert result.outputs_differ.startswith("not compared: output.1, uninitialized memory"), result


def test_a_conversion_of_uninitialized_memory_returned_is_left_out_too():
    # A float16 workspace converted to float32 was compared: its bits differed between the runs, and validate
    # blamed a source of randomness it cannot put back.
    result = tl.validate(lambda x: (x * 2, torch.empty(32, 64, dtype=torch.float16).float()), torch.randn(64, 64))
    assert result.passed and result.outputs_match, result
    assert result.outputs_differ.startswith("not compared: output.1, uninitialized memory"), result


class LegacyNew(nn.Module):
    """Allocates with the legacy ``Tensor.new`` given sizes, as Reformer's LSH attention builds its undo-sort
    index (``idx.new(*idx.size())``, then ``scatter_`` into it), and once given data, which it copies."""

    def forward(self, x):
        index = x.argsort(dim=-1)
        undo = index.new(*index.size())
        undo.scatter_(-1, index, torch.arange(x.shape[-1]).expand_as(index))
        sized = x.new(torch.Size([3, 4]))
        sized.fill_(1.0)
        return x.gather(-1, undo) + x.new([2.0]) + sized.sum()


def test_tensor_new_given_sizes_is_uninitialized_memory_not_a_mismatch():
    # Replayed, Tensor.new(2, 3) made other garbage than the forward's: a MISMATCH on a faithful trace.
    result = tl.validate(LegacyNew(), torch.randn(4, 5))
    assert_trusted(result)
    log = tl.trace(LegacyNew(), torch.randn(4, 5))
    news = [op.label for op in log.ops if op.func_name == "new"]
    assert dict(result.not_replayed) == {news[0]: UNDEFINED, news[1]: UNDEFINED}
    assert news[2] not in dict(result.not_replayed)  # given data, it copies them: replayed


def test_reformer_lsh_attention_validates_without_a_false_mismatch():
    transformers = pytest.importorskip("transformers")
    config = transformers.ReformerConfig(
        hidden_size=32, num_attention_heads=2, attention_head_size=16, feed_forward_size=64, vocab_size=99,
        axial_pos_embds=True, axial_pos_shape=[4, 4], axial_pos_embds_dim=[16, 16], max_position_embeddings=16,
        attn_layers=["local", "lsh"], lsh_attn_chunk_length=4, local_attn_chunk_length=4, num_buckets=2,
        is_decoder=True, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.ReformerModelWithLMHead(config).eval()
    ids = torch.randint(0, 99, (2, 16), generator=torch.Generator().manual_seed(1))
    result = tl.validate(model, (), {"input_ids": ids})
    assert result.outputs_match is True and result.mismatched == [], result
    assert [reason for op, reason in result.not_replayed if reason == UNDEFINED], result


class ResizesAViewWrittenBase(nn.Module):
    """Writes a column block of a fresh tensor through a view, then resizes the tensor to its own size (a no-op
    resize that reads the base the view wrote), and grows another tensor by resizing it."""

    def forward(self, x):
        h = x.clone()
        h.view(3, 2, 4)[:, 0].zero_()
        same = h.resize_as_(h) * 1.5
        grown = x.sum(1).resize_(4) * 0
        return same, grown


@pytest.mark.parametrize("compiled", PATHS)
def test_a_resize_of_a_base_written_through_a_view_is_not_called_growing(compiled):
    # The resize's parent is the view write, whose output (the 6-element view) is smaller than the 24 elements
    # resized: validation said "resize_ grew the tensor", a false reason, rather than the read after the write.
    with on_path(compiled):
        log = tl.trace(ResizesAViewWrittenBase(), torch.randn(3, 8))
    reasons = dict(log.validate().not_replayed)
    assert "it read zero_1_4:1's storage after a write through a view" in reasons["resizeas_1_5:1"]
    assert reasons["resize_1_8:1"].startswith("uninitialized memory: resize_ grew the tensor")
