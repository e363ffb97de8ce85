"""tl.report.kernel_profile: the id join on real CPU profiler output, and the device path on a fixture (the join's
rules on constructed events are tests/test_profile_join.py)."""

import json
import os
import pathlib
import warnings
import sys

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.capture.session import trace_with_markers
from torchlens.report.kernel_profiling import KernelProfile, ProfilerBusyError
from torchlens.report.markers import ProfilerMarkers, parse_marker
from torchlens.report.profile_events import events_from_chrome, events_from_profiler, load_chrome
from torchlens.report.profile_join import join, union_ns

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
from make_kernel_fixture import FIXTURE, fixture_model  # noqa: E402
from zoo import zoo  # noqa: E402


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(4, 8)


def _no_capture_left():
    from torch.nn.modules import module as nn_module

    assert not nn_module._global_forward_pre_hooks and not nn_module._global_forward_hooks
    assert torch._C._len_torch_function_stack() == 0
    assert torch.overrides.has_torch_function is torch._C._has_torch_function
    assert not torch._C._autograd._profiler_enabled()


# ----- CPU: real profiler output ----------------------------------------------------------------
def test_cpu_join_lands_aten_ops_on_their_ops():
    model, x = mlp()
    kp = tl.report.kernel_profile(model, x, backward=True)
    assert kp.complete, kp.coverage.problems
    rows = {r["op"]: r for r in kp.ops}
    assert list(rows) == ["linear_1_1:1", "relu_1_2:1", "linear_2_3:1"]
    assert rows["linear_1_1:1"]["aten"] == ["aten::linear"]
    assert rows["relu_1_2:1"]["aten"] == ["aten::relu"]
    for row in rows.values():
        assert row["cpu_ns"] > 0 and row["bwd_cpu_ns"] > 0 and row["host_ns"] >= row["cpu_ns"]
        # No device activity was recorded: unknown, not zero.
        assert row["device_ns"] is None and row["kernels"] is None and row["bwd_device_ns"] is None
    cov = kp.coverage
    assert cov.device_busy_ns is None and cov.device_fraction is None
    assert 0 < cov.host_attributed_ns <= cov.host_ns
    assert "backward_outside_nodes" in cov.host_unattributed  # the all-ones seed of the backward
    text = str(kp)
    assert "linear_1_1:1" in text and "n/a" in text and "join complete" in text


def test_an_unknown_label_names_the_closest_ones():
    model, x = mlp()
    kp = tl.report.kernel_profile(model, x)
    with pytest.raises(KeyError, match=r"'linear_1_1:2' in this profile; closest: linear_1_1:1"):
        kp["linear_1_1:2"]
    with pytest.raises(KeyError, match=r"'0' in this profile; closest: 0:1"):
        kp["0"]
    assert kp["0:1"]["module_call"] == "0:1"


def test_cpu_times_equal_torch_own_parent_walk():
    """Second route over the same profiler data: torch's FunctionEvent parents up to our op markers."""
    model, x = mlp()
    kp = tl.report.kernel_profile(model, x)
    by_marker: dict = {}
    for event in kp.profiler.events():
        parsed = parse_marker(event.name)
        if parsed is not None:
            continue
        parent = event.cpu_parent
        while parent is not None and not (parse_marker(parent.name) or ("",))[0] == "op":
            parent = parent.cpu_parent
        if parent is not None:
            by_marker[parent.name] = by_marker.get(parent.name, 0.0) + event.self_cpu_time_total
    serial_of_call = {c: s for s, c in kp.markers.resolve_calls(len(kp.trace._calls)).items()}
    for c, row in enumerate(kp.ops):
        theirs_us = by_marker[kp.markers.op_name(serial_of_call[c])]
        assert abs(row["cpu_ns"] / 1000 - theirs_us) <= 0.01 * row["aten_ops"] + 0.01


