"""Windows's rule for files, emulated on Linux: a file that this process holds open or memory-mapped cannot be
deleted, renamed or replaced, nor can a folder holding one.  ``refuse_held_files(monkeypatch)`` makes the os and
shutil calls torchlens deletes and moves with raise PermissionError there, as Windows does (WinError 32)."""

from __future__ import annotations

import os
import shutil

import pytest

_PATCHED_OS = ("remove", "unlink", "replace", "rename", "rmdir")


def held_paths() -> set:
    """Every file this process has open or mapped, as a real path (read from /proc)."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("emulating Windows's held files needs /proc")
    with open("/proc/self/maps") as f:
        mapped = {parts[5].strip() for parts in (line.split(None, 5) for line in f) if len(parts) == 6}
    opened = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            opened.add(os.path.realpath(os.path.join("/proc/self/fd", fd)))
        except OSError:
            pass  # closed since listed
    return mapped | opened


def _refuse_if_held(*paths) -> None:
    held = held_paths()
    for path in paths:
        path = os.path.realpath(path)
        hit = next((h for h in held if h == path or h.startswith(path + os.sep)), None)
        if hit is not None:
            raise PermissionError(32, "The process cannot access the file because it is being used by another "
                                      "process", hit)


def refuse_held_files(monkeypatch) -> None:
    from torchlens.io import recover

    monkeypatch.setattr(recover, "fcntl", None)  # Windows has no flock: a save holds no lock on its folder there
    for name in _PATCHED_OS:
        real = getattr(os, name)

        def checked(*args, _real=real, **kwargs):
            _refuse_if_held(*[a for a in args[:2] if isinstance(a, (str, os.PathLike))])
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, checked)
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        _refuse_if_held(path)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
