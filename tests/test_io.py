"""Saved traces: exact round trips on the zoo, and damaged or hostile folders refused with clear errors."""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.io import TraceFileError
from torchlens.io.format import sha256_of
from peak_memory import peak_growth_mib
from real_models import build
from zoo import zoo

OP_FIELDS = ["label", "layer_label", "pass_index", "num_passes", "type", "kind", "func_name", "parents",
             "children", "parent_arg_positions", "params", "shape", "dtype", "device", "requires_grad", "grad_fn",
             "numel", "nbytes", "has_activation", "finite", "module", "modules", "duration", "start_ns",
             "is_inplace", "multi_output_index", "is_input", "is_output", "is_buffer", "io_path", "index",
             "unattributed_args"]


def same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and torch.equal(a.isnan(), b.isnan())
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def assert_same_trace(live, loaded) -> None:
    assert len(live) == len(loaded)
    for a, b in zip(live.ops, loaded.ops):
        for field in OP_FIELDS:
            assert same_value(getattr(a, field), getattr(b, field)), (a.label, field)
        assert same_value(a.args, b.args) and same_value(a.kwargs, b.kwargs), a.label
        assert (a.source is None) == (b.source is None) and (a.source is None or (
            a.source.file, a.source.line, a.source.function) == (b.source.file, b.source.line, b.source.function))
        if a.has_activation:
            assert same_value(a.activation, b.activation), a.label
    for a, b in zip(live.module_calls, loaded.module_calls, strict=True):
        assert (a.label, a.address, a.call_index, a.depth, a.start_ns, a.end_ns, a.input_ops, a.output_ops,
                a.op_labels) == \
            (b.label, b.address, b.call_index, b.depth, b.start_ns, b.end_ns, b.input_ops, b.output_ops, b.op_labels)
        assert (a.parent and a.parent.label) == (b.parent and b.parent.label)
        assert [c.label for c in a.children] == [c.label for c in b.children]
    for a, b in zip(live.modules, loaded.modules, strict=True):
        assert (a.address, a.all_addresses, a.class_name, a.call_labels, a.param_names) == \
            (b.address, b.all_addresses, b.class_name, b.call_labels, b.param_names)
    assert [layer.layer_label for layer in live.layers] == [layer.layer_label for layer in loaded.layers]
    assert str(live) == str(loaded)
    assert (live.unattributed, live.timings, live.is_recurrent, live.saved_bytes) == \
        (loaded.unattributed, loaded.timings, loaded.is_recurrent, loaded.saved_bytes)
    assert live.to_pandas().equals(loaded.to_pandas())
    assert int(live.flops) == int(loaded.flops) and live.flops.unknown == loaded.flops.unknown


@pytest.mark.parametrize("name", sorted(zoo()))
def test_round_trip_on_the_zoo_is_exact(name, tmp_path):
    model, args, kwargs = zoo()[name]
    live = tl.trace(model, args, kwargs, record_finite=True)
    folder = live.save(tmp_path / "t")
    loaded = tl.load(folder)
    assert_same_trace(live, loaded)
    for key in [live.ops[-2].label, live.layers[-1].layer_label] + [m.address for m in live.modules]:
        assert type(live[key]) is type(loaded[key])
    assert_same_reports(live, loaded, tmp_path)


def assert_same_reports(live, loaded, tmp_path) -> None:
    """The tools that only read a record give the same answers on the loaded copy."""
    for group in ("op", "layer", "module", "source"):
        for by in ("duration", "flops", "memory"):
            assert str(tl.debug.hot_path(live, by=by, group=group)) == \
                str(tl.debug.hot_path(loaded, by=by, group=group))
    # Same findings; the loaded copy also says it could not look at the (absent) model's parameters.
    not_checked = "  parameters were not checked (the trace no longer holds the model)\n"
    live_report, loaded_report = str(tl.debug.nonfinite_origin(live)), str(tl.debug.nonfinite_origin(loaded))
    assert not_checked in loaded_report and loaded_report.replace(not_checked, "") == live_report
    assert live.render(None, format="dot") == loaded.render(None, format="dot")
    assert live.render(None, format="html") == loaded.render(None, format="html")
    live.to_chrome_trace(tmp_path / "live.json")
    loaded.to_chrome_trace(tmp_path / "loaded.json")
    assert json.loads((tmp_path / "live.json").read_text()) == json.loads((tmp_path / "loaded.json").read_text())


