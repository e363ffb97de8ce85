"""Streaming extraction resumed: after a kill, after an interrupt in the same process, with a model whose
buffers the forwards update, and refused when the inputs, layers or model differ from the interrupted run's."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import runpy
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.io import ResumeMismatchError, TraceFileError
from streams import batches, interrupted
from test_extract import TwoLayer

SCRIPT = textwrap.dedent('''
    import sys, time
    import torch, torch.nn as nn
    import torchlens as tl

    class Slow(nn.Module):
        def __init__(self, pause=0.0):
            super().__init__()
            torch.manual_seed(0)
            self.pause = pause
            self.fc = nn.Linear(8, 8)
            self.out = nn.Linear(8, 3)

        def forward(self, x):
            time.sleep(self.pause)  # makes the run long enough to be killed in the middle
            return self.out(torch.relu(self.fc(x)))

    g = torch.Generator().manual_seed(1)
    BATCHES = [torch.randn(3, 8, generator=g) for _ in range(24)]
    LAYERS = ["fc", "relu_1_2", "out"]

    if __name__ == "__main__":
        tl.extract(Slow(float(sys.argv[2])).eval(), BATCHES, LAYERS, sys.argv[1], shard_bytes=400, progress=False)
''')


def hooked_reference(model, batches):
    """What a hand-written forward-hook extractor gets for the same layers."""
    got = {"fc": [], "relu_1_2": [], "out": []}
    handles = [model.fc.register_forward_hook(lambda m, i, o: got["fc"].append(o)),
               model.out.register_forward_hook(lambda m, i, o: got["out"].append(o))]
    try:
        with torch.no_grad():
            for x in batches:
                model(x)
                got["relu_1_2"].append(torch.relu(got["fc"][-1]))
    finally:
        for h in handles:
            h.remove()
    return {k: torch.cat(v).numpy() for k, v in got.items()}


def progress_of(folder):
    try:
        return json.loads(pathlib.Path(folder, "progress.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def test_a_killed_extraction_resumes_to_the_uninterrupted_result(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, str(script), str(out), "0.05"], env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            state = progress_of(out)
            if state and state["batches_done"] >= 6:
                break
            assert child.poll() is None, "the run ended before it could be interrupted"
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    state = progress_of(out)
    assert not state["complete"] and 6 <= state["batches_done"] < 24
    assert not os.path.exists(out / "manifest.json")

    subprocess.run([sys.executable, str(script), str(out), "0"], env=env, check=True, timeout=300)
    job = runpy.run_path(str(script))
    whole = tl.extract(job["Slow"]().eval(), job["BATCHES"], job["LAYERS"], tmp_path / "whole", shard_bytes=400,
                       progress=False)
    resumed, uninterrupted = tl.load_extracted(out), tl.load_extracted(whole)
    expected = hooked_reference(job["Slow"]().eval(), job["BATCHES"])
    for name in job["LAYERS"]:
        assert resumed[name].shape == (72,) + expected[name].shape[1:]
        np.testing.assert_array_equal(resumed[name], uninterrupted[name])
        np.testing.assert_array_equal(resumed[name], expected[name])
    assert sorted(os.listdir(out)) == sorted(os.listdir(whole))  # no shard or temporary file left behind


def test_in_process_interruption_resumes_without_duplicates(tmp_path):
    model, data = TwoLayer().eval(), batches()
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 7), ["fc", "head"], tmp_path / "x", shard_bytes=300, progress=False)
    state = progress_of(tmp_path / "x")
    assert len(state["shards"]) >= 2 and state["batches_done"] < 7  # bounded shards, committed in order
    tl.extract(model, data, ["fc", "head"], tmp_path / "x", shard_bytes=300, progress=False)
    got = tl.load_extracted(tmp_path / "x")
    with torch.no_grad():
        np.testing.assert_array_equal(got["head"], torch.cat([model(x) for x in data]).numpy())
        np.testing.assert_array_equal(got["fc"], torch.cat([model.fc(x) for x in data]).numpy())
    assert tl.extract(model, data, ["fc", "head"], tmp_path / "x", progress=False) == str(tmp_path / "x")


class TrainModeNorm(nn.Module):
    """BatchNorm in train mode: every forward updates its running statistics (buffers)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_a_model_whose_forwards_update_its_buffers_resumes_in_the_same_process(tmp_path):
    """The extraction's own forwards move a train-mode BatchNorm's running statistics; resuming with that same
    model was refused as another model, while one rebuilt from its checkpoint (a killed run) resumed."""
    data = [torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    model = TrainModeNorm().train()
    with pytest.raises(KeyboardInterrupt):  # a shard per two batches: batch 4 ran, moving the statistics, uncommitted
        tl.extract(model, interrupted(data, 5), ["bn", "head"], tmp_path / "x", shard_bytes=1500, progress=False)
    assert progress_of(tmp_path / "x")["batches_done"] == 4
    tl.extract(model, data, ["bn", "head"], tmp_path / "x", shard_bytes=1500, progress=False)
    tl.extract(TrainModeNorm().train(), data, ["bn", "head"], tmp_path / "y", shard_bytes=1500, progress=False)
    resumed, whole = tl.load_extracted(tmp_path / "x"), tl.load_extracted(tmp_path / "y")
    for name in ("bn", "head"):
        np.testing.assert_array_equal(resumed[name], whole[name])
    other = TrainModeNorm().train()
    with torch.no_grad():
        other.head.weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 4), ["bn"], tmp_path / "z", shard_bytes=100, progress=False)
    with pytest.raises(ResumeMismatchError, match="parameters or buffers differ"):
        tl.extract(other, data, ["bn"], tmp_path / "z", shard_bytes=100, progress=False)


