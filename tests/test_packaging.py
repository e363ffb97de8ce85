"""What ``pip install torchlens`` installs: a wheel built from this tree holds every file of the package,
the viewer's assets and the ``py.typed`` marker (PEP 561: type checkers read the package's annotations)
included.  An editable install reads the source tree, so only a built wheel shows a file left out."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "torchlens"


def _package_files() -> set:
    return {str(p.relative_to(PACKAGE.parent)).replace("\\", "/") for p in PACKAGE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so")}


@pytest.mark.path_independent  # builds a wheel, traces nothing: once, on the first pass
def test_the_wheel_holds_every_file_of_the_package(tmp_path):
    tree = tmp_path / "tree"  # built from a copy: setuptools writes build/ and egg-info beside the source
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(PACKAGE, tree / "src" / "torchlens", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(tree)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("torchlens-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _package_files()
    assert {"torchlens/py.typed", "torchlens/viz/assets/viewer.js", "torchlens/viz/assets/viewer.css"} <= expected
    assert expected - names == set()


def test_the_declared_torch_range_is_the_verified_release_and_another_is_named_at_import(monkeypatch):
    import importlib
    import tomllib
    import warnings

    import pytest
    import torch

    import torchlens.capture as capture

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    major, minor = map(int, capture.TORCH_VERIFIED.split("."))
    assert f"torch>={major}.{minor},<{major}.{minor + 1}" in declared
    monkeypatch.setattr(torch, "__version__", f"{major}.{minor}.2+cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(capture)  # a release of the verified torch: nothing said
    monkeypatch.setattr(torch, "__version__", f"{major}.{minor + 1}.1")
    with pytest.warns(RuntimeWarning, match=rf"verified with torch {major}\.{minor}\.x, not {major}\.{minor + 1}\.1"):
        importlib.reload(capture)


def test_the_package_imports_and_traces_where_os_has_no_fork():
    """Windows has no ``os.fork`` nor ``os.register_at_fork``: the handlers for a forked child are not
    registered there, and nothing else depends on them."""
    script = ("import os, torch\ndel os.fork, os.register_at_fork  # as on Windows (torch checks the platform)\n"
              "import torchlens as tl\n"
              "print(tl.trace(torch.nn.Linear(2, 2), torch.randn(1, 2)).labels[1])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["linear_1_1:1"]
