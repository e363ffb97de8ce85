"""A save over a trace killed outright (SIGKILL: no handler, no clean-up runs) between its renames left the old
trace in a hidden ``.torchlens-save-*-old`` folder beside the path, with nothing at the path saying so: the next
``tl.load`` or ``save`` of that path now finds it and puts the old trace back, or, when the new trace was in
place, deletes it as the save would have, saying which in a warning."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch

import torchlens as tl


class _Killed(BaseException):
    """What a kill leaves: once raised, no further file operation (an undo, a clean-up) happens."""


def _killed_after(monkeypatch, steps: int) -> list:
    """Let ``steps`` file operations happen, then kill: that one and every later one raise ``_Killed``.  Returns
    the operations let through, ``(name, first argument)``."""
    done = []
    for module, name in [(os, "replace"), (os, "remove"), (os, "rmdir"), (os, "unlink"), (os, "fsync"),
                         (os, "mkdir"), (os, "makedirs"), (shutil, "rmtree")]:
        real = getattr(module, name)

        def call(*args, _real=real, _name=name, **kwargs):
            if len(done) >= steps:
                raise _Killed
            done.append((_name, str(args[0])))
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, call)
    return done


def _first_move_out(tmp_path, monkeypatch, traces) -> int:
    """How many file operations a save over a trace makes before it moves the old trace's first file or folder
    out of the path: kills before that only leave the new trace's half-written hidden folder."""
    old, new = traces
    folder = str(tmp_path / "count" / "run")
    old.save(folder)
    with monkeypatch.context() as m:
        done = _killed_after(m, 10 ** 6)
        new.save(folder, overwrite=True)
    return next(k for k, (name, source) in enumerate(done) if name == "replace" and source.startswith(folder))


@pytest.fixture(scope="module")
def traces():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    old = tl.trace(model, torch.randn(2, 3))
    new = tl.trace(torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh()), torch.randn(2, 3))
    return old, new


def _same(loaded, trace) -> bool:
    return loaded.labels == trace.labels and all(torch.equal(loaded[label].activation, trace[label].activation)
                                                 for label in trace.labels)


def _hidden(parent) -> list:
    return sorted(name for name in os.listdir(parent) if name.endswith("-old"))


def _kill_each_step(tmp_path, monkeypatch, traces, foreign: bool, then):
    """Kill a save over a trace at every file operation in turn; ``then(folder)`` is the next call on it."""
    old, new = traces
    recovered, steps = 0, _first_move_out(tmp_path, monkeypatch, traces)
    while True:
        parent = tmp_path / f"k{steps}"
        folder = str(parent / "run")
        old.save(folder)
        if foreign:
            (parent / "run" / "notes.txt").write_text("keep me")
        with monkeypatch.context() as m, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _killed_after(m, steps)
            try:
                new.save(folder, overwrite=True)
                return recovered  # the save ran to its end: every step before was killed once
            except _Killed:
                pass
        left = _hidden(parent)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            loaded = then(folder)
        if left:  # a kill between the renames: the next call said what it did with the old trace
            recovered += 1
            assert any(left[0] in str(w.message) for w in said), (steps, [str(w.message) for w in said])
        assert _same(loaded, old) or _same(loaded, new), f"killed after {steps} steps"
        assert _hidden(parent) == [], f"killed after {steps} steps"
        assert not foreign or (parent / "run" / "notes.txt").read_text() == "keep me"
        steps += 1


@pytest.mark.parametrize("foreign", [False, True], ids=["trace-folder", "with-foreign-file"])
def test_a_load_after_a_kill_at_any_step_of_a_save_finds_a_whole_trace_and_no_hidden_copy(
        tmp_path, monkeypatch, traces, foreign):
    assert _kill_each_step(tmp_path, monkeypatch, traces, foreign, tl.load) >= 2  # kills fell between renames


def test_a_save_after_a_kill_between_the_renames_puts_the_old_trace_back_before_checking_the_path(
        tmp_path, monkeypatch, traces):
    """Without overwrite=True a save is refused over the old trace it put back, as over any saved trace."""
    old, new = traces

    def save_again(folder):
        with pytest.raises(tl.errors.TraceFileError, match="already holds a saved trace"):
            new.save(folder)
        return tl.load(folder)

    assert _kill_each_step(tmp_path, monkeypatch, traces, False, save_again) >= 1


def test_a_kill_after_the_old_trace_was_moved_aside_puts_it_back_at_the_path(tmp_path, traces):
    """The state a kill between the two renames leaves, laid out by hand: the path gone, the old trace hidden."""
    old, new = traces
    folder = tmp_path / "run"
    old.save(str(folder))
    staging = tl.io.recover.staging_path(str(folder))
    new.save(staging)
    os.replace(folder, staging + "-old")
    with pytest.warns(UserWarning, match=r"killed before the new trace was in place; the old trace, left in .*"
                                         r"torchlens-save-run-[0-9a-f]{12}-old, is put back"):
        assert _same(tl.load(str(folder)), old)
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_link_named_like_a_moved_aside_trace_is_not_followed(tmp_path, traces):
    """Only a real folder is a save's own: a link with that name, to anywhere, is left alone."""
    old, _ = traces
    elsewhere = str(tmp_path / "elsewhere")
    old.save(elsewhere)
    link = tl.io.recover.staging_path(str(tmp_path / "run")) + "-old"
    os.symlink(elsewhere, link)
    with pytest.raises(tl.errors.TraceFileError, match="not a folder"):
        tl.load(str(tmp_path / "run"))
    assert os.path.islink(link) and os.path.isdir(elsewhere)
