"""Files that cannot destroy or leak: overwrite removes only a trace's own files, every file read goes
through one member check, and an extraction resumes only the same job, from a kill at any point."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pathlib
import signal
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import torchlens as tl
from torchlens.io import ResumeMismatchError, TraceFileError, UnsafeMemberError
from torchlens.io.format import sha256_of
from held_files import refuse_held_files
import streams
from streams import interrupted
from zoo import zoo


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging: a blocked open() of a FIFO is interrupted and the test fails."""
    def expired(signum, frame):
        raise TimeoutError(f"still blocked after {seconds}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture()
def saved(tmp_path):
    return tl.trace(*zoo()["mlp"][:2]).save(tmp_path / "t")


class TwoLayer(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x, scale=1.0):
        return self.head(torch.relu(self.fc(x))) * scale


def batches(n=6):
    return streams.batches(n, rows=3)


def partial_extraction(folder, model=None, **kw):
    """An extraction killed after a few committed shards."""
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model or TwoLayer().eval(), interrupted(batches(), 4), ["fc", "head"], folder, shard_bytes=60,
                   progress=False, **kw)
    assert json.loads(pathlib.Path(folder, "progress.json").read_text())["batches_done"] >= 2


# ----- overwrite -----------------------------------------------------------------------------------------
def test_overwrite_refuses_a_folder_whose_manifest_is_not_a_trace(tmp_path):
    log = tl.trace(*zoo()["mlp"][:2])
    app = tmp_path / "webapp"
    app.mkdir()
    (app / "manifest.json").write_text(json.dumps({"name": "My App", "start_url": "/", "files": {}}))
    (app / "index.html").write_text("<html></html>")
    with pytest.raises(TraceFileError, match="not a saved trace .*does not name the 'torchlens-trace' format"):
        log.save(app, overwrite=True)
    assert sorted(os.listdir(app)) == ["index.html", "manifest.json"]
    extraction = tl.extract(TwoLayer().eval(), batches(1), ["fc"], tmp_path / "x", progress=False)
    before = sorted(os.listdir(extraction))
    with pytest.raises(TraceFileError, match="not a saved trace"):
        log.save(extraction, overwrite=True)  # another torchlens format is not a trace either
    assert sorted(os.listdir(extraction)) == before


def test_overwrite_removes_only_listed_files_and_says_what_it_kept(saved):
    log = tl.trace(*zoo()["small_cnn"][:2])
    with open(os.path.join(saved, "notes.txt"), "w") as f:
        f.write("keep me")
    os.mkdir(os.path.join(saved, "plots"))
    with pytest.warns(UserWarning, match=r"kept 2 entries .*\(notes.txt, plots\)"):
        log.save(saved, overwrite=True)
    assert pathlib.Path(saved, "notes.txt").read_text() == "keep me" and os.path.isdir(os.path.join(saved, "plots"))
    assert tl.load(saved)[-1].label == log[-1].label
    assert len(tl.load(saved)) == len(log)


def test_overwrite_of_a_clean_trace_swaps_folders_and_leaves_nothing(saved, tmp_path):
    log = tl.trace(*zoo()["small_cnn"][:2])
    log.save(saved, overwrite=True)
    assert len(tl.load(saved)) == len(log)
    assert sorted(os.listdir(tmp_path)) == ["t"]  # no staging or retired folder left next to it