@pytest.mark.parametrize("name", ["small_cnn", "multi_output", "shared_module", "recurrent", "branchy"])
def test_zoo_rollups_are_consistent(name):
    model, args, kwargs = zoo(0)[name]
    kp = tl.report.kernel_profile(model, args, kwargs)
    assert kp.complete, kp.coverage.problems
    ops = kp.ops
    assert len(ops) == len(kp.trace._calls)
    assert all(r["host_ns"] is not None and r["cpu_ns"] is not None for r in ops)
    # Each call is one row: the extra outputs of multi-output calls are listed, never double counted.
    listed = [r["op"] for r in ops] + [label for r in ops for label in r["outputs"]]
    assert sorted(listed) == sorted(op.label for op in kp.trace.ops if op.kind == "op")
    layers = kp.layers
    assert sum(r["cpu_ns"] for r in layers) == sum(r["cpu_ns"] for r in ops)
    modules = {r["module_call"]: r for r in kp.module_calls}
    for mc in kp.trace.module_calls:
        row = modules[mc.label]
        children = sum(modules[ch.label]["cpu_ns"] for ch in mc.children)
        assert row["cpu_ns"] == row["self_cpu_ns"] + children
        assert row["ops"] == len(mc.ops)
    root_ops = sum(r["cpu_ns"] for r in ops if r["module"] is None)
    top = sum(modules[mc.label]["cpu_ns"] for mc in kp.trace.module_calls if mc.parent is None)
    direct = sum(r["self_cpu_ns"] for r in modules.values()) - sum(r["cpu_ns"] for r in ops if r["module"])
    assert top + root_ops == sum(r["cpu_ns"] for r in ops) + direct
    if name == "small_cnn":
        assert any("aten::conv2d" in r["aten"] for r in ops if r["type"] == "conv2d")
    frame = kp.to_pandas("op")
    assert list(frame["op"]) == [r["op"] for r in ops]
    if kp.trace.module_calls:
        frame = kp.to_pandas("module")
        assert list(frame["module_call"]) == [mc.label for mc in kp.trace.module_calls]


def test_work_of_calls_that_are_not_ops_is_named_not_hidden():
    class Checks(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            if torch.equal(y, y):  # a torch call returning a bool: profiled, but not an op
                y = y + 1
            return y

    kp = tl.report.kernel_profile(Checks(), torch.randn(2, 4))
    assert kp.complete, kp.coverage.problems
    assert [r["op"] for r in kp.ops] == ["linear_1_1:1", "add_1_2:1"]
    events, ns = kp.coverage.host_unattributed["call_without_op"]
    assert events >= 1 and ns > 0
    assert kp.coverage.host_attributed_ns == sum(r["cpu_ns"] for r in kp.ops)


def test_backward_lands_on_the_op_that_created_the_grad_node():
    # In train mode BatchNorm first bumps its step counter in place (an add_ that records the same
    # autograd sequence number as the batch_norm after it, but creates no grad node).
    model, args, kwargs = zoo(0)["batchnorm_train"]
    kp = tl.report.kernel_profile(model, args, kwargs, backward=True)
    assert kp.complete, kp.coverage.problems
    rows = kp.ops
    counters = [r for r in rows if r["type"] == "add" and r["module"] and "bn" in r["module"]]
    norms = [r for r in rows if r["type"] == "batchnorm"]
    assert norms and counters
    assert all(r["bwd_cpu_ns"] > 0 and r["bwd_aten_ops"] > 0 for r in norms)
    assert all(r["bwd_cpu_ns"] == 0 and r["bwd_aten_ops"] == 0 for r in counters)
    assert "backward_without_op" not in kp.coverage.host_unattributed


@pytest.mark.parametrize("how", ["model", "lambda", "own loss"])
def test_a_profiled_backward_leaves_the_parameters_grads_as_they_were(how):
    """A profile taken between training steps must not add its all-ones (or its own loss's) gradient into
    the ``.grad`` the next optimizer step reads: each parameter keeps the same tensor with the same values."""
    model, x = mlp()
    nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 3])).backward()  # a training step's gradients
    model[2].bias.grad = None  # and one parameter without any
    before = [p.grad for p in model.parameters()]
    values = [None if g is None else g.clone() for g in before]
    target, backward = {"model": (model, True), "lambda": (lambda t: model(t) * 1, True),
                        "own loss": (model, lambda out: out.pow(2).mean().backward())}[how]
    kp = tl.report.kernel_profile(target, x, backward=backward)
    assert all(r["bwd_cpu_ns"] > 0 for r in kp.ops if r["type"] == "linear")  # the backward did run
    for p, g, v in zip(model.parameters(), before, values):
        assert p.grad is g and (v is None or torch.equal(p.grad, v))