class FailsOnFiveRows(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if x.shape[0] == 5:
            raise ValueError("a batch of five rows")
        return self.fc(x)


def test_a_model_error_names_the_batch_and_what_is_kept(tmp_path):
    """The model's own error said nothing of which batch of the dataset raised, nor that a rerun resumes."""
    data = [torch.randn(2, 4)] * 4 + [torch.randn(5, 4)] + [torch.randn(2, 4)] * 2
    with pytest.raises(ValueError, match="a batch of five rows") as raised:
        tl.extract(FailsOnFiveRows(), data, ["fc"], tmp_path / "x", shard_bytes=10, progress=False)
    assert f"tl.extract: raised while tracing batch 4 (counting from 0); 4 batches are committed in {tmp_path / 'x'}" \
        in "\n".join(raised.value.__notes__)
    assert progress_of(tmp_path / "x")["batches_done"] == 4
    data[4] = torch.randn(3, 4)
    tl.extract(FailsOnFiveRows(), data, ["fc"], tmp_path / "x", shard_bytes=10, progress=False)
    assert tl.load_extracted(tmp_path / "x")["fc"].shape == (15, 2)


def test_resuming_with_other_inputs_or_layers_is_refused(tmp_path):
    model, data = TwoLayer().eval(), batches()
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 6), ["fc"], tmp_path / "x", shard_bytes=100, progress=False)
    with pytest.raises(ValueError, match="holds an extraction of TwoLayer layers"):
        tl.extract(model, data, ["head"], tmp_path / "x", progress=False)
    with pytest.raises(ValueError, match="differs from the one the interrupted run committed"):
        tl.extract(model, batches(seed=3), ["fc"], tmp_path / "x", shard_bytes=100, progress=False)
    with pytest.raises(TraceFileError, match="incomplete"):
        tl.load_extracted(tmp_path / "x")


