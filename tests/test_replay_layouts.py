"""Replay hands each op copies of its inputs laid out as the forward's were, so a kernel whose order of
work follows the strides (a reduction) gives the same bits."""

import pytest
import torch
import torch.nn as nn

import torchlens as tl


class _ExpandedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.randn(4) * 0.1)

    def forward(self, x):
        return x * self.scale.expand(3, 4).sum()


def test_a_reduction_over_an_expanded_tensor_replays_exactly():
    # An expanded tensor's elements overlap: a copy element by element cannot be made, and a contiguous
    # copy sums its twelve values in another order than the forward summed them.
    torch.manual_seed(0)
    result = tl.validate(_ExpandedBuffer(), torch.randn(3, 4))
    assert result.passed and result.replayed == 3, result

    def forward(x):
        y = x.expand(3, 4)
        return y.sum() + y.mean(0).sum(), torch.cumsum(y, 1)

    for _ in range(5):
        result = tl.validate(forward, torch.randn(4).requires_grad_())
        assert result.passed and result.replayed == 6, result


def test_an_op_that_wrote_memory_another_of_its_arguments_reads_is_not_replayed():
    # What such a call makes depends on the order its kernel read and wrote: replay, on separate copies of
    # its arguments, would report a mismatch the forward never had.
    def out_into_its_input(x):
        a = x.sigmoid()
        torch.addmm(x, a, torch.eye(4), out=torch.as_strided(a, (3, 4), (4, 1)))
        return a * 1

    def two_names_for_one_tensor(x):
        a = x * 1.0
        torch._foreach_add_([a, torch.as_strided(a, (3, 4), (4, 1))], 1.0)
        return a * 2

    for forward, writer, reader in ((out_into_its_input, "addmm_1_4:1", "sigmoid_1_1:1"),
                                    (two_names_for_one_tensor, "foreachadd_1_3:1", "mul_1_1:1")):
        result = tl.validate(forward, torch.randn(3, 4))
        assert result.status == "passed", result
        assert f"{writer}: it read {reader}'s storage after a write through a view (or while writing it" in str(result)


class _WritesOneElementOfAnExpandedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.randn(4) * 0.1)

    def forward(self, x):
        grid = self.scale.expand(3, 4)
        grid[0, 0] = 3.0  # one element of scale: every row shows it
        return x * grid


def test_a_saved_expanded_tensor_copied_before_a_write_keeps_its_layout():
    # Copy-on-write keeps the expanded layout, so the write's replay reaches every row as it did.
    torch.manual_seed(0)
    model, x = _WritesOneElementOfAnExpandedBuffer(), torch.randn(3, 4)
    log = tl.trace(model, x)
    assert log["expand_1_1:1"].activation.stride() == (0, 1)  # still four values, shown in every row
    assert torch.equal(log["setitem_1_2:1"].activation[:, 0], torch.full((3,), 3.0))
    result = log.validate()
    assert result.passed and result.replayed == 3, result


class _AdjointProjection(nn.Module):
    def forward(self, z, y):
        return z.mH @ y.mT


def _conjugate_inputs() -> tuple:
    """``(z, y)`` whose product through the lazy conjugate ``z.mH`` and through its written-out copy differ in
    their bits.  Which sizes do depends on the CPU's BLAS kernels (3 x 3 on some, 8 x 8 on others)."""
    for n in (3, 8, 16, 32):
        torch.manual_seed(0)
        z, y = torch.randn(n, n, dtype=torch.complex64), torch.randn(2, n, dtype=torch.complex64)
        if not torch.equal(z.mH @ y.mT, z.mH.resolve_conj() @ y.mT):
            return z, y
    pytest.skip("this CPU's BLAS rounds the two products alike at every size tried: nothing to tell apart")


def test_a_matmul_reading_a_conjugate_view_replays_exactly():
    # ``z.mH`` is a lazy conjugate (a bit, not conjugated values), and matmul hands it to BLAS as such; a copy
    # written out holds the conjugated values, whose product rounds differently: replay reported a mismatch.
    z, y = _conjugate_inputs()
    result = tl.validate(_AdjointProjection(), (z, y))
    assert result.passed and not result.mismatched and result.replayed == 3, result


class _EvenSimilarity(nn.Module):
    def forward(self, a, b):
        return torch.dot(a, b)


def test_an_input_strided_with_gaps_is_copied_with_its_strides_for_the_untraced_run():
    # tl.validate's untraced reference ran on a contiguous clone of ``x[::2]``, whose dot product sums in
    # another order: "outputs equal an untraced run: False" for a faithful trace.
    torch.manual_seed(0)
    a, b = torch.randn(2000)[::2], torch.randn(1000)
    assert not torch.equal(torch.dot(a, b), torch.dot(a.clone(), b))  # the two layouts differ in their bits here
    result = tl.validate(_EvenSimilarity(), (a, b))
    assert result.passed and result.outputs_match, result
