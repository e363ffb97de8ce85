"""The files and paths that saving, loading and extracting are given (missing optional packages, paths of
unusual kinds), and what a loaded trace or extraction holds: open files, and activations written in place."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.io import TraceFileError

LOAD_EXTRACTED_WITHOUT_NUMPY = textwrap.dedent("""
    import sys
    sys.modules["numpy"] = None  # as if it were not installed
    import torch
    import torchlens as tl

    folder = sys.argv[1]
    try:
        tl.load_extracted(folder)
    except ImportError as exc:
        print(type(exc).__name__, exc)
    print(torch.equal(tl.load_extracted(folder, as_torch=True)["output_1"], torch.load(sys.argv[2])))
""")


def test_without_numpy_load_extracted_names_the_package_and_as_torch_still_reads(tmp_path):
    model, batch = nn.Linear(4, 2).eval(), torch.randn(3, 4)
    tl.extract(model, [batch], ["output_1"], tmp_path / "features", progress=False)
    with torch.no_grad():
        torch.save(model(batch), tmp_path / "expected.pt")
    script = tmp_path / "without_numpy.py"
    script.write_text(LOAD_EXTRACTED_WITHOUT_NUMPY)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "features"), str(tmp_path / "expected.pt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "MissingPackage tl.load_extracted (it returns numpy arrays unless as_torch=True, which needs no numpy) needs "
        "numpy: pip install numpy",
        "True"]


def test_a_bytes_path_saves_loads_and_extracts_like_its_str(tmp_path):
    model, batch = nn.Linear(4, 2).eval(), torch.randn(3, 4)
    log = tl.trace(model, batch)
    folder = bytes(tmp_path / "run")  # os.fsencode: what os.listdir(b".") gives back
    assert log.save(folder) == str(tmp_path / "run")
    assert torch.equal(tl.load(folder)[-1].activation, log[-1].activation)
    log.save(folder, overwrite=True)
    assert tl.extract(model, [batch], ["output_1"], bytes(tmp_path / "features"), progress=False) == \
        str(tmp_path / "features")
    assert torch.equal(tl.load_extracted(bytes(tmp_path / "features"), as_torch=True)["output_1"], log[-1].activation)


def _open_files_under(folder) -> list:
    """The files under ``folder`` this process holds open (through ``/dev/fd``, on Linux and macOS)."""
    held = []
    for fd in os.listdir("/dev/fd"):
        try:
            held.append(os.readlink(f"/dev/fd/{fd}"))
        except OSError:  # closed since listed (the listing's own descriptor), or not a link (macOS)
            continue
    return [path for path in held if path.startswith(str(folder))]


@pytest.mark.skipif(not os.path.isdir("/dev/fd") or sys.platform == "win32", reason="reads /dev/fd")
def test_loaded_layers_hold_no_open_file_each(tmp_path):
    # Each layer is a memory map of its own file; a map kept a file descriptor open while it lived, so an extraction
    # of a few hundred layers could not be loaded under the open-file limit (256 on macOS).
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(24)]).eval()
    data = [torch.randn(2, 3) for _ in range(2)]
    tl.extract(model, data, [str(i) for i in range(24)], tmp_path / "features", progress=False)
    with torch.no_grad():
        expected = torch.cat([model(x) for x in data])
    for as_torch in (False, True):
        layers = tl.load_extracted(tmp_path / "features", as_torch=as_torch)
        assert _open_files_under(tmp_path) == []
        assert torch.equal(torch.as_tensor(layers["23"]), expected)
    arrays = tl.load_extracted(tmp_path / "features")
    assert isinstance(arrays["0"], np.memmap) and arrays["0"].mode == "r"
    assert arrays["0"].filename.endswith(".safetensors")
    with pytest.raises(ValueError, match="read-only"):
        arrays["0"][0, 0] = 1.0
    tensors = tl.load_extracted(tmp_path / "features", as_torch=True)
    tensors["23"][0, 0] = 1e6  # copy-on-write: never reaches the file
    assert torch.equal(tl.load_extracted(tmp_path / "features", as_torch=True)["23"], expected)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="only Linux names files with any bytes")
def test_an_extraction_in_a_folder_whose_name_is_not_utf8_loads(tmp_path):
    # torch opens only UTF-8 names; such a folder's layers are mapped the way Python maps files.
    model, batch = nn.Linear(4, 2).eval(), torch.randn(3, 4)
    out = os.fsdecode(bytes(tmp_path) + b"/caf\xe9")  # Latin-1 bytes, as an older system wrote the name
    tl.extract(model, [batch], ["output_1"], out, progress=False)
    with torch.no_grad():
        expected = model(batch)
    assert torch.equal(tl.load_extracted(out, as_torch=True)["output_1"], expected)
    assert torch.equal(torch.as_tensor(tl.load_extracted(out)["output_1"]), expected)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="only Linux names files with any bytes")
def test_a_trace_saved_in_a_folder_whose_name_is_not_utf8_loads(tmp_path):
    # The safetensors library opens only UTF-8 names: tl.load refused such a folder as "not a readable file".
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    log = tl.trace(model, torch.randn(3, 4), grads=True, intervene={"0": lambda value, op: value * 2})
    log.backward(log.output.sum())
    loaded = tl.load(log.save(os.fsdecode(bytes(tmp_path) + b"/caf\xe9")))
    for op in log:
        assert torch.equal(loaded[op.label].activation, op.activation), op.label
    assert torch.equal(loaded["0"].original, log["0"].original) and torch.equal(loaded["0"].grad, log["0"].grad)


def test_a_loaded_activation_written_in_place_reads_as_dropped_as_a_live_one_does(tmp_path):
    # It showed the written values, and saving the loaded trace again recorded them as what the op made.
    model, x = nn.Sequential(nn.Linear(4, 3), nn.ReLU()).eval(), torch.randn(2, 4)
    log = tl.trace(model, x)
    loaded = tl.load(log.save(tmp_path / "run"))
    loaded["0"].activation.zero_()
    with pytest.raises(tl.ActivationUnavailable, match="written in place after the trace ended"):
        loaded["0"].activation
    assert torch.equal(loaded["relu_1_2"].activation, log["relu_1_2"].activation)  # the others are untouched
    again = tl.load(loaded.save(tmp_path / "again"))
    with pytest.raises(tl.ActivationUnavailable, match="written in place after the trace ended"):
        again["0"].activation
    assert torch.equal(again["relu_1_2"].activation, log["relu_1_2"].activation)
    with torch.inference_mode():  # its tensors have no version counter: a write cannot be seen, as in a live trace
        assert torch.equal(tl.load(tmp_path / "run")["0"].activation, log["0"].activation)


def test_a_save_path_through_a_folder_not_made_yet_is_made_as_the_system_resolves_it(tmp_path, monkeypatch):
    # "sub/../run" reaches run through sub, so sub must exist first (as `mkdir -p` makes it); read lexically,
    # the path lay in the current folder, and renaming the written trace onto it failed with a bare OSError.
    monkeypatch.chdir(tmp_path)
    log = tl.trace(nn.Linear(3, 2), torch.randn(2, 3))
    assert log.save(os.path.join("sub", "..", "run")) == os.path.join("sub", "..", "run")
    assert (tmp_path / "sub").is_dir()
    assert torch.equal(tl.load(tmp_path / "run")["linear_1_1"].activation, log["linear_1_1"].activation)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "sub"]  # no staging folder left


def test_a_file_through_a_missing_folder_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    log = tl.trace(nn.Linear(3, 2), torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"is in .*/missing/\.\., which does not exist"):
        log.to_chrome_trace(os.path.join("missing", "..", "t.json"))
    assert list(tmp_path.iterdir()) == []


def test_a_save_path_ending_in_a_dot_or_two_is_refused_and_leaves_the_folders_as_they_were(tmp_path, monkeypatch):
    # A save writes beside the path and renames into place; beside "run/." is inside run, and no "." renames:
    # "new/." failed with a bare OSError and left an empty folder, "trace/." moved its own working folder around
    # and warned of it as a file of the user's.
    monkeypatch.chdir(tmp_path)
    log = tl.trace(nn.Linear(3, 2), torch.randn(2, 3))
    log.save("trace")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    before = {p.name: p.read_bytes() for p in (tmp_path / "trace").iterdir()}
    for path, last in [("new/.", "'.'"), ("empty/.", "'.'"), ("empty/sub/..", "'..'"), ("new/sub/..", "'..'"),
                       ("trace/.", "'.'")]:
        with pytest.raises(tl.TorchlensError, match=f"ends in {last}; name the folder to save the trace to without"):
            log.save(path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "trace"]
    assert [p.name for p in (tmp_path / "empty").iterdir()] == ["sub"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "trace").iterdir()} == before
    log.save("./run")  # a "." elsewhere in the path names no folder to rename
    assert torch.equal(tl.load("run")["linear_1_1"].activation, log["linear_1_1"].activation)


def test_loading_under_fake_tensor_mode_is_refused_naming_the_mode_not_the_file(tmp_path):
    # FakeTensorMode makes tensors without values: tl.load reported a sound activations file as "not a readable
    # safetensors file", and tl.load_extracted failed inside torch (aten::from_file has no fake impl).
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, batch = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), torch.randn(3, 4)
    log = tl.trace(model, batch)
    folder = log.save(tmp_path / "t")
    tl.extract(model, [batch], ["0"], tmp_path / "e", progress=False)
    for read in (lambda: tl.load(folder), lambda: tl.load_extracted(tmp_path / "e"),
                 lambda: tl.load_extracted(tmp_path / "e", as_torch=True)):
        with FakeTensorMode(), pytest.raises(RuntimeError, match=r"\.safetensors: .* runs under FakeTensorMode, "
                                                                  r".*outside the FakeTensorMode block"):
            read()
    loaded = tl.load(folder)  # outside it, the same files read as saved
    assert torch.equal(loaded["0"].activation, log["0"].activation)
    assert torch.equal(tl.load_extracted(tmp_path / "e", as_torch=True)["0"], model[0](batch).detach())


def test_a_path_starting_with_a_tilde_is_under_the_home_folder_as_a_shell_reads_it(tmp_path, monkeypatch):
    """``~/runs/a`` names a folder in the home folder, as the shell and pandas read it; taken literally it made a
    folder named ``~`` in the working folder, which a user deleting it with ``rm -r ~`` would regret."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    model, batch = nn.Linear(4, 2).eval(), torch.randn(3, 4)
    log = tl.trace(model, batch)
    assert log.save("~/runs/a") == str(home / "runs" / "a")
    assert torch.equal(tl.load("~/runs/a")[-1].activation, log[-1].activation)
    assert tl.extract(model, [batch], ["output_1"], "~/features", progress=False) == str(home / "features")
    assert torch.equal(tl.load_extracted("~/features", as_torch=True)["output_1"], log[-1].activation)
    log.render("~/graph.dot")
    log.to_chrome_trace("~/host.json")
    tl.report.kernel_profile(model, batch, chrome_trace="~/kernels.json")
    assert sorted(os.listdir(home)) == ["features", "graph.dot", "host.json", "kernels.json",
                                        "kernels.json.torchlens.json", "runs"]
    assert os.listdir(work) == []