def test_a_manifest_naming_files_outside_is_not_obeyed(saved, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = os.path.join(saved, "manifest.json")
    manifest = json.loads(pathlib.Path(path).read_text())
    manifest["files"]["../victim.txt"] = {"bytes": 8, "sha256": "0" * 64}
    pathlib.Path(path).write_text(json.dumps(manifest))
    with pytest.raises(TraceFileError, match="refusing file name '../victim.txt'"):
        tl.trace(*zoo()["mlp"][:2]).save(saved, overwrite=True)
    assert victim.read_text() == "precious"


# ----- one member check for every file read ------------------------------------------------------------
def replace_with(folder, name, make):
    path = os.path.join(folder, name)
    os.remove(path)
    make(path)


READERS = {
    "load": lambda folder: tl.load(folder),
    "load_extracted": lambda folder: tl.load_extracted(folder),
}


def hostile(kind, tmp_path):
    """A maker for a hostile file of the given kind."""
    outside = tmp_path / "outside.json"
    outside.write_text('{"format": "torchlens-trace"}')
    return {
        "symlink to /dev/zero": lambda p: os.symlink("/dev/zero", p),
        "FIFO": lambda p: os.mkfifo(p),
        "symlink outside": lambda p: os.symlink(outside, p),
        "directory": lambda p: os.mkdir(p),
    }[kind]


KINDS = ["symlink to /dev/zero", "FIFO", "symlink outside", "directory"]
MESSAGES = {"symlink to /dev/zero": "symbolic link", "FIFO": "is a FIFO, not a regular file",
            "symlink outside": "symbolic link", "directory": "is a directory, not a regular file"}


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_manifest_of_a_saved_trace(saved, tmp_path, kind):
    replace_with(saved, "manifest.json", hostile(kind, tmp_path))
    with deadline(20), pytest.raises(UnsafeMemberError, match=f"manifest.json: .*{MESSAGES[kind]}"):
        tl.load(saved)
    with deadline(20), pytest.raises(TraceFileError, match="not a saved trace"):
        tl.trace(*zoo()["mlp"][:2]).save(saved, overwrite=True)
    assert "trace.json" in os.listdir(saved)  # nothing was removed


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_members_of_a_saved_trace(saved, tmp_path, kind):
    replace_with(saved, "trace.json", hostile(kind, tmp_path))
    with deadline(20), pytest.raises(UnsafeMemberError, match=f"trace.json: .*{MESSAGES[kind]}"):
        tl.load(saved)


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_progress_of_an_extraction(tmp_path, kind):
    folder = tmp_path / "x"
    partial_extraction(folder)
    replace_with(folder, "progress.json", hostile(kind, tmp_path))
    with deadline(20), pytest.raises(UnsafeMemberError, match=f"progress.json: .*{MESSAGES[kind]}"):
        tl.load_extracted(folder)
    with deadline(20), pytest.raises(UnsafeMemberError, match=f"progress.json: .*{MESSAGES[kind]}"):
        tl.extract(TwoLayer().eval(), batches(), ["fc", "head"], folder, shard_bytes=60, progress=False)


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_files_of_a_finished_extraction(tmp_path, kind):
    folder = tl.extract(TwoLayer().eval(), batches(2), ["fc"], tmp_path / "x", progress=False)
    replace_with(folder, "manifest.json", hostile(kind, tmp_path))
    with deadline(20), pytest.raises(UnsafeMemberError, match=f"manifest.json: .*{MESSAGES[kind]}"):
        tl.load_extracted(folder)
    folder = tl.extract(TwoLayer().eval(), batches(2), ["fc"], tmp_path / "y", progress=False)
    replace_with(folder, "layer_000.safetensors", hostile(kind, tmp_path))
    with deadline(20), pytest.raises(UnsafeMemberError, match=f"layer_000.safetensors: .*{MESSAGES[kind]}"):
        tl.load_extracted(folder, verify=False)


def test_a_committed_shard_replaced_by_a_fifo_is_refused_on_resume(tmp_path):
    folder = tmp_path / "x"
    partial_extraction(folder)
    shard = json.loads((folder / "progress.json").read_text())["shards"][0]["file"]
    replace_with(folder, shard, os.mkfifo)
    with deadline(20), pytest.raises(UnsafeMemberError, match=f"{shard}: is a FIFO"):
        tl.extract(TwoLayer().eval(), batches(), ["fc", "head"], folder, shard_bytes=60, progress=False)


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


JSON_CASES = {  # the text written over the file, and what the error must say
    "deep nesting past the parser": (lambda: deep(200_000), "nested deeper than 256 levels"),
    "deep nesting": (lambda: '{"format": ' + deep(300) + "}", "nested deeper than 256 levels"),
    "1e400": (lambda: '{"format": "torchlens-trace", "schema_version": 1e400}', "overflows to inf"),
    "NaN constant": (lambda: '{"format": NaN}', "non-standard constant NaN"),
    "huge integer": (lambda: '{"n": ' + "9" * 10_000 + "}", "not valid JSON"),
}


@pytest.mark.parametrize("case", list(JSON_CASES))
def test_json_that_would_crash_or_mislead_the_parser_is_refused(saved, tmp_path, case):
    text, message = JSON_CASES[case]
    with open(os.path.join(saved, "manifest.json"), "w") as f:
        f.write(text())
    with pytest.raises(TraceFileError, match=f"manifest.json: .*{message}"):
        tl.load(saved)
    folder = tmp_path / "x"
    partial_extraction(folder)
    with open(folder / "progress.json", "w") as f:
        f.write(text())
    with pytest.raises(TraceFileError, match=f"progress.json: .*{message}"):
        tl.extract(TwoLayer().eval(), batches(), ["fc", "head"], folder, shard_bytes=60, progress=False)
    with pytest.raises(TraceFileError, match=f"progress.json: .*{message}"):
        tl.load_extracted(folder)


@pytest.mark.parametrize("version, message", [
    (2, "schema version 2 was written by a newer torchlens; upgrade torchlens"),
    (0, "schema version 0 was written by an older, unsupported torchlens"),
    ("1", "the progress file has no integer schema_version"),
])
def test_a_progress_file_of_another_schema_names_the_version_on_resume(tmp_path, version, message):
    """It was refused as 'not a torchlens extraction', which hid that a newer torchlens wrote it."""
    folder = tmp_path / "x"
    partial_extraction(folder)
    state = json.loads((folder / "progress.json").read_text())
    (folder / "progress.json").write_text(json.dumps({**state, "schema_version": version}))
    with pytest.raises(TraceFileError, match=f"progress.json: {message}"):
        tl.extract(TwoLayer().eval(), batches(), ["fc", "head"], folder, shard_bytes=60, progress=False)
    (folder / "progress.json").write_text(json.dumps({**state, "format": "something-else"}))
    with pytest.raises(TraceFileError, match="progress.json: not the progress file of a torchlens extraction"):
        tl.extract(TwoLayer().eval(), batches(), ["fc", "head"], folder, shard_bytes=60, progress=False)


def test_1e400_inside_a_rehashed_trace_json_is_refused(saved):
    path = os.path.join(saved, "trace.json")
    text = pathlib.Path(path).read_text().replace('"timings":{', '"timings":{"x":1e400,', 1)
    pathlib.Path(path).write_text(text)
    manifest_path = os.path.join(saved, "manifest.json")
    manifest = json.loads(pathlib.Path(manifest_path).read_text())
    manifest["files"]["trace.json"].update(bytes=os.path.getsize(path), sha256=sha256_of(path))
    pathlib.Path(manifest_path).write_text(json.dumps(manifest))
    with pytest.raises(TraceFileError, match="trace.json: .*1e400 overflows to inf"):
        tl.load(saved)


def test_an_oversized_manifest_is_refused_without_reading_it(saved):
    with open(os.path.join(saved, "manifest.json"), "r+b") as f:
        f.truncate(65 << 20)  # sparse: no disk used, and never read
    with pytest.raises(UnsafeMemberError, match=r"manifest.json: \d+ bytes, more than the \d+ this file may hold"):
        tl.load(saved)


# ----- resume: the same job only ---------------------------------------------------------------------------
def test_resume_with_another_model_of_the_same_class_is_refused(tmp_path):
    folder = tmp_path / "x"
    partial_extraction(folder)
    with pytest.raises(ResumeMismatchError, match="extracted with another TwoLayer .*parameters or buffers differ"):
        tl.extract(TwoLayer(seed=1).eval(), batches(), ["fc", "head"], folder, shard_bytes=60, progress=False)
    tuned = TwoLayer().eval()
    with torch.no_grad():
        tuned.fc.weight[3, 5] += 1e-3  # one element of a small tensor: hashed in full
    with pytest.raises(ResumeMismatchError, match="parameters or buffers differ"):
        tl.extract(tuned, batches(), ["fc", "head"], folder, shard_bytes=60, progress=False)
    tl.extract(TwoLayer().eval(), batches(), ["fc", "head"], folder, shard_bytes=60, progress=False)
    with torch.no_grad():
        np.testing.assert_array_equal(tl.load_extracted(folder)["head"],
                                      torch.cat([TwoLayer().eval()(x) for x in batches()]).numpy())


def test_resume_with_other_arguments_is_refused(tmp_path):
    folder = tmp_path / "x"
    partial_extraction(folder, kwargs={"scale": 2.0})
    with pytest.raises(ResumeMismatchError, match="other arguments .*kwargs_sha256"):
        tl.extract(TwoLayer().eval(), batches(), ["fc", "head"], folder, kwargs={"scale": 3.0}, shard_bytes=60,
                   progress=False)
    x = torch.cat(batches())
    loader = DataLoader(TensorDataset(x), batch_size=3)
    with pytest.raises(KeyboardInterrupt):
        tl.extract(TwoLayer().eval(), interrupted(loader, 3), ["fc"], tmp_path / "y", args_of=lambda b: b[0],
                   shard_bytes=60, progress=False)
    with pytest.raises(ResumeMismatchError, match="batch_size: None then, 2 now"):
        tl.extract(TwoLayer().eval(), DataLoader(TensorDataset(x), batch_size=2), ["fc"], tmp_path / "y",
                   args_of=lambda b: b[0], shard_bytes=60, progress=False)


def test_resume_with_other_first_inputs_is_refused(tmp_path):
    folder = tmp_path / "x"
    partial_extraction(folder)
    data = batches()
    data[0] = data[0] + 1  # the boundary batch is unchanged; only the first differs
    with pytest.raises(ResumeMismatchError, match="input batch 0 differs"):
        tl.extract(TwoLayer().eval(), data, ["fc", "head"], folder, shard_bytes=60, progress=False)


def test_large_models_are_checksummed_by_sample_and_tell_checkpoints_apart():
    from torchlens.io.identity import model_checksum

    a, b = nn.Linear(512, 512), nn.Linear(512, 512)
    assert model_checksum(a) == model_checksum(a) != model_checksum(b)
    with torch.no_grad():
        b.load_state_dict(a.state_dict())
    assert model_checksum(a) == model_checksum(b)
    with torch.no_grad():
        b.weight.mul_(1.01)  # what fine-tuning does: every element moves
    assert model_checksum(a) != model_checksum(b)
    assert model_checksum(a.to(torch.float64)) != model_checksum(b.to(torch.float32))


# ----- a kill at any point recovers ---------------------------------------------------------------------------
class Killed(BaseException):
    """Stands in for SIGKILL: nothing after it runs, and no `except Exception` catches it."""


def killed_at(monkeypatch, step: int, error=Killed):
    """Make the ``step``-th file-system commit step (fsync, rename, delete) die before it happens, raising
    ``error``."""
    count = [0]
    real = {name: getattr(os, name) for name in ("fsync", "replace", "remove")}

    def dying(name):
        def call(*args, **kwargs):
            count[0] += 1
            if count[0] == step:
                raise error(f"{name} #{step}")
            return real[name](*args, **kwargs)
        return call

    for name in real:
        monkeypatch.setattr(os, name, dying(name))
    return count


def test_a_kill_at_every_file_system_step_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    model, data, layers = TwoLayer().eval(), batches(4), ["fc", "head"]
    whole = tl.extract(model, data, layers, tmp_path / "whole", shard_bytes=60, progress=False)
    expected = tl.load_extracted(whole)
    step, finished = 0, False
    while not finished:
        step += 1
        folder = tmp_path / f"k{step}"
        with monkeypatch.context() as m:
            count = killed_at(m, step)
            try:
                tl.extract(model, data, layers, folder, shard_bytes=60, progress=False)
                finished = True
            except Killed:
                pass
        assert step < 200, "the extraction never completed"
        if not finished or count[0] < step:
            tl.extract(model, data, layers, folder, shard_bytes=60, progress=False)  # the rerun after the kill
        got = tl.load_extracted(folder)
        for name in layers:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=f"killed at step {step}")
        assert sorted(os.listdir(folder)) == sorted(os.listdir(whole)), f"killed at step {step}"
    assert step > 10  # the loop did walk through the shards, the consolidation and the cleanup


