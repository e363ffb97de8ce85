"""The registry behind docs/reliability.md: every fault/context/concurrency/budget scenario, once.

A scenario is a function that runs it, asserts what must hold, and returns a one-line outcome.  The
tests run each through ``outcome`` (which remembers the result for the rest of the process), and
scripts/reliability_report.py renders the same registry into the page, so the page can only say what
the suite checked.
"""

from __future__ import annotations

REGISTRY: dict = {}  # area -> {scenario title: function}
_outcomes: dict = {}


def case(area: str):
    """Register a scenario under ``area``; its title is the first line of its docstring."""

    def register(fn):
        REGISTRY.setdefault(area, {})[fn.__doc__.strip().splitlines()[0].rstrip(".")] = fn
        return fn

    return register


def titles(area: str) -> list:
    return list(REGISTRY.get(area, {}))


def outcome(area: str, title: str) -> str:
    """Run a scenario once per process (its assertions included) and return its outcome line."""
    key = (area, title)
    if key not in _outcomes:
        _outcomes[key] = REGISTRY[area][title]()
    return _outcomes[key]
