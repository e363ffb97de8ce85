"""Saved traces that were damaged or tampered with: truncated, flipped, edited, symlinked or fuzzed folders are
refused with a clear error (or load harmlessly), and nothing in one is ever executed."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchlens as tl
from torchlens.io import TraceFileError
from torchlens.io.format import sha256_of
from zoo import zoo


# ----- damaged and hostile folders -----------------------------------------------------------------------
@pytest.fixture()
def saved(tmp_path):
    model, args, _ = zoo()["small_cnn"]
    return tl.trace(model, args).save(tmp_path / "t")


def rehash(folder) -> None:
    """Make the manifest agree with edited files: a deliberate tamper, not an accident."""
    path = os.path.join(folder, "manifest.json")
    manifest = json.loads(pathlib.Path(path).read_text())
    for name, entry in manifest["files"].items():
        member = os.path.join(folder, name)
        if os.path.isfile(member):
            entry.update(bytes=os.path.getsize(member), sha256=sha256_of(member))
    pathlib.Path(path).write_text(json.dumps(manifest))


def edit_json(folder, name, change) -> None:
    path = os.path.join(folder, name)
    record = json.loads(pathlib.Path(path).read_text())
    change(record)
    pathlib.Path(path).write_text(json.dumps(record))


def test_truncated_file_is_refused(saved):
    path = os.path.join(saved, "activations.safetensors")
    data = pathlib.Path(path).read_bytes()
    pathlib.Path(path).write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFileError, match="truncated"):
        tl.load(saved)


@pytest.mark.parametrize("name", ["trace.json", "activations.safetensors"])
def test_flipped_byte_is_refused(saved, name):
    path = os.path.join(saved, name)
    data = bytearray(pathlib.Path(path).read_bytes())
    data[len(data) // 2] ^= 0x01
    pathlib.Path(path).write_bytes(bytes(data))
    with pytest.raises(TraceFileError, match=f"{name}: content hash does not match"):
        tl.load(saved)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(schema_version=2), "schema version 2 was written by a newer torchlens"),
    (lambda m: m.update(schema_version="1"), "no integer schema_version"),
    (lambda m: m.update(format="something-else"), "expected 'torchlens-trace'"),
    (lambda m: m["files"].pop("trace.json"), "does not list 'trace.json'"),
    (lambda m: m["files"].update({"../outside.json": {"bytes": 1, "sha256": "0"}}), "refusing file name '../outside"),
    (lambda m: m["files"].update({"/etc/passwd": {"bytes": 1, "sha256": "0"}}), "refusing file name '/etc/passwd'"),
    (lambda m: m["files"].update({"sub/x.json": {"bytes": 1, "sha256": "0"}}), "refusing file name 'sub/x.json'"),
])
def test_edited_manifest_is_refused(saved, edit, message):
    edit_json(saved, "manifest.json", edit)
    with pytest.raises(TraceFileError, match=message):
        tl.load(saved)


def test_symlinked_member_is_refused(saved, tmp_path):
    outside = tmp_path / "elsewhere.json"
    os.replace(os.path.join(saved, "trace.json"), outside)
    os.symlink(outside, os.path.join(saved, "trace.json"))
    with pytest.raises(TraceFileError, match="symbolic link"):
        tl.load(saved)


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["labels"].pop(), "column 'labels' must be a list of"),
    (lambda r: r["parents"][3].append([0, 999]), r"parents: 999 is not an integer in \[-1,"),
    (lambda r: r["meta"][1].__setitem__(1, "os.system"), "'os.system' is not a torch dtype"),
    (lambda r: r["calls"][0].__setitem__(1, {"$": "repr_exec", "v": "__import__('os')"}), "unknown value tag"),
    (lambda r: r["module_calls"][1].__setitem__(2, 5), "module_calls.parent"),
    (lambda r: r.pop("kind"), "column 'kind' is missing"),
    (lambda r: r["activations"].append([0, "missing_key"]), "not in activations.safetensors"),
    (lambda r: r["meta"][0].__setitem__(0, [9, 9]), "recorded"),
    (lambda r: r.__setitem__("activation_strides", {"a0": [1, 1, 1, 1]}), "not a gapless layout"),
    (lambda r: r.__setitem__("activation_strides", {"a0": [10 ** 15, 1, 1, 1]}), "not a gapless layout"),
    (lambda r: r.__setitem__("activation_strides", {"missing_key": [1]}), "not a gapless layout"),
    (lambda r: r.__setitem__("activation_strides", [[0, 1]]), "must map tensor names to strides"),
    (lambda r: r["parents"][r["kind"].index(3)].clear(), r"output op #\d+ has 0 parents; an output has exactly one"),
    (lambda r: r["parents"][r["kind"].index(3)].append([1, 0]), r"output op #\d+ has 2 parents"),
    (lambda r: r["call"].__setitem__(r["kind"].index(0), -1), r"call: op #\d+ is op, which a torch call makes"),
    (lambda r: r["call"].__setitem__(0, 0), "call: op #0 is input, which no torch call makes"),
    (lambda r: r["calls"][0].__setitem__(9, r["calls"][0][9] + 1), "calls: call #0 names ops"),
    (lambda r: r["module_calls"][1].__setitem__(0, r["module_calls"][0][0]), "module_calls: call #1 is call 1 of"),
])
def test_edited_trace_json_is_refused_even_when_rehashed(saved, edit, message):
    edit_json(saved, "trace.json", edit)
    rehash(saved)
    with pytest.raises(TraceFileError, match=message):
        tl.load(saved)


def test_a_dtype_this_torch_lacks_is_refused_as_saved_under_another_torch(saved):
    # A trace saved under a torch with a dtype this one lacks was refused as "does not match trace schema 1
    # (ValueError: ... is not a torch dtype); the file was edited or written by other software".
    edit_json(saved, "trace.json", lambda r: r["meta"][1].__setitem__(1, "float4_e9m9"))
    rehash(saved)
    with pytest.raises(TraceFileError, match=rf"trace\.json: torch {re.escape(torch.__version__)} has no dtype "
                                             "'float4_e9m9': the trace was saved with a torch that has it, and loads"):
        tl.load(saved)


def test_a_pickle_in_place_of_the_tensors_is_never_executed(saved, tmp_path):
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(os.path.join(saved, "activations.safetensors"), "wb") as f:
        pickle.dump(Payload(), f)
    rehash(saved)
    with pytest.raises(TraceFileError, match="not a readable safetensors file"):
        tl.load(saved)
    assert not marker.exists()


def test_missing_or_wrong_folder(tmp_path):
    with pytest.raises(TraceFileError, match="not a folder"):
        tl.load(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceFileError, match="manifest.json: missing"):
        tl.load(tmp_path / "empty")


_FUZZ = dict(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(**_FUZZ)
@given(name=st.sampled_from(["trace.json", "activations.safetensors", "manifest.json"]),
       position=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255), cut=st.booleans(),
       resign=st.booleans())
def test_fuzzed_damage_is_refused_or_harmless(saved, name, position, flip, cut, resign):
    path = os.path.join(saved, name)
    original = pathlib.Path(path).read_bytes()
    manifest = pathlib.Path(saved, "manifest.json").read_bytes()
    data = bytearray(original)
    at = int(position * len(data))
    if cut:
        del data[at:]
    else:
        data[at] ^= flip
    try:
        pathlib.Path(path).write_bytes(bytes(data))
        if resign and name != "manifest.json":
            rehash(saved)
        try:
            loaded = tl.load(saved)
        except TraceFileError as exc:
            assert str(exc).startswith(saved) or saved in str(exc)
        else:  # a change that kept every column valid (a digit of a timing, say) loads and works
            str(loaded)
            loaded.to_pandas()
            [op.activation for op in loaded.ops]
    finally:
        pathlib.Path(path).write_bytes(original)
        pathlib.Path(saved, "manifest.json").write_bytes(manifest)


def json_paths(obj, path=()):
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from json_paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from json_paths(v, path + (i,))


_JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.text(max_size=5),
                         st.lists(st.integers(-2, 3), max_size=3), st.dictionaries(st.text(max_size=2), st.none()))


@settings(**_FUZZ)
@given(pick=st.floats(0, 1, exclude_max=True), value=_JSON_VALUES)
def test_fuzzed_json_values_are_refused_or_harmless(saved, pick, value):
    path = os.path.join(saved, "trace.json")
    original = pathlib.Path(path).read_bytes()
    manifest = pathlib.Path(saved, "manifest.json").read_bytes()
    record = json.loads(original)
    paths = [p for p in json_paths(record) if p]
    target = paths[int(pick * len(paths))]
    holder = record
    for key in target[:-1]:
        holder = holder[key]
    holder[target[-1]] = value
    try:
        pathlib.Path(path).write_text(json.dumps(record))
        rehash(saved)
        try:
            loaded = tl.load(saved)
        except TraceFileError as exc:
            assert saved in str(exc)
        else:
            str(loaded)
            loaded.to_pandas()
            loaded.module_calls.to_pandas()
            [(op.activation, op.source, op.parents, op.children, op.modules) for op in loaded.ops]
    finally:
        pathlib.Path(path).write_bytes(original)
        pathlib.Path(saved, "manifest.json").write_bytes(manifest)


@pytest.mark.parametrize("edit, message", [
    (lambda rows: rows[0].__setitem__(1, "missing_key"), "the gradient 'missing_key' of parameter .* is missing"),
    (lambda rows: rows[0].__setitem__(1, rows[1][1]), "does not match parameter"),  # another parameter's gradient
])
def test_a_parameter_gradient_the_file_does_not_hold_is_refused(tmp_path, edit, message):
    # Read as None ("no gradient") or as another parameter's gradient, of another shape, before.
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, grads=True)
    log.backward(log.output.sum())
    folder = log.save(tmp_path / "t")
    edit_json(folder, "trace.json", lambda r: edit(r["grads"]["param_tensors"]))
    rehash(folder)
    with pytest.raises(TraceFileError, match=message):
        tl.load(folder)


def test_an_op_gradient_naming_another_ops_tensor_is_refused(tmp_path):
    # Else the loaded op's gradient would be the other op's, of another shape, with no word of it.
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, grads=True)
    log.backward(log.output.sum())
    folder = log.save(tmp_path / "t")
    shapes = {op.index: tuple(op.shape) for op in log.ops}

    def swap(rows):
        first = rows[0]
        other = next(row for row in rows if shapes[row[0]] != shapes[first[0]])
        first[1] = other[1]

    edit_json(folder, "trace.json", lambda r: swap(r["grads"]["tensors"]))
    rehash(folder)
    with pytest.raises(TraceFileError, match=r"gradient '.*' is missing or does not match op #"):
        tl.load(folder)