def test_a_kill_while_writing_the_first_progress_file_resumes(tmp_path, monkeypatch):
    folder = tmp_path / "x"
    with monkeypatch.context() as m:
        killed_at(m, 2)  # step 1 is the fsync of progress.json.tmp, step 2 its rename into place
        with pytest.raises(Killed):
            tl.extract(TwoLayer().eval(), batches(2), ["fc"], folder, progress=False)
    assert os.listdir(folder) == ["progress.json.tmp"]
    tl.extract(TwoLayer().eval(), batches(2), ["fc"], folder, progress=False)
    assert tl.load_extracted(folder)["fc"].shape == (6, 8)


# An interrupt, or a file step Windows refuses (a file another program holds open, a read-only file).
@pytest.mark.parametrize("error", [KeyboardInterrupt, PermissionError])
@pytest.mark.parametrize("foreign", [False, True])
def test_saving_over_a_trace_failing_at_any_step_leaves_one_whole_trace_and_the_other_files(tmp_path, monkeypatch,
                                                                                           error, foreign):
    old, new = tl.trace(*zoo()["mlp"][:2]), tl.trace(*zoo()["small_cnn"][:2])
    assert len(old) != len(new)
    step, finished = 0, False
    while not finished:
        step += 1
        folder = old.save(tmp_path / f"s{step}")
        if foreign:
            with open(os.path.join(folder, "notes.txt"), "w") as f:
                f.write("keep me")
        with monkeypatch.context() as m, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            count = killed_at(m, step, error)
            try:
                new.save(folder, overwrite=True)
                finished = count[0] < step
            except (error, TraceFileError):  # a refused move is said in a TraceFileError
                pass
        assert len(tl.load(folder)) in (len(old), len(new)), f"failed at step {step}"
        assert not foreign or pathlib.Path(folder, "notes.txt").read_text() == "keep me"
        assert step < 100, "the save never completed"
    assert step > 8  # the loop walked through the writes, the swap and the deletion of the old files


