"""Progress bars: shown for long work when asked or interactive, never into a pipe by default."""

from __future__ import annotations

import sys

import pytest
import torch

import torchlens as tl
from torchlens import progress
from zoo import MLP


@pytest.fixture
def no_delay(monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0)  # what a long run shows, without waiting a second


def test_trace_validate_and_render_show_bars_when_asked(no_delay, capsys):
    model, x = MLP(), torch.randn(2, 16)
    log = tl.trace(model, x, progress=True)
    err = capsys.readouterr().err
    assert "tracing MLP" in err and "module calls" in err and "finalizing MLP" in err
    assert tl.validate(model, x, progress=True).passed
    assert "validating MLP" in capsys.readouterr().err
    log.render(None, format="dot", progress=True)
    assert "rendering MLP" in capsys.readouterr().err


def test_no_bar_into_a_pipe_by_default_or_when_turned_off(no_delay, capsys):
    model, x = MLP(), torch.randn(2, 16)
    tl.trace(model, x)  # pytest's captured stderr is not a terminal
    tl.trace(model, x, progress=False)
    tl.validate(model, x)
    tl.trace(model, x).render(None, format="dot")
    assert capsys.readouterr().err == ""


def test_a_bar_is_shown_on_a_terminal(no_delay, monkeypatch, capsys):
    monkeypatch.setattr(progress, "_interactive", lambda: True)
    tl.trace(MLP(), torch.randn(2, 16))
    assert "tracing MLP" in capsys.readouterr().err


def test_default_traces_in_a_pipe_never_make_a_bar(monkeypatch):
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *a, **k: pytest.fail("a bar was made for a pipe"))
    model, x = MLP(), torch.randn(2, 16)
    tl.validate(model, x)
    tl.trace(model, x).render(None, format="dot")
    assert progress.bar(None, "x") is progress.QUIET


def test_progress_must_be_a_bool_or_none():
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        tl.trace(MLP(), torch.randn(2, 16), progress="yes")


def test_asked_for_bars_where_there_is_no_stderr_the_work_runs_without_them(no_delay, monkeypatch, tmp_path):
    # pythonw.exe and apps frozen without a console have sys.stderr None; tl.extract asks for bars by default.
    model, x = MLP(), torch.randn(2, 16)
    expected = tl.trace(model, x)
    monkeypatch.setattr("sys.stderr", None)
    log = tl.trace(model, x, progress=True)
    assert [op.label for op in log.ops] == [op.label for op in expected.ops]
    assert torch.equal(log[-1].activation, expected[-1].activation)
    assert tl.validate(model, x, progress=True).passed
    folder = tl.extract(model, [x, x], [expected[-2].label], tmp_path / "x")
    monkeypatch.undo()
    assert tl.load_extracted(folder)[expected[-2].label].shape[0] == 4


def test_extract_and_patching_show_bars_by_default_as_a_trace_does(monkeypatch, tmp_path):
    # Both asked for a bar by default, anywhere: without tqdm they failed with an ImportError before any work
    # (tl.trace's automatic bar is left out then), and into a pipe or a log file they drew one.
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # as if tqdm were not installed
    model, x = MLP(), torch.randn(2, 16)
    label = tl.trace(model, x)[-2].label
    folder = tl.extract(model, [x, x], [label], tmp_path / "x")
    assert tl.load_extracted(folder)[label].shape[0] == 4
    with pytest.raises(ImportError, match="progress=True needs tqdm"):
        tl.extract(model, [x], [label], tmp_path / "y", progress=True)
    pytest.importorskip("pandas")
    table = tl.report.activation_patching(model, x, x + 1, lambda out: out.sum())
    assert len(table) == len(tl.trace(model, x).module_calls)
    with pytest.raises(ImportError, match="progress=True needs tqdm"):
        tl.report.activation_patching(model, x, x + 1, lambda out: out.sum(), progress=True)
