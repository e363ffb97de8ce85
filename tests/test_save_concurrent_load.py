"""A ``tl.load`` of a folder while a save over it (another process, or thread) moves its new trace in.  The load took
the old trace the save had moved aside for a killed save's: it put it back over the new one being moved in, the save
failing with a bare FileNotFoundError and the new trace lost, or deleted its files as the save deleted them, and
either way warned that a save had not finished.  The load now waits for the save, and reads the new trace."""

from __future__ import annotations

import os
import sys
import threading
import warnings

import pytest
import torch

import torchlens as tl
from torchlens.io import recover


def _paused(step, moved_aside: threading.Event, resume: threading.Event):
    """The save's ``step`` that stops once the old trace is moved aside, until ``resume`` is set."""
    def paused(*args):
        if step.__name__ == "_swap_folders":
            path, _, retired = args
            if not os.path.lexists(retired):
                os.replace(path, retired)  # its first move; the rest of it goes on after the pause
        moved_aside.set()
        assert resume.wait(30)
        return step(*args)
    return paused


def _waits_noted(loader: list, waiting: threading.Event):
    """``recover._lock`` that sets ``waiting`` when the loading thread waits for a lock."""
    lock = recover._lock

    def noted(folder, wait):
        if wait and threading.current_thread() is loader[0]:
            waiting.set()
        return lock(folder, wait)
    return noted


# Paused between the two moves of a whole folder, or, with a file of the user's in the folder, while the old
# trace's files moved aside are deleted.
@pytest.mark.parametrize("step", ["_swap_folders", "_discard_retired"])
def test_a_load_while_a_save_moves_its_trace_in_waits_for_it_and_reads_the_new_trace(tmp_path, monkeypatch, two_traces,
                                                                                     step):
    old, new = two_traces
    folder = old.save(tmp_path / "run")
    if step == "_discard_retired":
        (tmp_path / "run" / "notes.txt").write_text("mine")
    moved_aside, resume, waiting = threading.Event(), threading.Event(), threading.Event()
    save_module = sys.modules["torchlens.io.save"]
    monkeypatch.setattr(save_module, step, _paused(getattr(save_module, step), moved_aside, resume))
    saved, loaded, loader = [], [], []
    monkeypatch.setattr(recover, "_lock", _waits_noted(loader, waiting))
    saver = threading.Thread(target=lambda: saved.append(_outcome(lambda: new.save(folder, overwrite=True))))
    loader.append(threading.Thread(target=lambda: loaded.append(_outcome(lambda: tl.load(folder)))))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saver.start()
        assert moved_aside.wait(30)
        loader[0].start()
        waiting.wait(10)  # the load waits for the save (it did not, and took the old trace for a killed save's)
        resume.set()
        saver.join(30)
        loader[0].join(30)
    assert saved == [folder] and isinstance(loaded[0], tl.Trace), (saved, loaded)
    assert [op.label for op in loaded[0]] == [op.label for op in new]
    assert torch.equal(loaded[0]["1"].activation, new["1"].activation)
    assert not [str(w.message) for w in caught if "did not finish" in str(w.message)]
    assert sorted(os.listdir(tmp_path)) == ["run"]


def _outcome(call):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the thread's error is what the test reports
        return exc


def test_a_load_that_a_save_over_the_folder_overtakes_reads_the_new_trace(tmp_path, monkeypatch, two_traces):
    """A save that replaced the folder after the load had read its record, before its tensors: the old record and
    the new tensors were refused as a damaged trace.  The load reads the folder again."""
    old, new = two_traces
    folder = old.save(tmp_path / "run")
    load_module = sys.modules["torchlens.io.load"]
    read_tensor_file = load_module.read_tensor_file

    def overtaken(*args):
        monkeypatch.setattr(load_module, "read_tensor_file", read_tensor_file)  # once
        new.save(folder, overwrite=True)
        return read_tensor_file(*args)
    monkeypatch.setattr(load_module, "read_tensor_file", overtaken)
    loaded = tl.load(folder)
    assert [op.label for op in loaded] == [op.label for op in new]
    assert torch.equal(loaded["1"].activation, new["1"].activation)