def test_a_loaded_trace_is_refused_for_a_backward_profile_as_loaded(tmp_path):
    """A trace read from disk has no live output to run a backward from: the refusal says so, whether or not
    it was taken with gradients (not that it was "captured without gradients")."""
    model, x = mlp()
    for grads in (False, True):
        loaded = tl.load(tl.trace(model, x, grads=grads).save(tmp_path / f"t{grads}"))
        with pytest.raises(ValueError, match="loaded from disk"):
            tl.report.kernel_profile(loaded, backward=True)


def test_a_trace_without_a_backward_to_profile_is_refused_saying_what_to_pass():
    """kernel_profile(trace) runs the trace's backward itself.  A trace taken without gradients was told to "run a
    backward through log.output" first, which leaves nothing to profile; one whose backward already ran failed
    with torch's "Trying to backward through the graph a second time"."""
    model, x = mlp()
    refused = r"kernel_profile\(trace\).*grads=True.*before its backward"
    with pytest.raises(tl.errors.GradientUnavailable, match=refused):
        tl.report.kernel_profile(tl.trace(model, x), backward=True)
    log = tl.trace(model, x, grads=True)
    log.output.sum().backward()
    with pytest.raises(RuntimeError, match=r"backward already ran.*tl\.trace\(model, x, grads=True\)"):
        tl.report.kernel_profile(log, backward=True)
    _no_capture_left()


def test_in_memory_and_chrome_readers_agree(tmp_path):
    model, x = mlp()
    kp = tl.report.kernel_profile(model, x, backward=True, chrome_trace=tmp_path / "run.json")
    memory = events_from_profiler(kp.profiler)
    chrome = events_from_chrome(load_chrome(tmp_path / "run.json"))

    def key(e):
        return (e.name, e.category, e.start, e.end, e.external_id, e.seq, e.backward)

    assert sorted(map(key, memory)) == sorted(map(key, chrome))
    a, b = join(memory, kp.markers.run), join(chrome, kp.markers.run)
    assert a.op_forward == b.op_forward and a.op_backward == b.op_backward
    assert a.host_unattributed == b.host_unattributed


# ----- native chrome trace + sidecar --------------------------------------------------------------
def test_native_trace_is_torchs_own_export_and_sidecar_ids_resolve(tmp_path, monkeypatch):
    model, x = mlp()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    kp = tl.report.kernel_profile(model, x, backward=True, chrome_trace="run.json")
    monkeypatch.chdir(tmp_path / "b")
    kp.profiler.export_chrome_trace("run.json", use_python_export=True)  # torch, a second time
    native = (tmp_path / "a" / "run.json").read_bytes()
    assert native == (tmp_path / "b" / "run.json").read_bytes()

    sidecar = json.loads((tmp_path / "a" / "run.json.torchlens.json").read_text())
    data = json.loads(native)
    names = {e["name"] for e in data["traceEvents"] if e.get("ph") == "X"}
    host_ids = {e["args"]["External id"] for e in data["traceEvents"]
                if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
                and "External id" in e.get("args", {})}
    assert set(sidecar["markers"]) <= names
    assert {int(k) for k in sidecar["external_ids"]} <= host_ids
    assert set(sidecar["marker_external_ids"].values()) <= host_ids
    labels = {op.label for op in kp.trace.ops}
    mapped_ops = {v["op"] for v in sidecar["external_ids"].values() if "op" in v}
    assert mapped_ops == {r["op"] for r in kp.ops} and mapped_ops <= labels
    assert {v["phase"] for v in sidecar["external_ids"].values() if "phase" in v} == {"forward", "backward"}
    op_markers = [k for k, v in sidecar["markers"].items() if v["kind"] == "op"]
    assert len(op_markers) == len(kp.ops)
    assert sidecar["complete"] is True and "Kineto" in sidecar["clock"]