def test_nonfinite_origin_on_a_loaded_trace(tmp_path):
    class Blowup(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.log(self.fc(x) - 100.0).exp()

    live = tl.trace(Blowup(), torch.randn(2, 4), record_finite=True)
    loaded = tl.load(live.save(tmp_path / "t"))
    report = tl.debug.nonfinite_origin(loaded)
    assert report.found and report.origin.label == "log_1_3:1" and report.origin.source.line == \
        live["log_1_3:1"].source.line
    live.cleanup()
    flags_only = tl.load(live.save(tmp_path / "flags"))
    assert tl.debug.nonfinite_origin(flags_only).origin.label == "log_1_3:1"


def test_a_loaded_trace_rebuilds_a_nested_output(tmp_path):
    class Nested(torch.nn.Module):
        def forward(self, x):
            return {"logits": x * 2, "extra": (x + 1, x - 1)}

    x = torch.randn(2, 3)
    loaded = tl.load(tl.trace(Nested(), x).save(tmp_path / "n"))
    out = loaded.output
    assert set(out) == {"logits", "extra"} and isinstance(out["extra"], tuple)
    assert torch.equal(out["logits"], x * 2) and torch.equal(out["extra"][1], x - 1)
    light = tl.load(tl.trace(Nested(), x).save(tmp_path / "meta", activations=False))
    with pytest.raises(tl.ActivationUnavailable,
                       match="log.output is rebuilt from the saved output.*activations=False"):
        light.output


def plain_containers(value):
    """``value`` as a saved trace can hold it: a mapping (a ``ModelOutput``) as a dict, a named tuple as a tuple."""
    from collections.abc import Mapping

    if isinstance(value, Mapping):
        return {key: plain_containers(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map(plain_containers, value)) if type(value) in (list, tuple) else \
            tuple(map(plain_containers, value))
    return value


def test_a_loaded_output_keeps_lists_none_slots_and_dotted_keys(tmp_path):
    class Mixed(nn.Module):
        def forward(self, x):
            return [x + 1, None, {"a.b": x * 2, "0": x - 1}, (3, "text")]

    live = tl.trace(Mixed(), torch.randn(2, 2))
    loaded = tl.load(live.save(tmp_path / "t"))
    assert same_value(live.output, loaded.output)
    again = tl.load(loaded.save(tmp_path / "copy"))  # a copy of a copy keeps the structure too
    assert same_value(live.output, again.output)


@pytest.mark.parametrize("name", ["gpt2", "t5", "lstm", "detr"])
def test_a_loaded_corpus_output_matches_the_live_one(name, tmp_path):
    model, args, kwargs = build(name)
    live = tl.trace(model.eval(), args, kwargs)
    loaded = tl.load(live.save(tmp_path / "t"))
    expected = plain_containers(live.output)
    got = loaded.output
    if name == "t5":  # a cache object is code, not data: it comes back as the dict of its fields
        assert isinstance(got.pop("past_key_values"), dict)
        expected.pop("past_key_values")
    assert same_value(expected, got)


def test_an_output_saved_without_its_structure_is_refused_unless_a_lone_tensor(tmp_path):
    class Pair(nn.Module):
        def forward(self, x):
            return [x + 1, {"a.b": x * 2}]

    x = torch.randn(2, 2)
    pair = _without_key(tl.trace(Pair(), x).save(tmp_path / "pair"), "output_structure")
    with pytest.raises(tl.TorchlensError, match="cannot be rebuilt faithfully.*output.0, output.1.a.b"):
        tl.load(pair).output
    lone = _without_key(tl.trace(nn.Linear(2, 2), x).save(tmp_path / "lone"), "output_structure")
    assert tl.load(lone).output.shape == (2, 2)


def _without_key(folder, key):
    """``folder``'s saved trace as an older torchlens wrote it: ``trace.json`` without ``key``, re-hashed."""
    path, manifest_path = pathlib.Path(folder, "trace.json"), pathlib.Path(folder, "manifest.json")
    record = json.loads(path.read_text(encoding="utf-8"))
    del record[key]
    path.write_text(json.dumps(record), encoding="utf-8")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    manifest["files"]["trace.json"] = {"bytes": os.path.getsize(path), "sha256": sha256_of(str(path))}
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    return folder


SUMMARY_CORPUS = ["xlnet", "deberta_v2", "resnet", "gpt2", "lstm", "t5"]


def assert_prints_the_same(live, loaded) -> None:
    assert str(loaded) == str(live)
    assert loaded.summary().rows == live.summary().rows
    assert str(loaded.summary()) == str(live.summary())


@pytest.mark.parametrize("name", SUMMARY_CORPUS)
def test_a_loaded_corpus_trace_prints_what_the_live_one_printed(name, tmp_path):
    model, args, kwargs = build(name)
    live = tl.trace(model.eval(), args, kwargs)
    loaded = tl.load(live.save(tmp_path / "t"))
    assert_prints_the_same(live, loaded)
    assert_prints_the_same(live, tl.load(loaded.save(tmp_path / "copy")))
    light = tl.load(live.save(tmp_path / "light", activations=False))
    assert light.summary().rows == live.summary().rows  # parameter counts do not depend on activations
    assert "counts the parameters its ops used" not in str(light.summary())


@pytest.mark.parametrize("name", ["resnet", "gpt2"])
def test_a_stopped_corpus_trace_loads_stopped(name, tmp_path):
    model, args, kwargs = build(name)
    full = tl.trace(model.eval(), args, kwargs)
    site = full.module_calls[len(full.module_calls) // 2].label
    live = tl.trace(model, args, kwargs, stop_after=site)
    loaded = tl.load(live.save(tmp_path / "t"))
    assert live.stopped_after == loaded.stopped_after == site
    assert live.output is None and loaded.output is None
    assert "stopped after" in str(loaded)
    assert_prints_the_same(live, loaded)


def test_caveats_and_the_root_class_are_saved(tmp_path):
    model, args, kwargs = build("gpt2")
    with torch.inference_mode():
        live = tl.trace(model.eval(), args, kwargs, name="experiment-7")
    loaded = tl.load(live.save(tmp_path / "t"))
    assert live.caveats and loaded.caveats == live.caveats
    assert loaded.summary()[0]["class_name"] == live.summary()[0]["class_name"] == type(model).__name__
    assert_prints_the_same(live, loaded)


class _Double(nn.Module):
    def forward(self, x):
        return x * 2


class _ReusedFromTwoLines(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Double()

    def forward(self, x):
        x = self.block(x)
        return self.block(x + 1)


class _Looped(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Double()

    def forward(self, x):
        for _ in range(3):
            x = self.block(x)
        return x


@pytest.mark.parametrize("model, wording", [(_ReusedFromTwoLines(), "reused modules"), (_Looped(), "recurrent")])
def test_loop_or_reuse_wording_survives_a_save(model, wording, tmp_path):
    live = tl.trace(model, torch.randn(2, 4))
    loaded = tl.load(live.save(tmp_path / "t"))
    assert wording in str(live).splitlines()[2]
    assert str(loaded) == str(live)


def test_dropped_activations_print_their_reasons_grouped(tmp_path):
    class Mixed(nn.Module):
        def forward(self, x):
            y = x * 2
            with torch._C.DisableTorchFunction():  # a write capture cannot see: y's saved value is dropped
                y.add_(1)
            return y.double().to(torch.complex128) + 1  # safetensors cannot store complex128

    with pytest.warns(UserWarning, match="dropped saved activations"):
        live = tl.trace(Mixed(), torch.ones(2))
    assert "mutated after capture saved it" in str(live)
    loaded = tl.load(live.save(tmp_path / "t"))
    text = str(loaded)
    assert "mutated after capture saved it" in text and "safetensors cannot store complex128" in text
    light = str(tl.load(live.save(tmp_path / "light", activations=False)))
    assert "the trace was saved with activations=False" in light
    assert "mutated after capture saved it" in light  # each op keeps its own reason
    assert "mutated behind capture" not in light


@pytest.mark.parametrize("save", [False, True])
def test_a_model_without_parameters_counts_zero(save, tmp_path):
    log = tl.trace(nn.ReLU(), torch.randn(2, 4))
    if save:
        log = tl.load(log.save(tmp_path / "t"))
    table = log.summary()
    assert table[0]["params"] == 0
    assert "Parameters: 0 " in str(table)


def test_saving_a_loaded_trace_again_keeps_arguments_it_could_not_save(tmp_path):
    import numpy as np

    class FromNumpy(nn.Module):
        def forward(self, x):
            return x + torch.tensor(np.arange(3.0), dtype=torch.float32)

    live = tl.trace(FromNumpy(), torch.randn(2, 3))
    once = tl.load(live.save(tmp_path / "once"))
    twice = tl.load(once.save(tmp_path / "twice"))
    label = next(op.label for op in live if op.func_name == "tensor")
    assert repr(once[label].args) == repr(twice[label].args) == "(<not saved: ndarray array([0., 1., 2.])>,)"


def test_tensors_inside_keyword_containers_load_back(tmp_path):
    """A tensor inside a keyword argument's container sits at a position (keyword, index): saved, it was
    refused on load (Longformer passes such sizes), as only (index, index) paths were read back."""
    class Containers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            joined = torch.cat(tensors=[x, x * 2], dim=0)  # ("tensors", 0), ("tensors", 1)
            return torch.stack([joined[:2], joined[2:] * self.scale])  # (0, 0), (0, 1)

    log = tl.trace(Containers(), torch.randn(2, 3))
    loaded = tl.load(log.save(tmp_path / "c"))
    assert loaded.labels == log.labels and torch.equal(loaded.output, log.output)
    assert [c.parents for c in loaded.calls] == [c.parents for c in log.calls]
    assert ("tensors", 1) in dict(log.calls[1].parents)


def test_a_loaded_trace_holds_no_model_and_refuses_replay(tmp_path):
    model, args, kwargs = zoo()["mlp"]
    loaded = tl.load(tl.trace(model, args).save(tmp_path / "t"))
    assert loaded.model is None and loaded.loaded_from == str(tmp_path / "t")
    assert all(op.func is None for op in loaded.ops)
    assert torch.equal(loaded.output, model(*args))  # the saved output, not an error
    with pytest.raises(tl.TorchlensError, match="tl.validate"):
        loaded.validate()
    with pytest.raises(KeyError, match="closest"):
        loaded["linear_1_"]


def test_cleaned_up_and_metadata_only_saves(tmp_path):
    model, args, _ = zoo()["small_cnn"]
    log = tl.trace(model, args)
    light = tl.load(log.save(tmp_path / "meta", activations=False))
    assert not os.path.exists(tmp_path / "meta" / "activations.safetensors")
    with pytest.raises(tl.ActivationUnavailable, match="activations=False"):
        light["fc"].activation
    flops = int(log.flops)
    log.cleanup()
    cleaned = tl.load(log.save(tmp_path / "cleaned"))
    assert cleaned.is_cleaned_up and int(cleaned.flops) == flops
    with pytest.raises(tl.ActivationUnavailable, match="cleaned up"):
        cleaned["fc"].activation
    assert str(cleaned) == str(log)


def test_dtypes_safetensors_lacks_are_marked_not_saved(tmp_path):
    class Mixed(nn.Module):
        def forward(self, x):
            return x.to(torch.bfloat16) * 2, torch.view_as_complex(x.reshape(2, 2)).to(torch.complex128)

    live = tl.trace(Mixed(), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    loaded = tl.load(live.save(tmp_path / "t"))
    bf16 = next(op for op in loaded.ops if op.dtype == torch.bfloat16 and op.kind == "op")
    assert torch.equal(bf16.activation, live[bf16.label].activation)
    complex_op = next(op for op in loaded.ops if op.dtype == torch.complex128 and op.kind == "op")
    with pytest.raises(tl.ActivationUnavailable, match="safetensors cannot store complex128"):
        complex_op.activation


def test_saving_never_clobbers_other_folders(tmp_path):
    log = tl.trace(*zoo()["mlp"][:2])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(TraceFileError, match="not a saved trace"):
        log.save(tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    log.save(tmp_path / "t")
    with pytest.raises(TraceFileError, match="overwrite=True"):
        log.save(tmp_path / "t")
    log.save(tmp_path / "t", overwrite=True)
    assert tl.load(tmp_path / "t")[-1].label == log[-1].label
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []



def test_a_failed_save_into_an_empty_folder_leaves_the_folder(tmp_path, monkeypatch):
    import importlib

    log = tl.trace(*zoo()["mlp"][:2])
    (tmp_path / "mine").mkdir()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(importlib.import_module("torchlens.io.save"), "write_tensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        log.save(tmp_path / "mine")
    assert [p.name for p in tmp_path.iterdir()] == ["mine"] and not any((tmp_path / "mine").iterdir())
    monkeypatch.undo()
    log.save(tmp_path / "mine")  # the empty folder is replaced once the trace is written
    assert tl.load(tmp_path / "mine")[-1].label == log[-1].label



def test_without_safetensors_a_trace_saves_and_loading_names_the_package_it_needs(tmp_path, monkeypatch):
    # Saving streams the format itself; the error once said saving needed safetensors too.
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    log = tl.trace(*zoo()["mlp"][:2])
    folder = log.save(tmp_path / "run")
    with pytest.raises(ImportError, match="reading a saved trace's tensors needs safetensors: pip install") as error:
        tl.load(folder)
    assert "saving does not" in str(error.value)
    monkeypatch.undo()
    assert torch.equal(tl.load(folder)[-1].activation, log[-1].activation)


WITHOUT_NUMPY = """
import os, sys
sys.modules["numpy"] = None  # as if it were not installed: torch then says only "Numpy is not available"
import warnings
warnings.simplefilter("ignore")
import torch, torch.nn as nn
import torchlens as tl

model, x, out = nn.Linear(4, 2), torch.randn(3, 4), sys.argv[1]
log = tl.trace(model, x)
for name, run in (("save", lambda: log.save(os.path.join(out, "run"))),
                  ("extract", lambda: tl.extract(model, [x], ["output_1"], os.path.join(out, "features"),
                                                 progress=False))):
    try:
        run()
        print(name, "no error")
    except Exception as exc:
        print(name, type(exc).__name__, exc)
print("left", sorted(os.listdir(out)))
print("metadata", tl.load(log.save(os.path.join(out, "meta"), activations=False))[-1].label)
"""


def test_without_numpy_saving_tensors_and_extracting_name_the_package_and_leave_nothing(tmp_path):
    import subprocess

    script = tmp_path / "without_numpy.py"
    script.write_text(WITHOUT_NUMPY)
    (tmp_path / "out").mkdir()
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[:3] == ["save MissingPackage saving a trace's tensors needs numpy: pip install numpy",
                         "extract MissingPackage tl.extract needs numpy: pip install numpy",
                         "left []"]
    assert lines[3] == "metadata output_1:1"  # a metadata-only save needs no numpy


def test_saving_to_the_empty_current_directory_is_refused_and_leaves_it(tmp_path, monkeypatch):
    log = tl.trace(*zoo()["mlp"][:2])
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    for path in (".", os.getcwd()):
        with pytest.raises(TraceFileError, match="is the current working directory; save the trace to a folder inside"):
            log.save(path)
        assert os.getcwd() == str(tmp_path / "here") and os.path.samefile(".", tmp_path / "here")
    assert [p.name for p in tmp_path.iterdir()] == ["here"]
    log.save("run1")
    assert tl.load(tmp_path / "here" / "run1")[-1].label == log[-1].label


def test_saving_over_a_trace_that_is_the_current_directory_is_refused_and_leaves_it(tmp_path, monkeypatch):
    # Swapping the folder would leave this process in a deleted one (os.getcwd() then fails).
    log = tl.trace(*zoo()["mlp"][:2])
    here = log.save(tmp_path / "here")
    before = {p.name: p.read_bytes() for p in tmp_path.joinpath("here").iterdir()}
    monkeypatch.chdir(here)
    for path in (".", os.getcwd(), os.path.join("..", "here")):
        with pytest.raises(TraceFileError, match="is the current working directory; save the trace to a folder inside"):
            log.save(path, overwrite=True)
        assert os.getcwd() == str(here) and os.path.samefile(".", here)
    assert {p.name: p.read_bytes() for p in tmp_path.joinpath("here").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["here"]  # no staging folder left beside it



SAVE_MEMORY = """
import resource, sys
import torch, torch.nn as nn
import torchlens as tl

class Transposes(nn.Module):
    def forward(self, x):
        return (x * 1).T * 2  # t_1_2: a 46 MiB view with another layout

site = {"mul_1_1": tl.zero_ablate()}  # its 46 MiB original is saved beside the activations
log = tl.trace(Transposes(), torch.ones(1000, 12000), intervene=site)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
log.save(sys.argv[1] + "/t")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)  # MiB (Linux counts KiB)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
def test_saving_streams_tensors_instead_of_copying_them_whole(tmp_path):
    growth = peak_growth_mib(SAVE_MEMORY, tmp_path)
    assert growth < 32, f"saving grew peak memory by {growth:.0f} MiB (a 46 MiB view and a 46 MiB original)"
    loaded = tl.load(tmp_path / "t")
    assert torch.equal(loaded["t_1_2"].activation, torch.zeros(12000, 1000))
    assert torch.equal(loaded["mul_1_1"].original, torch.ones(1000, 12000))


def test_one_element_outputs_with_a_stride_save_and_extract(tmp_path):
    # A class score at batch size 1 (``logits[:, 0]``) is one element with stride 4: torch calls it contiguous,
    # and its bytes were read through reshape(-1), which keeps that stride and which view(uint8) refused.
    model = zoo()["mlp"][0]
    x = torch.randn(1, 16)
    live = tl.trace(lambda t: model(t)[:, 0], x, root=model)
    assert live.output.stride() == (4,)
    loaded = tl.load(live.save(tmp_path / "t"))
    assert torch.equal(loaded.output, live.output)
    score = live.outputs[0].parents[0]  # the getitem op
    folder = tl.extract(lambda t: model(t)[:, 0], [x, x * 2], layers=[score], out=tmp_path / "feats",
                        root=model, progress=False)
    assert tl.load_extracted(folder, as_torch=True)[score].shape == (2,)


def test_save_and_load_refuse_flags_and_paths_of_the_wrong_kind(tmp_path):
    # overwrite="no" is true to Python: it replaced the trace saved there; activations="no" wrote them.
    model, args, _ = zoo()["mlp"]
    first, second = tl.trace(model, args), tl.trace(model, args, name="second")
    folder = first.save(tmp_path / "run")
    with pytest.raises(TypeError, match=r"save: overwrite='no' is a str, not True or False; give True to replace"):
        second.save(folder, overwrite="no")
    with pytest.raises(TypeError, match=r"save: activations='no' is a str, not True or False"):
        second.save(tmp_path / "other", activations="no")
    with pytest.raises(TypeError, match=r"save takes a Trace \(log = tl\.trace\(model, x\)\), got"):
        tl.io.save(model, tmp_path / "model")
    # A path that is no path failed in os.fspath, naming no parameter ("expected str, bytes or os.PathLike object").
    with pytest.raises(TypeError, match=r"save: path=3 is an int; give the folder to write the trace to"):
        second.save(3)
    with pytest.raises(TypeError, match=r"tl\.load: path=None is a NoneType; give the folder log\.save wrote"):
        tl.load(None)
    assert tl.load(folder).model_name == first.model_name and sorted(os.listdir(tmp_path)) == ["run"]


class _ChannelsLastNet(nn.Module):
    """A conv net run in channels_last: its activations are laid out NHWC, and one output is a transpose."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.norm(self.conv(x)))
        return self.fc(h.mean((2, 3))).t(), h


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_saved_activations_load_with_the_memory_layout_they_had(autocast, tmp_path):
    model = _ChannelsLastNet().eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        log = tl.trace(model, x)
    assert log["relu_1_3"].activation.is_contiguous(memory_format=torch.channels_last)
    loaded = tl.load(log.save(tmp_path / "a"))
    again = tl.load(loaded.save(tmp_path / "b"))  # saving a loaded trace keeps the layouts too
    for op in log.ops:
        live = op.activation
        for trace in (loaded, again):
            kept = trace[op.label].activation
            assert kept.dtype == live.dtype and kept.stride() == live.stride() and torch.equal(kept, live), op.label
    assert again.output[0].stride() == log.output[0].stride() == (1, 5)  # the transposed output


def test_every_file_a_save_writes_is_listed_on_the_format_page(tmp_path):
    # The page's folder listing named three files; a trace with gradients or interventions writes two more.
    page = pathlib.Path(__file__).parent.parent / "docs" / "save_load.md"
    listed = page.read_text(encoding="utf-8").split("## The format", 1)[1].split("```", 2)[1]
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    log = tl.trace(model, torch.randn(2, 4), intervene={"0": tl.scale(2.0)}, grads=True)
    log.backward(log.output.sum())
    written = os.listdir(log.save(tmp_path / "run1"))
    assert {"gradients.safetensors", "originals.safetensors"} <= set(written)
    assert [name for name in written if name not in listed] == []
