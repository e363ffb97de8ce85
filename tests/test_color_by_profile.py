"""Colouring a graph by a kernel profile's times: device time where the profile recorded device activity, the
profiler's self CPU time where it did not; a CPU-only profile has no device time, and asking for it is refused,
naming the CPU time it does have, rather than drawn all grey or read as None per op."""

import json
import os
import re
import sys

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.capture.session import trace_with_markers
from torchlens.report.kernel_profiling import KernelProfile
from torchlens.report.markers import ProfilerMarkers, parse_marker
from torchlens.report.profile_events import events_from_chrome, load_chrome
from torchlens.viz.metrics import UNKNOWN_FILL, format_seconds

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
from make_kernel_fixture import FIXTURE, fixture_model  # noqa: E402

NO_DEVICE = r"a CPU-only run .*color_by='cpu_time', cpu_times=<the kernel profile>"


@pytest.fixture(scope="module")
def cpu_profile():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return tl.report.kernel_profile(model, torch.randn(4, 8))


@pytest.fixture(scope="module")
def device_profile():
    """A profile joined from the CUDA-shaped fixture: real host events, device kernels as Kineto records them."""
    events = events_from_chrome(load_chrome(FIXTURE))
    run = next(parse_marker(e.name)[1] for e in events if parse_marker(e.name))
    model, x = fixture_model()
    markers = ProfilerMarkers(run=run)
    trace = trace_with_markers(model, x, None, markers, save="none")
    return KernelProfile(trace, None, markers, borrowed=False, backward=True, events=events)


def _node_lines(dot, trace) -> dict:
    """``{op label: its node's line}`` for the ops of ``trace``."""
    return {op.label: re.search(rf"^\s*o{op.index} \[.*$", dot, re.M).group(0) for op in trace.ops
            if op.kind == "op"}


def test_device_time_of_a_cpu_only_profile_is_refused_naming_the_cpu_time(cpu_profile):
    # Every op was drawn grey ("unknown"), the legend saying only that no op had a value.
    log = cpu_profile.trace
    assert not cpu_profile.has_device
    with pytest.raises(ValueError, match=r"device_times= is a kernel profile of " + NO_DEVICE):
        log.render(format="dot", color_by="device_time", device_times=cpu_profile)
    built = {row["op"]: row["device_ns"] / 1e9 for row in cpu_profile.ops if row["device_ns"] is not None}
    with pytest.raises(ValueError, match=r"device_times= is empty: no op has a device time.*" + NO_DEVICE):
        log.render(format="dot", color_by=built)


def test_a_cpu_only_profiles_device_time_of_an_op_is_refused_not_none(cpu_profile):
    # kp.device_time(label) was None on every op, as if that op alone had not been measured.
    with pytest.raises(ValueError, match=r"no device time for 'linear_1_1:1': this profile recorded no device "
                                         r"activity \(a CPU-only run.*profile\[label\]\['cpu_ns'\]"):
        cpu_profile.device_time("linear_1_1:1")
    with pytest.raises(KeyError, match="no op, layer or module call 'linear_9:1'"):  # a wrong label says so first
        cpu_profile.device_time("linear_9:1")


def test_cpu_time_colours_each_op_by_the_profilers_self_cpu_time(cpu_profile):
    log = cpu_profile.trace
    dot = log.render(format="dot", color_by="cpu_time", cpu_times=cpu_profile)
    assert "profiler self CPU time per op" in dot and "not device time" in dot
    lines = _node_lines(dot, log)
    rows = cpu_profile.ops
    assert len(rows) == len(lines) == 3
    for row in rows:
        assert format_seconds(row["cpu_ns"] / 1e9) in lines[row["op"]]
        assert UNKNOWN_FILL not in lines[row["op"]]
    costliest = max(rows, key=lambda row: row["cpu_ns"])["op"]
    assert 'fillcolor="#8c2d04"' in lines[costliest]  # the top of the scale
    page = log.render(format="html", color_by="cpu_time", cpu_times=cpu_profile)
    items = json.loads(re.search(r'<script type="application/json" id="tl-data">(.*?)</script>', page, re.S).group(1))
    for row in rows:  # the record panel shows it too
        assert items["items"][f"o{log[row['op']].index}"]["cpu_time"] == format_seconds(row["cpu_ns"] / 1e9)


def test_a_profile_with_device_activity_colours_by_its_device_time(device_profile):
    log = device_profile.trace
    assert device_profile.has_device
    lines = _node_lines(log.render(format="dot", color_by="device_time", device_times=device_profile), log)
    for row in device_profile.ops:
        assert row["device_ns"] > 0 and device_profile.device_time(row["op"]) == row["device_ns"]
        assert format_seconds(row["device_ns"] / 1e9) in lines[row["op"]]


def test_times_for_another_metric_or_measuring_no_op_are_refused(cpu_profile):
    log = cpu_profile.trace
    # Times given beside another color_by coloured by that metric, the times unread, without a word.
    with pytest.raises(ValueError, match=r"cpu_times= colors the graph only with color_by='cpu_time'"):
        log.render(format="dot", color_by="device_time", cpu_times=cpu_profile)
    with pytest.raises(ValueError, match=r"device_times= colors the graph only with color_by='device_time'"):
        log.render(format="dot", color_by="flops", device_times={"linear_1_1:1": 1e-3})
    with pytest.raises(ValueError, match=r"color_by='cpu_time' needs cpu_times=, a mapping of op label"):
        log.render(format="dot", color_by="cpu_time")
    with pytest.raises(ValueError, match=r"render: cpu_times\['linear_1_1:1'\]=-1\.0 is negative; give the op's "
                                         r"self CPU time in seconds"):
        log.render(format="dot", color_by="cpu_time", cpu_times={"linear_1_1:1": -1.0})


def test_a_backward_only_profile_has_no_forward_time_to_colour_by():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh())
    log = tl.trace(model, torch.randn(2, 8), grads=True)
    profile = tl.report.kernel_profile(log, backward=True)
    with pytest.raises(ValueError, match=r"the kernel profile passed as cpu_times= measured no forward op's self "
                                         r"CPU time \(a backward-only profile measures no forward"):
        log.render(format="dot", color_by="cpu_time", cpu_times=profile)