def test_old_files_that_cannot_be_deleted_after_the_new_trace_is_saved_are_a_warning(saved, tmp_path, monkeypatch):
    new = tl.trace(*zoo()["small_cnn"][:2])

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)  # as Windows answers for a file held open

    monkeypatch.setattr(os, "remove", refused)
    with pytest.warns(UserWarning, match=r"the new trace is saved, but .*left in .*torchlens-save-.*-old"):
        assert new.save(saved, overwrite=True) == saved
    monkeypatch.undo()
    assert len(tl.load(saved)) == len(new)


def test_saving_over_a_trace_a_loaded_copy_still_holds_is_refused_clearly_and_keeps_it(saved, monkeypatch):
    # tl.load maps the activations file; Windows will not move a folder holding a file that is in use.
    loaded, new = tl.load(saved), tl.trace(*zoo()["small_cnn"][:2])
    refuse_held_files(monkeypatch)
    with pytest.raises(TraceFileError, match=r"cannot save over .*activations.safetensors could not be moved .*left "
                                             r"as it was.*a trace tl.load read from it holds its activations file"):
        new.save(saved, overwrite=True)
    assert len(tl.load(saved)) == len(loaded) and sorted(os.listdir(os.path.dirname(saved))) == ["t"]
    del loaded
    gc.collect()
    new.save(saved, overwrite=True)  # released: the save goes through
    assert len(tl.load(saved)) == len(new)
