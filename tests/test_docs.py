"""Every ```python block in README.md and docs/*.md runs, in order, one namespace per file.

A block whose first line is ``# doctest: skip-if-no-cuda`` is skipped (with that reason) when CUDA is
absent.  A block whose first line is ``# doctest: torchrun <options>`` is a script: it is written to a
file and run with ``torchrun --standalone <options>``.  Blocks run with a temporary working directory so
examples may write files, and with the checkout's ``scripts/`` importable.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: pathlib.Path) -> list:
    return _BLOCK.findall(page.read_text())


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists()], ids=lambda p: p.name)
def test_page_examples_run(page, tmp_path, monkeypatch):
    blocks = python_blocks(page)
    if not blocks:
        pytest.skip(f"{page.name} has no python examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # development tools the pages show (inventory.py)
    namespace = {"__name__": f"docs_{page.stem}"}
    for n, block in enumerate(blocks, 1):
        if block.startswith("# doctest: skip-if-no-cuda") and not torch.cuda.is_available():
            continue
        if block.startswith("# doctest: torchrun"):
            _run_with_torchrun(block, f"{page.name}[block {n}]", tmp_path)
            continue
        try:
            exec(compile(block, f"{page.name}[block {n}]", "exec"), namespace)
        except Exception as exc:  # name the page and block in the failure
            raise AssertionError(f"{page.name}, python block {n} failed: {exc!r}") from exc


def _run_with_torchrun(block: str, where: str, folder: pathlib.Path) -> None:
    import os
    import subprocess
    import sys

    options = block.splitlines()[0].split("torchrun", 1)[1].split()
    script = folder / (re.sub(r"\W+", "_", where).strip("_") + ".py")
    script.write_text(block)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", *options, str(script)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{where} failed under torchrun:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


_API_NAME = re.compile(r"`((?:tl|Trace|Op|Layer|ModuleCall|Module|Param)(?:\.\w+)+)")


def _has(target, name: str) -> bool:
    try:
        getattr(target, name)
    except AttributeError:
        return False
    except Exception:  # an attribute that exists and refuses this record (a gradient never captured)
        return True
    return True


def _resolves(name: str, samples: dict) -> bool:
    """Whether a dotted name a page writes (`tl.debug.hot_path`, `Op.duration`) is an attribute or module:
    a record class's names are looked up on a live record too, for the attributes set per instance."""
    import importlib

    head, *rest = name.split(".")
    target = samples[head]
    for part in rest:
        if _has(target, part) or (target is samples[head] and _has(samples[head + "()"], part)):
            target = getattr(target, part, None)
            continue
        try:  # a submodule not imported yet (tl.report.patching)
            target = importlib.import_module(f"{target.__name__}.{part}")
        except (ImportError, AttributeError, TypeError):
            return False
    return True


def test_every_api_name_the_pages_write_exists():
    # A page sending the reader to `Op.func_time`, which no record has, sends them to nothing.
    import torchlens as tl

    log = tl.trace(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.randn(1, 2))
    samples = {"tl": tl, "Trace": tl.Trace, "Trace()": log, "Op": tl.Op, "Op()": log.ops[1], "Layer": tl.Layer,
               "Layer()": log.layers[1], "ModuleCall": tl.ModuleCall, "ModuleCall()": log.module_calls[0],
               "Module": tl.Module, "Module()": log.modules[0], "Param": tl.Param, "Param()": log.params[0]}
    missing = [f"{page.name}: {name}" for page in PAGES if page.exists()
               for name in sorted(set(_API_NAME.findall(page.read_text()))) if not _resolves(name, samples)]
    assert not missing, missing


def test_every_public_name_is_written_on_some_page():
    # tl.viz.format_of, tl.report.KernelProfile, log.is_recurrent and Module.class_name were public and named on
    # no page: a reader could not learn that they exist, or what they answer.
    import torchlens as tl

    text = "\n".join(page.read_text() for page in PAGES if page.exists())
    names = set(tl.__all__) | {name for package in ("debug", "report", "viz", "io", "distributed")
                               for name in getattr(tl, package).__all__}
    names |= {name for view in (tl.Trace, tl.Op, tl.Layer, tl.ModuleCall, tl.Module, tl.Param, tl.Buffer)
              for name in dir(view) if not name.startswith("_")}
    unwritten = sorted(name for name in names if not re.search(rf"\b{re.escape(name)}\b", text))
    assert not unwritten, unwritten
