"""Fixtures shared by the test modules."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture
def no_collector():
    """The cycle collector off for the test (after one pass over earlier tests' garbage): what the test
    sees freed is freed by reference counting, and no collection moves reference counts meanwhile."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
