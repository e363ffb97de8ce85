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
