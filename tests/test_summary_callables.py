"""The module table of a function traced without ``root=``: there is no model, so the whole trace's parameter
count is unknown, said so, and not a 0 printed above module rows that hold parameters."""

from __future__ import annotations

import os

import pytest
import torch

import torchlens as tl

_NET = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def score(x):
    return _NET(x).sum(-1)


@pytest.fixture(scope="module")
def rootless():
    return tl.trace(score, torch.randn(2, 3))


def test_a_function_traced_without_root_has_no_parameter_total_and_the_table_says_why(rootless):
    rows = rootless.summary().rows
    assert rows[0]["call"] == "score" and rows[0]["params"] is None  # printed as 0 above a row of 26
    assert rows[1]["params"] == sum(p.numel() for p in _NET.parameters()) == 26
    text = str(rootless.summary())
    assert "Parameters: unknown; score was traced without root=, so there is no model whose parameters to " \
           "count" in text and "Parameters: 0" not in text


def test_a_loaded_rootless_trace_says_the_same(rootless, tmp_path):
    loaded = tl.load(rootless.save(os.path.join(tmp_path, "run")))
    assert loaded.summary().rows[0]["params"] is None
    assert str(loaded.summary()).splitlines()[-3] == str(rootless.summary()).splitlines()[-3]


def test_with_root_the_function_counts_the_models_parameters():
    summary = tl.trace(score, torch.randn(2, 3), root=_NET).summary()
    assert summary.rows[0]["params"] == 26 and "Parameters: 26 (" in str(summary)
