"""Replay under the global settings the forward ran under.

The default dtype, subnormal flushing, the intra-op thread count and oneDNN each change what some op
computes, in its dtype or its low bits.  A forward may change any of them while it runs; replay must run
each op under the setting it ran under, or it would report a faithful trace as differing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from trusted import assert_trusted  # noqa: E402


# ----- the default dtype: factories and Python scalars read it ------------------------------------------
class _DefaultDtypeReaders(nn.Module):
    """Reads the default dtype three ways: a factory, an integer tensor times a float, and a factory
    inside a stretch of the forward that changes the default and puts it back."""

    def forward(self, x):
        steps = torch.arange(x.shape[-1]) * 0.5  # int64 * float: the result takes the default dtype
        ones = torch.ones(x.shape[-1])
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            fine = torch.linspace(0, 1, x.shape[-1]) / 3  # float64 only in this stretch
        finally:
            torch.set_default_dtype(previous)
        return x * ones + steps + fine.float()


def test_replay_runs_under_the_default_dtype_the_forward_ran_under():
    model, x = _DefaultDtypeReaders(), torch.randn(2, 5)
    log = tl.trace(model, x)
    assert log["linspace_1_4"].dtype == torch.float64 and log["mul_1_2"].dtype == torch.float32
    assert_trusted(log.validate())  # the default changed and was put back inside the forward
    torch.set_default_dtype(torch.float64)  # as a notebook might between tracing and validating
    try:
        assert_trusted(log.validate())
        assert_trusted(tl.validate(_DefaultDtypeReaders(), x.double()))  # a whole run under float64
        assert torch.get_default_dtype() == torch.float64  # replay put the user's default back
    finally:
        torch.set_default_dtype(torch.float32)


# ----- subnormals flushed inside the forward: torch has no getter, so no record can say so ------------------
class _FlushesSubnormals(nn.Module):
    """Multiplies into the subnormal range with ``torch.set_flush_denormal(True)`` on, then off again."""

    def forward(self, x):
        torch.set_flush_denormal(True)
        try:
            tiny = x * 1e-30  # subnormal float32: zero while flushing
        finally:
            torch.set_flush_denormal(False)
        return tiny * 1e10 + x * 1e-30


def _flushes_now() -> bool:
    return bool((torch.tensor([1e-40]) * 1.0).eq(0).item())


@pytest.mark.skipif(not torch.set_flush_denormal(False), reason="this CPU cannot flush subnormals")
def test_replay_runs_under_the_subnormal_flushing_the_forward_ran_under():
    model, x = _FlushesSubnormals(), torch.full((4,), 1e-8)
    log = tl.trace(model, x)
    assert torch.equal(log["mul_1_1"].activation, torch.zeros(4))  # flushed as it ran
    assert not torch.equal(log["mul_3_3"].activation, torch.zeros(4))  # kept as it ran
    assert_trusted(log.validate())
    assert not _flushes_now()  # replay put the setting back
    torch.set_flush_denormal(True)  # validating with the setting on: the kept op is tried the other way
    try:
        assert_trusted(log.validate())
        assert _flushes_now()
    finally:
        torch.set_flush_denormal(False)


# ----- the intra-op thread count: a parallel reduction splits its sum by it ---------------------------------
class _SumsOnOneThread(nn.Module):
    """Sums on one thread, as a forward pinning its reductions does, then again on the threads it began with."""

    def forward(self, x):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            pinned = x.sum()
        finally:
            torch.set_num_threads(threads)
        return pinned + x.sum()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: every sum splits the same way")
def test_replay_runs_under_the_thread_count_the_forward_ran_under():
    model, x = _SumsOnOneThread(), torch.randn(4_000_000, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    log = tl.trace(model, x)
    assert not torch.equal(log["sum_1_1"].activation, log["sum_2_2"].activation)  # the split shows in the bits
    assert_trusted(log.validate())
    torch.set_num_threads(1)  # as a user might between tracing and validating
    try:
        assert_trusted(log.validate())
        assert torch.get_num_threads() == 1  # replay put the user's count back
    finally:
        torch.set_num_threads(threads)


# ----- oneDNN kernels on or off: a convolution computes other low bits without them -------------------------
class _ConvWithoutOneDNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 32, 3)

    def forward(self, x):
        with torch.backends.mkldnn.flags(enabled=False):
            plain = self.conv(x)
        return plain + self.conv(x)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN kernels in this build")
def test_replay_runs_under_the_onednn_setting_the_op_ran_under():
    torch.manual_seed(0)
    model, x = _ConvWithoutOneDNN(), torch.randn(4, 16, 32, 32)
    log = tl.trace(model, x)
    assert not torch.equal(log["conv2d_1_1:1"].activation, log["conv2d_1_1:2"].activation)  # the kernels differ
    assert_trusted(log.validate())
    with torch.backends.mkldnn.flags(enabled=False):  # a whole trace without them, validated with them
        whole = tl.trace(model.conv, x)
    assert torch.backends.mkldnn.enabled
    assert_trusted(whole.validate())
    assert torch.backends.mkldnn.enabled  # replay put the setting back
