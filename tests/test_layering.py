"""Imports run one way: errors <- record <- capture <- bridges <- cli (docs/architecture.md).

Each package of torchlens is imported, with every module in it, in a fresh process (forked from one
that imported torch alone) where the ``torchlens`` package itself is a bare namespace (its ``__init__``
imports everything, which would hide the edges).  The torchlens packages that got imported are the
package's top-level dependencies; each must be one the layering allows.  Imports inside functions (the
``Trace`` facade's ``render``, ``validate``, ``save``) are lazy on purpose and are not edges.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys

import pytest

SRC = importlib.util.find_spec("torchlens").submodule_search_locations[0]
# Source and imports only, no trace: the probe finds the same edges with TORCHLENS_ACCEL=0 and =1, so the
# Makefile's pure-Python pass need not import every package again.
pytestmark = pytest.mark.path_independent

# errors, and the leaves, which import at most errors (copies: the tree walker too)
BASE = {"errors", "checks", "tree", "copies", "cache", "progress", "lazy"}
LABELS = BASE | {"labels"}
RECORD = LABELS | {"record"}
CAPTURE = RECORD | {"capture"}
BRIDGES = {"validate", "debug", "report", "viz", "io", "intervene", "distributed", "compat"}

ALLOWED = {
    "errors": set(), "checks": {"errors"}, "tree": {"errors"}, "copies": {"errors", "tree"},
    "cache": set(), "progress": {"errors"}, "lazy": set(),
    "labels": BASE,
    "record": LABELS,
    "capture": RECORD,  # the driver imports intervene only inside the call that needs it
    "validate": CAPTURE, "debug": CAPTURE, "viz": CAPTURE, "io": CAPTURE, "intervene": CAPTURE,
    "report": CAPTURE | {"intervene"},  # activation patching runs interventions
    "distributed": CAPTURE | {"io"},  # per-rank extraction writes io's folders
    "compat": CAPTURE | {"intervene"},  # the reference library's names over both
}

# One interpreter imports torch once, then forks a child per package: each child starts with no torchlens
# module imported (torch's import is the slow part, and it adds no torchlens edge).
_PROBE = r"""
import importlib, json, os, pkgutil, sys, types
import torch
src, names = sys.argv[1], sys.argv[2:]

def edges(name):
    root = types.ModuleType("torchlens")
    root.__path__ = [src]
    sys.modules["torchlens"] = root
    module = importlib.import_module("torchlens." + name)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), "torchlens." + name + "."):
        importlib.import_module(info.name)
    return sorted({m.split(".")[1] for m in sys.modules if m.startswith("torchlens.")} - {name})

for name in names:
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # the child: report, and never return into this loop
        code = 1
        try:
            print(json.dumps([name, edges(name)]), flush=True)
            code = 0
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status:
        sys.exit(f"importing torchlens.{name} failed")
"""


@functools.lru_cache(maxsize=None)
def _imports() -> dict:
    """{package: the torchlens packages its import pulls in}, for every package in ALLOWED."""
    out = subprocess.run([sys.executable, "-c", _PROBE, SRC, *sorted(ALLOWED)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    found = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('["')]
    return {name: set(packages) for name, packages in found}


def imported_by(name: str) -> set:
    return _imports()[name]


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_package_imports_only_lower_layers(name):
    upward = imported_by(name) - ALLOWED[name]
    assert not upward, f"torchlens.{name} imports {sorted(upward)} at top level, against the layering"


def test_every_package_has_a_layer():
    import pkgutil

    found = {info.name for info in pkgutil.iter_modules([SRC]) if not info.name.startswith("_")}
    assert found - {"cli", "demo"} == set(ALLOWED), "place a new package in ALLOWED (and docs/architecture.md)"


def test_the_probe_sees_a_real_edge():
    # capture's modules do import record: a probe that saw nothing would pass every test above.
    assert "record" in imported_by("capture")


def private_imports_across_packages(src) -> list:
    """``from ..other import _name``: a private name of another package (or top-level module) imported at any
    depth; what one package hands another is a public name of it."""
    import ast
    import pathlib

    found = []
    for path in sorted(pathlib.Path(src).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        here = parts[:-1]  # the package the module is in
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            target = [*here[:len(here) - node.level + 1], *(node.module.split(".") if node.module else [])]
            if target and target[0] != parts[0]:
                found += [f"{path.relative_to(src)}:{node.lineno}: {alias.name} from {'.'.join(target)}"
                          for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_package_imports_another_package_s_private_names():
    found = private_imports_across_packages(SRC)
    assert not found, "private names imported across packages (make them public there):\n" + "\n".join(found)


def test_the_private_import_check_resolves_relative_imports(tmp_path):
    (tmp_path / "io").mkdir()
    (tmp_path / "report").mkdir()
    (tmp_path / "io" / "extract.py").write_text("from ..capture.session import _hidden\nfrom .format import _own\n")
    (tmp_path / "report" / "x.py").write_text("from ..report.y import _same\nfrom ..tree import __all__\n")
    (tmp_path / "validate.py").write_text("from .capture.restore import _other\n")
    assert private_imports_across_packages(tmp_path) == ["io/extract.py:1: _hidden from capture.session",
                                                         "validate.py:1: _other from capture.restore"]
