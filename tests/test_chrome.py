"""Chrome exports: torchlens's host-clock semantic view, and both chrome files in a real trace reader."""

import json
import os
import pathlib
import sys
import warnings

import pytest

import torchlens as tl
from torchlens.report.chrome import CLOCK_NOTE

sys.path.insert(0, os.path.dirname(__file__))
from zoo import zoo  # noqa: E402


def _x_events(data):
    return [e for e in data["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.parametrize("name", ["small_cnn", "multi_output", "loop_rnn"])
def test_host_view_nests_ops_in_module_calls_with_labels(name, tmp_path):
    model, args, kwargs = zoo(0)[name]
    log = tl.trace(model, args, kwargs)
    path = log.to_chrome_trace(tmp_path / "ops.json")  # Trace delegates to report.chrome
    data = json.loads(pathlib.Path(path).read_text())
    assert data["otherData"]["clock"] == CLOCK_NOTE and "not device time" in CLOCK_NOTE
    events = _x_events(data)
    ops = [e for e in events if e["cat"] == "op"]
    calls = {e["name"]: e for e in events if e["cat"] == "module_call"}
    assert len(ops) == len(log._calls) and set(calls) == {mc.label for mc in log.module_calls}
    assert min(e["ts"] for e in events) == 0
    for mc in log.module_calls:
        assert abs(calls[mc.label]["dur"] - mc.duration * 1e6) <= 0.001
    by_label = {op.label: op for op in log.ops}
    for e in ops:
        op = by_label[e["name"]]
        assert e["args"]["layer"] == op.layer_label and e["args"]["shapes"][0] == list(op.shape)
        # Every output's shape, in output order; chrome's time unit is the microsecond.
        outputs = e["args"].get("outputs", [e["name"]])
        assert e["args"]["shapes"] == [list(by_label[label].shape) for label in outputs]
        assert abs(e["dur"] - op.duration * 1e6) <= 0.001
        assert e["args"]["module_call"] == op.module
        if op.source is not None:
            assert e["args"]["source"] == f"{op.source.file}:{op.source.line}"
        if op.module is not None:  # each op lies inside every module call that contains it
            for label in op.modules:
                outer = calls[label]
                assert outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 0.001
    if name == "multi_output":
        assert any(len(e["args"].get("outputs", [])) == 2 for e in ops)


def test_both_chrome_files_load_in_holistic_trace_analysis(tmp_path):
    hta = pytest.importorskip("hta.trace_analysis")
    model, args, kwargs = zoo(0)["small_cnn"]
    (tmp_path / "native").mkdir()
    (tmp_path / "host").mkdir()
    kp = tl.report.kernel_profile(model, args, kwargs, chrome_trace=tmp_path / "native" / "run.json")
    os.replace(tmp_path / "native" / "run.json.torchlens.json", tmp_path / "run.json.torchlens.json")
    kp.trace.to_chrome_trace(tmp_path / "host" / "ops.json")
    sidecar = json.loads((tmp_path / "run.json.torchlens.json").read_text())

    for folder, file in (("native", "run.json"), ("host", "ops.json")):
        data = json.loads((tmp_path / folder / file).read_text())
        expected = [e for e in _x_events(data) if e.get("cat") != "Trace"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            analysis = hta.TraceAnalysis(trace_dir=str(tmp_path / folder))
        frame = analysis.t.get_trace(0)
        symbols = analysis.t.symbol_table.get_sym_table()
        names = [symbols[i] for i in frame["name"]]
        assert len(frame) == len(expected)
        assert sorted(names) == sorted(e["name"] for e in expected)
        if folder == "native":
            assert set(sidecar["markers"]) <= set(names)
        else:
            assert set(names) == {op.label for op in kp.trace.ops if op.kind == "op"
                                  and op.multi_output_index in (None, 0)} | {
                mc.label for mc in kp.trace.module_calls}


def test_a_model_given_for_the_trace_is_refused_saying_what_to_give(tmp_path):
    # to_chrome_trace(model, path) failed on a missing attribute: "'Sequential' object has no attribute 'calls'".
    model, args, _ = zoo()["mlp"]
    with pytest.raises(TypeError, match=r"to_chrome_trace takes a Trace \(log = tl\.trace\(model, x\)\), got"):
        tl.report.to_chrome_trace(model, tmp_path / "t.json")
    # module_calls="no" is true to Python: the module calls were drawn.
    with pytest.raises(TypeError, match=r"to_chrome_trace: module_calls='no' is a str, not True or False"):
        tl.trace(model, args).to_chrome_trace(tmp_path / "t.json", module_calls="no")
    assert not list(tmp_path.iterdir())