def test_a_finished_extraction_without_its_manifest_is_refused_as_such_not_sent_to_finish(tmp_path):
    # A copy that missed manifest.json was called "incomplete; call tl.extract again with the same arguments to finish
    # it", and that call, finding the run complete, returned the folder as it was, which was refused again.
    model, data = TwoLayer().eval(), batches()
    folder = tl.extract(model, data, ["fc"], tmp_path / "x", progress=False)
    os.remove(os.path.join(folder, "manifest.json"))
    missing = r"the extraction finished, but its manifest.json is missing .* copy the whole folder again"
    with pytest.raises(TraceFileError, match=missing):
        tl.load_extracted(folder)
    with pytest.raises(TraceFileError, match=missing):
        tl.extract(model, data, ["fc"], folder, progress=False)


def test_a_resume_of_a_run_started_by_the_first_torchlens_to_extract_says_it_cannot_be_checked(tmp_path):
    # Its progress file keeps no checksum of the model and no arguments: the resume was refused as a run of "another
    # TwoLayer (its parameters or buffers differ: checksum None vs ...)", the model that started it.
    model, data = TwoLayer().eval(), batches()
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 6), ["fc"], tmp_path / "x", shard_bytes=100, progress=False)
    first = {k: v for k, v in progress_of(tmp_path / "x").items()
             if k not in ("model_sha256", "model_sha256_at_stop", "arguments")}
    pathlib.Path(tmp_path, "x", "progress.json").write_text(json.dumps(first))
    with pytest.raises(ResumeMismatchError, match="started by an earlier torchlens, which recorded neither a checksum"):
        tl.extract(model, data, ["fc"], tmp_path / "x", shard_bytes=100, progress=False)


@pytest.mark.parametrize("how", ["bound method", "partial", "lambda with root"])
def test_resuming_a_callable_checks_the_weights_of_the_model_it_runs(tmp_path, how):
    """A resume checks the model's weights; through a bound method or a partial it checked only their type,
    so an extraction restarted after the weights changed mixed rows of two models."""
    model, data = TwoLayer().eval(), batches()
    run = {"bound method": model.forward, "partial": functools.partial(model),
           "lambda with root": lambda x: model(x)}[how]
    root = {"root": model} if how == "lambda with root" else {}
    with pytest.raises(KeyboardInterrupt):
        tl.extract(run, interrupted(data, 6), ["fc"], tmp_path / "x", shard_bytes=100, progress=False, **root)
    with torch.no_grad():
        model.fc.weight.mul_(2)
    with pytest.raises(ValueError, match="extracted with another TwoLayer"):
        tl.extract(run, data, ["fc"], tmp_path / "x", shard_bytes=100, progress=False, **root)
    with torch.no_grad():
        model.fc.weight.div_(2)
    tl.extract(run, data, ["fc"], tmp_path / "x", shard_bytes=100, progress=False, **root)
    with torch.no_grad():
        np.testing.assert_array_equal(tl.load_extracted(tmp_path / "x")["fc"],
                                      torch.cat([model.fc(x) for x in data]).numpy())


@pytest.mark.parametrize("wrap", [nn.DataParallel, torch.compile])
def test_a_wrapped_model_is_extracted_by_the_layer_names_of_the_model_it_wraps(tmp_path, wrap):
    """tl.trace traces the module a DataParallel/DDP/torch.compile wrapper holds; extraction named the wrapper
    as that module's root and was refused with an error about a root= it had not been given."""
    model, data = TwoLayer().eval(), batches(3)
    tl.extract(wrap(model), data, ["fc", "head"], tmp_path / "x", progress=False)
    again = tl.extract(wrap(model), data, ["fc", "head"], tmp_path / "x", progress=False)  # a resume checks it too
    with torch.no_grad():
        np.testing.assert_array_equal(tl.load_extracted(again)["fc"], torch.cat([model.fc(x) for x in data]).numpy())