# ----- borrowed mode and bad input ----------------------------------------------------------------
def test_borrowed_profiler_joins_after_the_user_closes_it(tmp_path):
    model, x = mlp()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(8, 8).mm(torch.randn(8, 8))  # the user's own work, outside the traced forward
        kp = tl.report.kernel_profile(model, x, profiler=prof)
        with pytest.raises(RuntimeError, match="leave its `with` block"):
            kp.ops
        assert "pending" in repr(kp)
    assert kp.borrowed and kp.complete, kp.coverage.problems
    assert [r["aten"] for r in kp.ops] == [["aten::linear"], ["aten::relu"], ["aten::linear"]]
    assert kp.coverage.host_unattributed["outside_profile"][0] >= 3  # randn, randn, mm
    path, sidecar = kp.export_chrome_trace(tmp_path / "borrowed.json")
    assert os.path.exists(path) and os.path.exists(sidecar)


def test_two_profiles_in_one_borrowed_profiler_stay_apart():
    model, x = mlp()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        first = tl.report.kernel_profile(model, x, profiler=prof)
        second = tl.report.kernel_profile(model, x, profiler=prof)
    assert first.markers.run != second.markers.run
    assert first.complete and second.complete
    # Each sees the other's forward as work outside its own profile, on the same thread.
    outside = first.coverage.host_unattributed["outside_profile"][0]
    assert outside >= sum(r["aten_ops"] for r in second.ops)


@pytest.mark.filterwarnings("ignore:.*(warmup|cycle).*:UserWarning")
def test_markers_outside_the_recorded_window_make_an_incomplete_join():
    model, x = mlp()
    # Two one-step cycles: the profile runs in the first; the profiler then holds the second's events.
    schedule = torch.profiler.schedule(wait=0, warmup=0, active=1, repeat=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                on_trace_ready=lambda p: None) as prof:
        kp = tl.report.kernel_profile(model, x, profiler=prof)
        prof.step()
        torch.ones(3).sum()
        prof.step()
    assert not kp.complete
    assert any("op markers are missing" in p for p in kp.coverage.problems)
    assert all(r["cpu_ns"] is None and r["host_ns"] is None for r in kp.ops)
    assert "INCOMPLETE" in str(kp)


@pytest.mark.filterwarnings("ignore:.*(warmup|cycle).*:UserWarning")
def test_a_schedule_that_skips_the_only_step_is_refused_before_the_model_runs():
    model, x = mlp()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    schedule = torch.profiler.schedule
    for skipping in (schedule(wait=1, warmup=0, active=1), schedule(wait=0, warmup=1, active=1)):
        with pytest.raises(ValueError, match="does not record the profiler's first step"):
            tl.report.kernel_profile(model, x, profiler_kwargs={"schedule": skipping})
        log = tl.trace(model, x, grads=True)
        with pytest.raises(ValueError, match="profiler=prof"):
            tl.report.kernel_profile(log, backward=True, profiler_kwargs={"schedule": skipping})
        _no_capture_left()
    assert len(forwards) == 2  # the two traces taken above; the refused profiles ran nothing
    recording = tl.report.kernel_profile(model, x, profiler_kwargs={"schedule": schedule(wait=0, warmup=0, active=1)})
    assert recording.complete and all(r["cpu_ns"] > 0 for r in recording.ops)


def _refused_before_the_model_runs(match: str, **options) -> None:
    """``kernel_profile(**options)`` is refused (``match``) for a model and for a trace's own backward, and
    runs nothing either time."""
    model, x = mlp()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.raises(ValueError, match=match):
        tl.report.kernel_profile(model, x, **options)
    log = tl.trace(model, x, grads=True)
    with pytest.raises(ValueError, match=match):
        tl.report.kernel_profile(log, backward=True, **options)
    _no_capture_left()
    assert len(forwards) == 1  # the trace taken above; the refused profiles ran nothing


