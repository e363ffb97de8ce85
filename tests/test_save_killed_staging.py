"""A save killed outright (SIGKILL) while it wrote the new trace, before any rename, left that half-written trace in
a hidden ``.torchlens-save-<name>-<id>`` folder beside the path for good.  A save locks that folder while it
writes, and the kernel drops the lock when the process dies: the next ``tl.load`` or ``save`` of the path deletes
a folder no process holds, and leaves one a running save holds.  Folders from before the hidden folders carried
the path's name (``.torchlens-save-<id>-old``) cannot be matched to a trace: a warning names them."""

from __future__ import annotations

import os
import shutil
import sys
import warnings

import pytest
import torch

import torchlens as tl
from torchlens.io import recover


class _Killed(BaseException):
    """A kill: nothing after it runs (the save's own clean-up included); the kernel then drops the lock."""


def _killed_while_writing(monkeypatch, trace, folder: str, overwrite: bool) -> None:
    """Save ``trace`` to ``folder`` and kill the save as it writes its manifest, the last file before the renames."""
    def kill(*args, **kwargs):
        raise _Killed
    with monkeypatch.context() as m:
        m.setattr(sys.modules["torchlens.io.save"], "write_manifest", kill)
        m.setattr(shutil, "rmtree", kill)  # the save's clean-up in its finally never runs
        with pytest.raises(_Killed):
            trace.save(folder, overwrite=overwrite)


def _hidden(parent) -> list:
    return sorted(name for name in os.listdir(parent) if name.startswith(".torchlens-save-"))


def _same(loaded, trace) -> bool:
    return loaded.labels == trace.labels and all(torch.equal(loaded[label].activation, trace[label].activation)
                                                 for label in trace.labels)


def test_a_load_after_a_save_killed_while_writing_deletes_its_half_written_folder(tmp_path, monkeypatch, two_traces):
    old, new = two_traces
    folder = str(tmp_path / "run")
    old.save(folder)
    _killed_while_writing(monkeypatch, new, folder, overwrite=True)
    assert len(_hidden(tmp_path)) == 1 and os.listdir(tmp_path / _hidden(tmp_path)[0])  # what the kill left
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of the user's is touched: deleted without a word
        assert _same(tl.load(folder), old)
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_save_after_a_first_save_killed_while_writing_deletes_it_and_saves(tmp_path, monkeypatch, two_traces):
    _, new = two_traces
    folder = str(tmp_path / "run")
    _killed_while_writing(monkeypatch, new, folder, overwrite=False)
    new.save(folder)
    assert sorted(os.listdir(tmp_path)) == ["run"] and _same(tl.load(folder), new)


@pytest.mark.skipif(getattr(recover, "fcntl", None) is None, reason="no advisory locks on this system")
def test_the_folder_of_a_save_running_now_is_left_alone(tmp_path, two_traces):
    """Another process saving to the path holds its folder: a load meanwhile must not delete it."""
    old, _ = two_traces
    folder = str(tmp_path / "run")
    old.save(folder)
    staging, lock = recover.claim_staging(folder)
    try:
        assert _same(tl.load(folder), old)
        assert os.path.isdir(staging)
    finally:
        recover.release_staging(lock)
    tl.load(folder)
    assert not os.path.lexists(staging)


def test_a_folder_of_an_older_save_not_naming_its_trace_is_named_and_left(tmp_path, two_traces):
    """``.torchlens-save-<id>-old``: the old trace of some save in this folder, but which is unknown."""
    old, new = two_traces
    folder = str(tmp_path / "run")
    new.save(folder)
    unnamed = tmp_path / ".torchlens-save-0123456789ab-old"
    old.save(str(unnamed))
    with pytest.warns(UserWarning, match=r"torchlens-save-0123456789ab-old holds the files of a saved trace that a "
                                         r"save over it moved aside and did not finish"):
        assert _same(tl.load(folder), new)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _same(tl.load(str(unnamed)), old)  # left whole, for the user to put back


def test_a_kill_at_any_step_before_the_renames_leaves_nothing_after_the_next_load(tmp_path, monkeypatch, two_traces):
    """Every file operation of a save over a trace up to its first rename, killed in turn."""
    from test_save_killed import _first_move_out, _killed_after

    old, new = two_traces
    last = _first_move_out(tmp_path, monkeypatch, two_traces)
    for steps in range(last + 1):
        parent = tmp_path / f"k{steps}"
        folder = str(parent / "run")
        old.save(folder)
        with monkeypatch.context() as m:
            _killed_after(m, steps)
            with pytest.raises(BaseException, match="^$"):  # the kill, whichever operation it hit
                new.save(folder, overwrite=True)
        assert _same(tl.load(folder), old) and sorted(os.listdir(parent)) == ["run"], f"killed after {steps}"
    assert last >= 3  # kills while the folder was made, written and before the first move


def test_a_folder_named_like_a_dead_saves_keeps_what_no_save_writes(tmp_path, two_traces):
    """A save writes plain files in its folder, never a subfolder: one found there is not the save's to delete."""
    old, _ = two_traces
    folder = str(tmp_path / "run")
    old.save(folder)
    staging, lock = recover.claim_staging(folder)
    recover.release_staging(lock)
    os.mkdir(os.path.join(staging, "mine"))
    with pytest.warns(UserWarning, match="could not be deleted"):
        assert _same(tl.load(folder), old)
    assert os.listdir(staging) == ["mine"]


@pytest.mark.skipif(getattr(recover, "fcntl", None) is None, reason="no advisory locks on this system")
@pytest.mark.parametrize("when", ["before-the-open", "while-the-lock-waits"])
def test_a_save_whose_new_folder_is_taken_for_a_dead_saves_makes_another(tmp_path, monkeypatch, two_traces, when):
    """A load of the path in another process, between the save's mkdir and its lock, deletes the folder: before
    the save opens it, or (holding the lock the save then waits for) once it is open."""
    _, new = two_traces
    real, taken = recover._lock, []

    def lock_after_a_load(folder, wait):
        if taken:
            return real(folder, wait)
        taken.append(folder)
        if when == "before-the-open":
            os.rmdir(folder)  # what that load does to a folder no process holds yet
            return real(folder, wait)
        lock = real(folder, wait)
        os.rmdir(folder)  # (deleted by the load that held it, which then let go)
        return lock
    monkeypatch.setattr(recover, "_lock", lock_after_a_load)
    folder = str(tmp_path / "run")
    new.save(folder)
    assert taken and sorted(os.listdir(tmp_path)) == ["run"] and _same(tl.load(folder), new)