def test_a_callable_naming_no_model_warns_that_a_resume_cannot_be_checked(tmp_path):
    model, data = TwoLayer().eval(), batches(3)
    done = tl.extract(lambda x: model(x), data, ["linear_1_1"], tmp_path / "x", progress=False)
    with pytest.warns(UserWarning, match="names no model.*pass root="):
        assert tl.extract(lambda x: model(x), data, ["linear_1_1"], tmp_path / "x", progress=False) == done


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(rows=s["rows"] - 1), "the shards hold 12 rows, but 'rows' says 11"),
    (lambda s: s.update(rows=-1), "'rows' is -1, not a count"),
    (lambda s: s.update(batches_done=s["batches_done"] + 1), r"the shards hold batches \[0, 3\), but 'batches_done'"),
    (lambda s: s["shards"][1].update(batches=[0, 2]), r"holds batches \[0, 2\], where \[1, <end>\) follows"),
    (lambda s: s.update(layer_info=s["layer_info"][:1]), "'layer_info' is not a list of 2 entries"),
    (lambda s: s["layer_info"][0].update(dtype={}), "is not the layer 'fc''s name, label, dtype and row shape"),
    (lambda s: s["layer_info"][1].update(row_shape=[]), r"its column 1 is not F32 of shape \[4\]"),
    (lambda s: s["shards"][0].update(rows=5), "the shards hold 13 rows"),
    (lambda s: s.update(shards={}), "'shards' is not a list of shard records"),
])
def test_a_damaged_progress_file_is_refused_before_a_resume_uses_it(tmp_path, edit, message):
    # progress.json has no hash (it is rewritten as shards commit); a resume trusted it, and a wrong row count was
    # joined into layer files of that many rows, with no error.
    model, data = TwoLayer().eval(), batches(6)
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 3), ["fc", "head"], tmp_path / "x", shard_bytes=1, progress=False)
    path = tmp_path / "x" / "progress.json"
    state = json.loads(path.read_text())
    assert state["batches_done"] == 3 and len(state["shards"]) == 3
    edit(state)
    path.write_text(json.dumps(state))
    with pytest.raises(TraceFileError, match=message):
        tl.extract(model, data, ["fc", "head"], tmp_path / "x", shard_bytes=1, progress=False)
    assert not (tmp_path / "x" / "manifest.json").exists()


class _ShiftedWide(nn.Module):
    """A layer of more weights than the resume check reads in full, and a buffer added to its output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(300, 300)
        self.register_buffer("shift", torch.zeros(300))

    def forward(self, x):
        return self.fc(x) + self.shift


@pytest.mark.parametrize("change", ["buffer", "last weight"])
def test_resuming_with_a_changed_buffer_or_a_changed_last_weight_is_refused(tmp_path, change):
    # A buffer is part of the model as much as a weight is; of a large weight, a sample of its values is read,
    # spread over all of it, its last value included.
    data = [torch.randn(2, 300, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model = _ShiftedWide().eval()
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 2), ["fc"], tmp_path / "x", shard_bytes=1, progress=False)
    with torch.no_grad():
        (model.shift if change == "buffer" else model.fc.weight[-1])[-1] += 1.0
    with pytest.raises(ResumeMismatchError, match="parameters or buffers differ"):
        tl.extract(model, data, ["fc"], tmp_path / "x", shard_bytes=1, progress=False)


class Activated(nn.Module):
    """Takes its activation function, and a generator, as keyword arguments."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 3)

    def forward(self, x, act=None, generator=None):
        return act(self.fc(x))


def _activation(kind):
    # A fresh function each call, as a script run again after a kill defines it anew (at another address).
    def act(t):
        return getattr(torch, kind)(t)
    return act


def test_a_rerun_with_keyword_functions_and_generators_resumes(tmp_path):
    # The job hashed the keyword arguments' reprs, memory addresses included ("<function act at 0x7f...>"): the
    # same call, made again by a new process after a kill, was refused as one with other arguments.
    model, data = Activated().eval(), batches(6)
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 4), ["fc"], tmp_path / "f", shard_bytes=1, progress=False,
                   kwargs={"act": _activation("tanh"), "generator": torch.Generator()})
    tl.extract(model, data, ["fc"], tmp_path / "f", shard_bytes=1, progress=False,
               kwargs={"act": _activation("tanh"), "generator": torch.Generator()})
    with torch.no_grad():
        assert np.array_equal(tl.load_extracted(tmp_path / "f")["fc"], torch.cat([model.fc(x) for x in data]).numpy())
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 4), ["fc"], tmp_path / "g", shard_bytes=1, progress=False,
                   kwargs={"act": _activation("tanh")})
    with pytest.raises(ResumeMismatchError, match="kwargs_sha256"):  # another function is still another call
        tl.extract(model, data, ["fc"], tmp_path / "g", shard_bytes=1, progress=False, kwargs={"act": torch.sigmoid})