SAVE_PAST_THE_FILE_SIZE_LIMIT = textwrap.dedent("""
    import os, resource, signal, sys
    import torch
    import torchlens as tl

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    log = tl.trace(torch.nn.Linear(256, 256), torch.randn(8, 256))
    try:
        log.save(os.path.join(sys.argv[1], "made", "for", "run"))
    except OSError as exc:
        print(type(exc).__name__)
    print(os.listdir(sys.argv[1]))
""")


@pytest.mark.skipif(sys.platform == "win32", reason="file size limits are a POSIX resource")
def test_a_save_that_fails_part_way_removes_the_folders_it_made_for_the_path(tmp_path):
    """The folders a save made on the way to its path (here ``made/for``) are removed when it fails (the
    weights file outgrows the process's file size limit, as on a full disk), rather than left empty."""
    script = tmp_path / "save_past_limit.py"
    script.write_text(SAVE_PAST_THE_FILE_SIZE_LIMIT)
    (tmp_path / "out").mkdir()
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["OSError", "[]"]


@pytest.mark.skipif(not hasattr(os, "pathconf"), reason="asks the file system's name limit")
def test_a_name_longer_than_the_file_system_allows_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A save, an extraction or a picture whose path holds a name past the file system's limit failed with the
    system's "File name too long" only as the folder was moved in, after the whole trace was written (or the
    layout made), leaving the folders made on the way to it; it is now refused first, naming the limit."""
    monkeypatch.chdir(tmp_path)
    long_name = "a" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1)
    model, batch = nn.Linear(4, 2).eval(), torch.randn(3, 4)
    log = tl.trace(model, batch)
    for path in (long_name, os.path.join("made", long_name, "run")):
        with pytest.raises(TraceFileError, match=rf"cannot save to .*: it has a name of {len(long_name)} bytes "
                                                    r"\(a{24}\.\.\.\), longer than the \d+ its file system allows"):
            log.save(path)
    with pytest.raises(TraceFileError, match="cannot extract to .*: it has a name of"):
        tl.extract(model, [batch], ["output_1"], long_name, progress=False)
    with pytest.raises(ValueError, match="has a name of .*, longer than the"):
        log.render(long_name + ".dot")
    assert os.listdir(tmp_path) == []
