"""Several kernel profiles taken inside one borrowed profiler: each keeps to its own run, and lists the other
runs' work, forward and backward, as work outside its profile."""

import torch
import torch.nn as nn

import torchlens as tl


def test_another_profiles_backward_in_one_borrowed_profiler_is_outside_this_one():
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), torch.randn(2, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        first = tl.report.kernel_profile(model, x, profiler=prof, backward=True)
        second = tl.report.kernel_profile(model, x, profiler=prof, backward=True)
    for one, other in ((first, second), (second, first)):
        assert one.complete and [r["bwd_aten_ops"] > 0 for r in one.ops] == [True, True]
        # The other run's grad nodes were not made by a node of this run's backward without an op: they ran
        # on this thread outside this run's phases, as its forward did.
        assert "backward_without_op" not in one.coverage.host_unattributed
        other_work = sum(r["aten_ops"] + r["bwd_aten_ops"] for r in other.ops)
        assert one.coverage.host_unattributed["outside_profile"][0] >= other_work


def _aten_and_runtime_events(prof) -> int:
    """The profiler's own count of aten ops and runtime calls: its events less torchlens's ranges."""
    kinds = ("cpu_op", "cuda_runtime", "cuda_driver")
    return sum(1 for e in prof.profiler.kineto_results.events()
               if e.activity_type() in kinds and not e.name().startswith("torchlens::"))


def test_another_profiles_ranges_are_not_counted_as_work_in_this_one():
    # Each profile counted the other's op and module ranges as aten ops outside its own profile, with their
    # self time, which is that run's capture in Python: a forward-only profile beside one with a backward
    # counted 1645 host events and 7.2 ms in GPT-2 where the other counted 1644 and 6.8 ms of the same profiler.
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(2, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        first = tl.report.kernel_profile(model, x, profiler=prof)
        second = tl.report.kernel_profile(model, x, profiler=prof, backward=True)
    events = _aten_and_runtime_events(prof)
    assert first.coverage.host_events == second.coverage.host_events == events
    assert first.coverage.host_ns == second.coverage.host_ns
