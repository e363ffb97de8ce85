"""``nonfinite_origin`` and uninitialized memory a call then writes whole.

``torch.empty`` and kin hold whatever bits the memory held, so a NaN in them, or in a write into part of them,
is no evidence.  A call that writes every element of such an allocation (``copy_``, ``fill_``, a collective
such as ``dist.all_gather`` into ``empty_like`` buffers) leaves values as defined as what it read: a NaN there
was made or carried by that call, and is evidence.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

import torchlens as tl


@contextlib.contextmanager
def nan_filled_empties():
    """``torch.empty`` and kin filled with NaN (deterministic algorithms fill them so), not with chance bits."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)


def funcs(log, labels) -> list:
    return [log[label].func_name for label in labels]


class HalfCache(nn.Module):
    """Keys written into a preallocated float16 cache, as generation loops keep them."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        keys = self.proj(x) * 1e5  # finite in float32, beyond float16's range
        cache = torch.empty(keys.shape, dtype=torch.float16)
        cache.copy_(keys)  # overflows to Inf here
        return cache.float().softmax(-1)


def test_a_copy_into_a_whole_empty_tensor_that_overflows_is_the_origin():
    torch.manual_seed(0)
    model, x = HalfCache().eval(), torch.randn(2, 4)
    for options in ({}, {"save": "none", "record_finite": True}):
        with nan_filled_empties():
            log = tl.trace(model, x, **options)
        report = tl.debug.nonfinite_origin(log)
        assert report.origin.func_name == "copy_" and report.kind == "inf" and report.certain
        assert funcs(log, report.uninitialized) == ["empty"]  # the NaN it held, overwritten unread


def test_a_write_into_part_of_an_empty_tensor_is_still_no_evidence():
    def partial(x):
        buf = torch.empty(2, 4)
        buf[:, :2].copy_(torch.log(x))  # the other half of buf is never written
        return buf.sum(-1)

    with nan_filled_empties():
        log = tl.trace(partial, -torch.ones(2, 2))
    report = tl.debug.nonfinite_origin(log)
    assert report.origin.func_name == "log" and report.certain
    assert funcs(log, report.uninitialized) == ["empty", "__getitem__", "copy_"]


def test_copying_uninitialized_memory_into_a_tensor_leaves_it_undefined():
    def copied(x):
        y = x.clone()
        y.copy_(torch.empty_like(x))  # what the allocator left: NaN under deterministic algorithms
        return y + 1

    with nan_filled_empties():
        log = tl.trace(copied, torch.ones(2, 2))
    report = tl.debug.nonfinite_origin(log)
    assert funcs(log, report.uninitialized) == ["empty_like", "copy_"]
    assert report.origin.func_name == "add" and not report.certain


def _gathered(x):
    h = torch.log(x)  # NaN where x < 0
    parts = [torch.empty_like(h) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, h)  # writes each buffer whole
    return torch.cat(parts).relu()


def test_an_all_gather_into_empty_buffers_carries_the_nan_as_evidence():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with nan_filled_empties():
            log = tl.trace(_gathered, torch.tensor([-1.0, 2.0]))
    finally:
        dist.destroy_process_group()
    report = tl.debug.nonfinite_origin(log)
    assert report.origin.func_name == "log" and report.certain and funcs(log, report.uninitialized) == ["empty_like"]
    assert funcs(log, report.propagators) == ["all_gather", "cat", "relu"]
