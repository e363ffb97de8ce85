"""``nonfinite_origin`` and uninitialized memory a call then writes whole.

``torch.empty`` and kin hold whatever bits the memory held, so a NaN in them, or in a write into part of them,
is no evidence.  A call that writes every element of such an allocation (``copy_``, ``fill_``, a call given it
as ``out=``, a collective such as ``dist.all_gather`` into ``empty_like`` buffers) leaves values as defined as
what it read: a NaN there was made or carried by that call, and is evidence.
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


class HalfScores(nn.Module):
    """Scores scaled into a preallocated float16 buffer through out=."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x).half()
        scores = torch.empty_like(h)
        torch.mul(h, 1e5, out=scores)  # beyond float16's range: overflows to Inf here
        return scores.float().softmax(-1)


def test_a_call_writing_its_whole_result_into_an_empty_out_tensor_is_the_origin():
    # The out= call was taken for a write into part of the allocation: its Inf was set aside as no evidence, and
    # the softmax after it was reported as not certain, with torch.empty_like among its possible origins.
    torch.manual_seed(0)
    model, x = HalfScores().eval(), torch.randn(2, 4)
    for options in ({}, {"save": "none", "record_finite": True}):
        with nan_filled_empties(), torch.no_grad():  # out= takes no tensor that requires grad
            log = tl.trace(model, x, **options)
        report = tl.debug.nonfinite_origin(log)
        assert report.origin.func_name == "mul" and report.kind == "inf" and report.certain
        assert funcs(log, report.uninitialized) == ["empty_like"]  # the NaN it held, overwritten unread


def test_an_out_tensor_the_call_also_reads_stays_no_evidence():
    def reread(x):
        buf = torch.empty_like(x)
        torch.add(buf, 1, out=buf)  # adds 1 to whatever bits buf held
        return buf * x

    with nan_filled_empties():
        log = tl.trace(reread, torch.ones(2, 2))
    report = tl.debug.nonfinite_origin(log)
    assert report.origin.func_name == "mul" and not report.certain
    assert funcs(log, report.uninitialized) == ["empty_like", "add"]


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


def test_a_read_after_a_finite_write_into_part_of_an_empty_tensor_is_no_certain_origin():
    # The write's own value (the half it wrote) is finite, and the op reading the whole tensor names the write as
    # its parent: it was reported as a certain origin of the NaN the unwritten half held, "from finite inputs".
    def partial(x):
        buf = torch.empty(2, 4)
        buf[:, :2].copy_(x)
        return buf * 2

    with nan_filled_empties():
        log = tl.trace(partial, torch.ones(2, 2))
    report = tl.debug.nonfinite_origin(log)
    assert report.origin.func_name == "mul" and not report.certain
    assert funcs(log, report.uninitialized) == ["empty", "__getitem__", "copy_"]
    assert set(report.uninitialized) <= set(report.possible_origins)


def test_uninitialized_memory_converted_to_another_dtype_stays_no_evidence():
    # .float() of a torch.empty was taken for a defined value: the NaN it converted was named the first non-finite
    # op's, produced by the conversion, while only the allocation was set aside as no evidence.
    def converted(x):
        buf = torch.empty(2, 4, dtype=torch.float16).float()
        buf[:, :2] = x  # the other half is never written
        return buf.sum(-1)

    def typed_as(x):
        buf = torch.empty(2, 2)
        return torch.log(x).type_as(buf) + 1  # reads buf's dtype alone: the log's NaN is still evidence

    with nan_filled_empties():
        log, typed = tl.trace(converted, torch.ones(2, 2)), tl.trace(typed_as, -torch.ones(2, 2))
    report = tl.debug.nonfinite_origin(log)
    assert funcs(log, report.uninitialized) == ["empty", "float", "__setitem__"] and not report.certain
    assert report.origin.func_name == "sum" and report.possible_origins == report.uninitialized
    report = tl.debug.nonfinite_origin(typed)
    assert report.origin.func_name == "log" and report.certain and funcs(typed, report.uninitialized) == ["empty"]


def test_a_value_shaped_after_uninitialized_memory_is_still_evidence():
    # x.view_as(buf) reads buf's shape alone, yet was set aside as uninitialized memory like buf itself.
    def shaped(x):
        buf = torch.empty(2, 2)
        return torch.log(x).view_as(buf) + 1

    with nan_filled_empties():
        log = tl.trace(shaped, -torch.ones(4))
    report = tl.debug.nonfinite_origin(log)
    assert report.origin.func_name == "log" and report.certain and funcs(log, report.uninitialized) == ["empty"]
    assert funcs(log, report.propagators) == ["view_as", "add"]


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


def test_the_advice_for_an_uninitialized_possible_origin_is_to_fill_it_not_to_record_flags():
    # The report called such values unexamined and advised record_finite=True, which examines them again to no
    # more effect: they were examined, and set aside as uninitialized memory.
    def copied(x):
        y = x.clone()
        y.copy_(torch.empty_like(x))
        return y + 1

    with nan_filled_empties():
        report = tl.debug.nonfinite_origin(tl.trace(copied, torch.ones(2, 2), save="none", record_finite=True))
    assert report.possible_origins == report.uninitialized and not report.certain
    assert "record_finite" not in str(report) and "not examined or uninitialized" in str(report)
    assert "copy_1_3:1 held uninitialized memory (torch.empty and kin)" in str(report)


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