class _FailsOnFirstBatch(TwoLayer):
    def forward(self, x):
        raise RuntimeError("the model failed")


@pytest.mark.parametrize("how", ["mistyped layer", "model fails", "no batches", "no tqdm for its bar"])
def test_a_run_that_commits_no_batch_leaves_no_folder_to_finish(tmp_path, monkeypatch, how):
    """A run that stopped before its first batch was committed left a folder holding a progress file alone, which
    tl.load_extracted called an incomplete extraction to finish with the same arguments: they stop the same way."""
    model, layers, data, error = {
        "mistyped layer": (TwoLayer(), ["fcc"], batches(3), "named 'fcc'"),
        "model fails": (_FailsOnFirstBatch(), ["fc"], batches(3), "the model failed"),
        "no batches": (TwoLayer(), ["fc"], [], "no batches"),
        "no tqdm for its bar": (TwoLayer(), ["fc"], batches(3), "progress=True needs tqdm")}[how]
    progress = how == "no tqdm for its bar"
    if progress:
        monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # as if tqdm were not installed
    with pytest.raises(Exception, match=error) as raised:
        tl.extract(model.eval(), data, layers, tmp_path / "new" / "x", progress=progress)
    assert not os.path.lexists(tmp_path / "new")  # nor the folder made on the way to it
    if how == "model fails":  # the note said a call with the same arguments resumes after the 0 committed batches
        assert "no batch was committed yet, so nothing is kept in" in "".join(raised.value.__notes__)
    (tmp_path / "mine").mkdir()
    with pytest.raises(Exception, match=error):
        tl.extract(model.eval(), data, layers, tmp_path / "mine", progress=progress)
    assert os.listdir(tmp_path / "mine") == []  # a folder that was there is kept, emptied of what the run wrote
    tl.extract(TwoLayer().eval(), batches(3), ["fc"], tmp_path / "mine", progress=False)
    assert tl.load_extracted(tmp_path / "mine")["fc"].shape == (12, 8)


class WrappedWeight(nn.Module):
    """A Linear whose weight is a wrapper tensor subclass, as torchao's quantized weights are: no storage of its own,
    its values in the tensors it wraps."""

    def __init__(self, shift: float = 0.0):
        super().__init__()
        from torch.testing._internal.two_tensor import TwoTensor

        torch.manual_seed(0)
        weight = torch.randn(2, 4)
        self.weight = nn.Parameter(TwoTensor(weight, weight + shift))

    def forward(self, x):
        linear = nn.functional.linear(x, self.weight)
        return linear.a + linear.b


def test_a_model_with_a_wrapper_subclass_weight_extracts_and_resumes_only_with_its_values(tmp_path):
    """Reading the weights for the resume check failed inside torch (".numpy() is not supported for tensor
    subclasses"): no model holding such a weight could be extracted at all."""
    data = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    model = WrappedWeight()
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 2), ["add_1_2"], tmp_path / "x", shard_bytes=1, progress=False)
    with pytest.raises(ResumeMismatchError, match="parameters or buffers differ"):
        tl.extract(WrappedWeight(shift=1.0), data, ["add_1_2"], tmp_path / "x", shard_bytes=1, progress=False)
    tl.extract(WrappedWeight(), data, ["add_1_2"], tmp_path / "x", shard_bytes=1, progress=False)
    with torch.no_grad():
        expected = torch.cat([model(x) for x in data])
    assert torch.equal(tl.load_extracted(tmp_path / "x", as_torch=True)["add_1_2"], expected)
