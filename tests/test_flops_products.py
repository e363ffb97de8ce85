"""FLOPs of the products torch computes in one call that had no formula (their FLOPs were unknown):
``linalg.matrix_power``, ``outer``/``ger``, ``kron``, ``cdist``, ``bilinear``, ``linalg.vecdot`` and ``conv_tbc``,
each beside what FlopCounterMode counts for it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl
from torchlens.report import flops as registry
from accel_paths import PATHS, on_path

from test_flops import native_total


class _Powers(nn.Module):
    """matrix_power over the exponents torch takes each way: 0 (an identity), 1 (a copy), 3 (its fast path), and 7
    and 12 (its binary decomposition), on a batch of matrices."""

    def forward(self, x):
        return [torch.linalg.matrix_power(x, n) for n in (0, 1, 3, 7, 12)] + [x.matrix_power(2)]


@pytest.mark.parametrize("compiled", PATHS)
def test_matrix_power_counts_the_products_torch_runs_for_each_exponent(compiled):
    model, x = _Powers(), torch.randn(2, 4, 4)
    with on_path(compiled):
        log = tl.trace(model, x)
    assert not log.flops.unknown
    ops = [op for op in log.ops if op.func_name == "matrix_power"]
    per_product = 2 * 2 * 4 ** 3
    assert [tl.report.op_flops(op) for op in ops] == [0, 0, 2 * per_product, 4 * per_product,
                                                      4 * per_product, per_product]
    assert int(log.flops) == native_total(model, x)
    result = tl.report.flops_vs_dispatch(model, x)
    assert result.difference == 0 and not result.notes


def test_a_negative_matrix_power_is_unknown_and_the_note_says_why_not_an_unread_shape():
    # The inverse torch runs first is work no formula counts: counting the products alone would read as the whole.
    model = lambda x: torch.linalg.matrix_power(x, -3)  # noqa: E731
    x = torch.randn(3, 3) + 3 * torch.eye(3)
    result = tl.report.flops_vs_dispatch(model, x)
    assert len(result.torchlens_unknown) == 1 and int(result.torchlens_total) == 0
    note = next(note for note in result.notes if "could not count that call" in note)
    assert "negative matrix_power exponent" in note


class _OneKernelProducts(nn.Module):
    """Products torch computes in one ATen kernel FlopCounterMode has no entry for."""

    def __init__(self):
        super().__init__()
        self.bilinear = nn.Bilinear(3, 5, 6)
        self.tbc = nn.Parameter(torch.randn(3, 5, 4))  # conv_tbc's weight: (kernel, in, out)
        self.tbc_bias = nn.Parameter(torch.randn(4))

    def forward(self, x, y):
        # x: (4, 3), y: (4, 5)
        pairs = self.bilinear(x, y)  # (4, 6)
        dots = torch.linalg.vecdot(y[:, None, :], y[None, :1, :], dim=-1)  # (4, 1): the broadcast operand
        by_rows = torch.linalg.vecdot(y.T, y.T, dim=0)  # (4,), summed over a leading dimension
        sequence = torch.conv_tbc(y[:, None, :].repeat(1, 2, 1), self.tbc, self.tbc_bias, 1)  # (4, 2, 4)
        return pairs.sum() + dots.sum() + by_rows.sum() + sequence.sum()


@pytest.mark.parametrize("compiled", PATHS)
def test_bilinear_vecdot_and_conv_tbc_count_their_multiply_adds(compiled):
    model, x, y = _OneKernelProducts(), torch.randn(4, 3), torch.randn(4, 5)
    with on_path(compiled):
        log = tl.trace(model, (x, y))
    assert not log.flops.unknown
    by_name = {}
    for op in log.ops:
        if op.func_name in ("bilinear", "vecdot", "conv_tbc"):
            by_name.setdefault(op.func_name, []).append(registry.op_flops_by_family(op))
    # x W over in1 (3), then that with y over in2 (5), then the bias
    assert by_name["bilinear"] == [{"matmul": 2 * 4 * 6 * 5 * (3 + 1) + 4 * 6}]
    assert by_name["vecdot"] == [{"matmul": 2 * 4 * 5}, {"matmul": 2 * 4 * 5}]
    assert by_name["conv_tbc"] == [{"conv": 2 * (4 * 2 * 4) * 3 * 5 + 4 * 2 * 4}]
    # FlopCounterMode counts nothing inside them: the comparison says so rather than refusing the model.
    result = tl.report.flops_vs_dispatch(model, (x, y))
    assert result.native_total == 0
    note = next(note for note in result.notes if "FlopCounterMode counted 0 inside" in note)
    assert all(name in note for name in ("bilinear", "vecdot", "conv_tbc"))


def test_outer_kron_and_cdist_count_their_elementwise_work():
    x, y = torch.randn(5), torch.randn(7)
    a, b = torch.randn(2, 6, 3), torch.randn(2, 8, 3)
    log = tl.trace(lambda x, y, a, b: [torch.outer(x, y), x.ger(y), torch.kron(a[0], b[1]), torch.cdist(a, b),
                                       torch.cdist(a, b, p=1), torch.cdist(a, b, p=3)], (x, y, a, b))
    assert not log.flops.unknown
    counts = [registry.op_flops_by_family(op) for op in log.ops
              if op.func_name in ("outer", "ger", "kron", "cdist")]
    pairs = 2 * 6 * 8
    assert counts == [{"elementwise": 35}, {"elementwise": 35}, {"elementwise": 6 * 8 * 3 * 3},
                      {"other": pairs * (3 * 3 + 1)}, {"other": pairs * 3 * 3}, {"other": pairs * (4 * 3 + 1)}]


class _Spectral(nn.Module):
    """A spectral layer's complex product between two FFTs, as a Fourier neural operator mixes its modes."""

    def forward(self, x, weight):
        return torch.fft.irfft(torch.fft.rfft(x) @ weight, n=x.shape[-1])


def test_a_complex_product_counts_as_the_real_one_and_as_flop_counter_mode_counts_it():
    x = torch.randn(3, 8)
    weight = torch.randn(5, 5, dtype=torch.complex64)
    log = tl.trace(_Spectral(), (x, weight))
    real = tl.trace(lambda a, b: a @ b, (torch.randn(3, 5), torch.randn(5, 5)))
    assert tl.report.op_flops(log["matmul_1_2:1"]) == tl.report.op_flops(real["matmul_1_1:1"]) == 2 * 3 * 5 * 5
    families = {row["family"]: row for row in tl.report.flops_vs_dispatch(_Spectral(), (x, weight)).families}
    assert families["matmul"]["torchlens"] == families["matmul"]["native"] == 2 * 3 * 5 * 5