def test_a_chrome_trace_path_that_cannot_be_written_is_refused_before_the_model_runs(tmp_path):
    """The chrome trace is written after profiling: a path under a file, in a missing folder or naming a
    folder would raise only then, losing the profile just taken."""
    (tmp_path / "a_file").write_text("")
    for bad in (tmp_path / "a_file" / "run.json", tmp_path / "missing" / "run.json", tmp_path):
        _refused_before_the_model_runs("chrome_trace=", chrome_trace=bad)
    model, x = mlp()
    kp = tl.report.kernel_profile(model, x, chrome_trace=tmp_path / "run.json")
    # export_chrome_trace(folder) raised torch's bare IsADirectoryError, a missing folder FileNotFoundError.
    for bad, problem in ((tmp_path, "is a folder"), (tmp_path / "missing" / "x.json", "is in .*missing, which does "
                                                                                          "not exist")):
        with pytest.raises(ValueError, match=rf"^export_chrome_trace: path=.* {problem}; name a file in an existing"):
            kp.export_chrome_trace(bad)
    path, sidecar = kp.export_chrome_trace(tmp_path / "again.json")
    assert os.path.exists(tmp_path / "run.json") and os.path.exists(sidecar)


def test_an_existing_chrome_trace_in_a_folder_that_takes_no_new_file_is_refused_for_its_id_map(tmp_path,
                                                                                                  monkeypatch):
    """The file itself is written in place, but its id map is a new file beside it, which the folder must take."""
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "run.json").write_text("")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != str(locked) and real_access(path, mode))
    _refused_before_the_model_runs("which is not writable; .* with its id map beside it",
                                   chrome_trace=locked / "run.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of CUDA where it is not available")
def test_cuda_only_activities_without_cuda_are_refused_before_the_model_runs():
    """torch drops CUDA where it is not available, then fails on the empty list with a bare assertion."""
    cuda = [torch.profiler.ProfilerActivity.CUDA]
    _refused_before_the_model_runs("asks for CUDA only.*activities=\\[torch.profiler.ProfilerActivity.CPU\\]",
                                   activities=cuda)
    model, x = mlp()
    both = [torch.profiler.ProfilerActivity.CPU, *cuda]  # CUDA dropped with torch's warning, the CPU kept
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert tl.report.kernel_profile(model, x, activities=both).ops


def test_a_running_profiler_is_refused_unless_borrowed():
    model, x = mlp()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(ProfilerBusyError, match="profiler=prof"):
            tl.report.kernel_profile(model, x)
    idle = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with pytest.raises(ValueError, match="not recording"):
        tl.report.kernel_profile(model, x, profiler=idle)
    with pytest.raises(TypeError, match="torch.profiler.profile"):
        tl.report.kernel_profile(model, x, profiler=object())
    with pytest.raises(TypeError, match="backward must be"):
        tl.report.kernel_profile(model, x, backward="yes")
    _no_capture_left()


def test_model_raising_mid_profile_closes_everything():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) @ torch.ones(3, 3)  # shape mismatch inside the profile

    with pytest.raises(RuntimeError, match="mat1 and mat2|size mismatch|shapes cannot"):
        tl.report.kernel_profile(Broken(), torch.randn(2, 4))
    _no_capture_left()
    model, x = mlp()
    assert tl.report.kernel_profile(model, x).complete  # a fresh profile works afterwards


def test_backward_needs_an_output_that_requires_grad():
    model, x = mlp()
    with torch.no_grad():
        with pytest.raises(ValueError, match="requires grad"):
            tl.report.kernel_profile(model, x, backward=True)
    _no_capture_left()
    seen = []
    kp = tl.report.kernel_profile(model, x, backward=lambda out: seen.append(out.pow(2).mean().backward()))
    assert seen and all(r["bwd_cpu_ns"] > 0 for r in kp.ops)


# ----- device path: a CUDA-shaped fixture ---------------------------------------------------------
def _fixture_profile(drop_orphan=False):
    data = load_chrome(FIXTURE)
    events = events_from_chrome(data)
    if drop_orphan:
        events = [e for e in events if e.correlation != 99999]
    run = next(parse_marker(e.name)[1] for e in events if parse_marker(e.name))
    model, x = fixture_model()
    markers = ProfilerMarkers(run=run)
    trace = trace_with_markers(model, x, None, markers, save="none")
    return KernelProfile(trace, None, markers, borrowed=False, backward=True, events=events), data


