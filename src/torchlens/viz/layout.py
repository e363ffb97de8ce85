"""Laying DOT out with Graphviz: a ``dot`` on PATH, else the ``graphviz-pure`` wheel's executable.

torchlens never places nodes itself.  Graphviz's ``dot`` is the field's standard layered layout; the
``graphviz-pure`` wheel (``pip install torchlens[viz]``) ships the same command line as a static binary,
for machines where installing Graphviz is a chore.  Several pictures are laid out by parallel processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from ..errors import LayoutEngineMissing, LayoutFailed

FORMATS = ("svg", "png")
ENGINE_ENV = "TORCHLENS_DOT"


def find_engine() -> str:
    """Path of the layout executable: ``$TORCHLENS_DOT``, ``dot`` on PATH, then ``graphviz-pure``."""
    chosen = os.environ.get(ENGINE_ENV)
    if chosen:
        if shutil.which(chosen) is None:
            raise LayoutEngineMissing(f"{ENGINE_ENV}={chosen!r} is not an executable; unset it or point it at "
                                      "Graphviz's dot")
        return shutil.which(chosen)
    found = shutil.which("dot") or shutil.which("graphviz-pure")
    if found:
        return found
    # A wheel's executable lands beside this interpreter even when that folder is not on PATH.
    for folder in {sysconfig.get_path("scripts"), os.path.dirname(sys.executable)}:
        candidate = shutil.which("graphviz-pure", path=folder) if folder else None
        if candidate:
            return candidate
    raise LayoutEngineMissing(
        "laying out the graph needs Graphviz's `dot` command, and neither `dot` nor `graphviz-pure` was "
        "found. Install one: `apt-get install graphviz` (or your platform's Graphviz package), or "
        "`pip install torchlens[viz]` for the graphviz-pure wheel. DOT text needs neither: "
        "render(path='graph.dot').")


def layout(dot_texts, fmt: str = "svg") -> list:
    """Lay out each DOT text; returns the output bytes of each, in order.

    SVG pictures are laid out in batches, one ``dot`` process per worker reading many graphs (a process
    costs several milliseconds to start, a small graph a fraction of one); PNGs one process each."""
    if fmt not in FORMATS:
        raise ValueError(f"layout format must be one of {FORMATS}, not {fmt!r}")
    engine = find_engine()
    texts = list(dot_texts)
    if len(texts) == 1:
        return [_run(engine, texts[0], fmt)]
    workers = max(1, min(len(texts), os.cpu_count() or 1))
    if fmt == "svg":
        size = -(-len(texts) // workers)
        batches = [texts[i:i + size] for i in range(0, len(texts), size)]
        with ThreadPoolExecutor(max_workers=len(batches)) as pool:
            return [svg for laid in pool.map(lambda batch: _run_batch(engine, batch), batches) for svg in laid]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda text: _run(engine, text, fmt), texts))


def _run_batch(engine, texts) -> list:
    """The SVG of each text, from one process that reads them all (each picture starts with ``<?xml``).
    A batch that fails, or whose pictures cannot be told apart, is laid out one text at a time, so that
    an error names the graph that caused it."""
    done = subprocess.run([engine, "-Tsvg"], input="".join(texts).encode("utf-8"), capture_output=True,
                          check=False)
    pictures = [b"<?xml" + part for part in done.stdout.split(b"<?xml")[1:]] if done.returncode == 0 else []
    if len(pictures) != len(texts):
        return [_run(engine, text, "svg") for text in texts]
    return pictures


def _run(engine, text, fmt) -> bytes:
    done = subprocess.run([engine, f"-T{fmt}"], input=text.encode("utf-8"), capture_output=True, check=False)
    if done.returncode != 0 or not done.stdout:
        message = done.stderr.decode("utf-8", "replace").strip()[:2000]
        raise LayoutFailed(f"{os.path.basename(engine)} failed (exit {done.returncode}): {message}")
    return done.stdout
