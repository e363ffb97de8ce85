"""The two capture paths, for the tests that run both: torchlens-accel's compiled modules and pure Python.

``compiled_or_skip(name)`` is the compiled module ``name`` (``_capture``, ``_grads``, ``_index``, ``_autograd``)
whatever ``TORCHLENS_ACCEL`` says, or None with the calling test module marked skipped, saying how to build it;
with ``TORCHLENS_REQUIRE_ACCEL=1`` (the Makefile's first pass) a missing module fails the run instead, so a
broken build cannot pass as skipped.  ``on_path(compiled)`` sets the path for the traces inside it.
"""

from __future__ import annotations

import contextlib
import os

import pytest

from torchlens.capture import accel

PATHS = [pytest.param(True, id="compiled"), pytest.param(False, id="python")]


def compiled_or_skip(name: str):
    """``torchlens_accel.<name>`` when built for this torchlens, else None (skip or, if required, fail)."""
    previous = accel.use(True)
    try:
        module = accel.compiled(name)
    finally:
        accel.use(previous)
    if module is None:
        why = (f"torchlens-accel's {name} is not built (pip install --no-build-isolation ./accel, or cd accel && "
               "python setup.py build_ext --inplace and run with accel/src on PYTHONPATH)")
        if os.environ.get("TORCHLENS_REQUIRE_ACCEL") == "1":
            pytest.fail(f"TORCHLENS_REQUIRE_ACCEL=1: {why}", pytrace=False)
        pytest.skip(why, allow_module_level=True)
    return module


@contextlib.contextmanager
def on_path(compiled: bool, without=()):
    """Trace on the compiled path (True) or the pure-Python one (False) inside the block; ``without`` names
    compiled modules left out meanwhile (``_autograd``: gradient capture then takes the ``_grads`` hooks)."""
    previous = accel.use(compiled)
    try:
        with accel.without(*without):
            yield
    finally:
        accel.use(previous)