def _kernels_by_external_id_route(data, run):
    """Independent route: device External id -> host op with that id -> innermost op marker around it."""
    xs = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    host = {e["args"]["External id"]: e for e in xs if e["cat"] == "cpu_op" and "External id" in e["args"]}
    markers = [e for e in xs if (parse_marker(e["name"]) or ("",))[0] == "op"]
    totals: dict = {}
    for k in xs:
        if k["cat"] not in ("kernel", "gpu_memcpy") or k["args"].get("External id") not in host:
            continue
        h = host[k["args"]["External id"]]
        around = [m for m in markers if m["tid"] == h["tid"] and m["ts"] <= h["ts"]
                  and h["ts"] + h["dur"] <= m["ts"] + m["dur"]]
        if around:
            inner = min(around, key=lambda m: m["dur"])
            totals[inner["name"]] = totals.get(inner["name"], 0) + int(round(k["dur"] * 1000))
    return totals


def test_fixture_kernels_land_on_their_ops():
    kp, data = _fixture_profile()
    rows = {r["op"]: r for r in kp.ops}
    assert rows["linear_1_1:1"]["kernels"] == 2 and rows["linear_1_1:1"]["memops"] == 1
    assert rows["relu_1_2:1"]["kernels"] == 1 and rows["linear_2_3:1"]["kernels"] == 1
    assert all(r["bwd_kernels"] >= 1 for r in rows.values())
    serial_of_call = {c: s for s, c in kp.markers.resolve_calls(len(kp.trace._calls)).items()}
    expected = _kernels_by_external_id_route(data, kp.markers.run)
    for c, row in enumerate(kp.ops):
        assert row["device_ns"] == expected[kp.markers.op_name(serial_of_call[c])]
    # Module calls: inclusive equals the ops inside them (no device work outside ops in this model).
    for row in kp.module_calls:
        assert row["device_ns"] == row["self_device_ns"] == rows[kp.trace[row["module_call"]].label]["device_ns"]


def test_fixture_sidecar_ids_resolve_to_the_right_ops():
    kp, data = _fixture_profile()
    sidecar = kp.sidecar("kernel_profile_cuda.json")
    xs = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    device = {e["args"]["correlation"]: e for e in xs if e["cat"] in ("kernel", "gpu_memcpy")}
    runtime = {e["args"]["correlation"] for e in xs if e["cat"] == "cuda_runtime"}
    host_ids = {e["args"]["External id"] for e in xs if e["cat"] == "cpu_op"}
    assert {int(k) for k in sidecar["correlations"]} <= runtime
    assert {int(k) for k in sidecar["external_ids"]} <= host_ids
    assert set(sidecar["markers"]) <= {e["name"] for e in xs}
    per_op: dict = {}
    for corr, target in sidecar["correlations"].items():
        if int(corr) in device and "op" in target:
            key = (target["op"], target["phase"])
            per_op[key] = per_op.get(key, 0) + int(round(device[int(corr)]["dur"] * 1000))
    for row in kp.ops:
        assert per_op.get((row["op"], "forward"), 0) == row["device_ns"]
        assert per_op.get((row["op"], "backward"), 0) == row["bwd_device_ns"]


def test_fixture_coverage_reports_busy_union_and_what_was_not_attributed():
    kp, data = _fixture_profile()
    cov = kp.coverage
    device = cov.devices["cuda:0"]
    kernels = [e for e in data["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy")]
    assert device["events"] == len(kernels)
    assert device["sum_ns"] == sum(int(round(k["dur"] * 1000)) for k in kernels)
    assert device["busy_ns"] == union_ns([(int(round(k["ts"] * 1000)), int(round((k["ts"] + k["dur"]) * 1000)))
                                          for k in kernels])
    assert device["busy_ns"] < device["sum_ns"]  # the side-stream kernel overlaps a gemm
    per_op = sum(r["device_ns"] + r["bwd_device_ns"] for r in kp.ops)
    assert per_op == device["attributed_sum_ns"]
    assert cov.device_unattributed["no_launch_event"][0] == 1
    assert cov.device_unattributed["backward_outside_nodes"][0] == 1  # the seed's fill kernel
    assert not kp.complete and any("could not be linked to a launch" in p for p in cov.problems)
    assert 0.5 < cov.device_fraction < 1.0
    assert cov.profiler_overhead == (1, 12500) and "profiler overhead" in str(kp)
    clean, _ = _fixture_profile(drop_orphan=True)
    assert clean.complete, clean.coverage.problems
    assert "device cuda:0: busy" in str(clean) and "join complete" in str(clean)


def test_fixture_loads_in_holistic_trace_analysis(tmp_path):
    hta = pytest.importorskip("hta.trace_analysis")
    os.makedirs(tmp_path / "trace")
    (tmp_path / "trace" / "kernel_profile_cuda.json").write_bytes(pathlib.Path(FIXTURE).read_bytes())
    analysis = hta.TraceAnalysis(trace_dir=str(tmp_path / "trace"))
    frame = analysis.t.get_trace(0)
    symbols = analysis.t.symbol_table.get_sym_table()
    kernels = frame[frame["cat"] == symbols.index("kernel")] if isinstance(symbols, list) else None
    data = json.loads(pathlib.Path(FIXTURE).read_text())
    assert kernels is not None
    assert len(kernels) == sum(1 for e in data["traceEvents"] if e.get("cat") == "kernel")
    assert set(kernels["correlation"]) == {e["args"]["correlation"] for e in data["traceEvents"]
                                           if e.get("cat") == "kernel"}


@pytest.mark.parametrize("options, message", [
    # activities=["cpu"] failed in torch with a bare AssertionError ("No valid profiler activities found"),
    # activities=3 in list(), profiler_kwargs=3 on "argument after ** must be a mapping".
    ({"activities": ["cpu"]}, r"activities= is a list of torch\.profiler\.ProfilerActivity values .* got \['cpu'\]"),
    ({"activities": 3}, r"activities= is a list of torch\.profiler\.ProfilerActivity values .* got 3"),
    ({"profiler_kwargs": 3}, r"profiler_kwargs= is a dict of torch\.profiler\.profile's keyword arguments .* got int"),
])
def test_profiler_settings_of_the_wrong_kind_are_refused_before_the_model_runs(options, message):
    model = nn.Linear(2, 2)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.raises(TypeError, match=message):
        tl.report.kernel_profile(model, torch.ones(1, 2), **options)
    assert not forwards and not torch.autograd.profiler._is_profiler_enabled


@pytest.mark.parametrize("traced", [False, True])
def test_a_backward_callable_that_cannot_take_the_output_is_refused_before_anything_runs(traced):
    # backward=lambda: loss.backward() failed after the forward with Python's "takes 0 positional arguments".
    model = nn.Linear(2, 2)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    given = tl.trace(model, torch.ones(1, 2), grads=True) if traced else model
    forwards.clear()
    with pytest.raises(TypeError, match=r"backward is called as backward\(output\), with the output of the traced "
                                        r"forward, but .*\(\) cannot take that argument .* or True"):
        tl.report.kernel_profile(given, *([] if traced else [torch.ones(1, 2)]), backward=lambda: None)
    assert not forwards and model.weight.grad is None and not torch.autograd.profiler._is_profiler_enabled


def test_activities_given_in_profiler_kwargs_are_the_activities():
    # profiler_kwargs go to torch.profiler.profile as given, and activities is one of its keywords: given there,
    # they failed with "got multiple values for keyword argument 'activities'" (kernel_profile passes its own).
    model, x = nn.Linear(2, 2), torch.ones(1, 2)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    profile = tl.report.kernel_profile(model, x, profiler_kwargs={"activities": cpu, "record_shapes": True})
    assert profile["linear_1_1:1"]["cpu_ns"] > 0
    with pytest.raises(TypeError, match="activities were given twice"):
        tl.report.kernel_profile(model, x, activities=cpu, profiler_kwargs={"activities": cpu})
    with pytest.raises(TypeError, match=r"activities= is a list of torch\.profiler\.ProfilerActivity values"):
        tl.report.kernel_profile(model, x, profiler_kwargs={"activities": ["cpu"]})


def test_a_profile_row_asked_for_by_number_is_refused_naming_what_finds_it():
    # profile.device_time(3) failed inside the spelling hint: "can only concatenate str (not "int") to str".
    profile = tl.report.kernel_profile(nn.Linear(2, 2), torch.ones(1, 2))
    with pytest.raises(TypeError, match=r"a profile's rows are found by label, an op \('linear_1_1:1'\).* not int 3"):
        profile.device_time(3)
    assert profile["linear_1_1:1"]["op"] == "linear_1_1:1"
