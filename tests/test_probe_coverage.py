"""Executed probes: every registry row is called under capture, and what capture saw must match the docs.

The published table in docs/interposition_surface.md comes from scripts/probe_coverage.py.  These tests
re-run the same probes and fail, naming the functions, if a row the page counts as seen is no longer seen,
if a probe now disagrees with the inventory's classification, or if regeneration would lose hand rows.
"""

from __future__ import annotations

import csv
import pathlib
import re
import sys

import pytest
import torch

import torchlens as tl
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import inventory  # noqa: E402

import probe_coverage  # noqa: E402
import regen_inventory  # noqa: E402
from probe_recipes import RECIPES  # noqa: E402


@pytest.fixture(scope="module")
def results():
    return probe_coverage.probe_all()


def _listed(status_heading: str) -> set:
    """Names the docs page lists under one of its (b)/(c) headings."""
    text = probe_coverage.DOCS_PAGE.read_text()
    block = text.split(status_heading, 1)[1].split("\n\n", 2)[1]
    return set(re.findall(r"^- `([^`]+)`", block, re.M))


def test_published_table_is_not_regressed(results):
    published = probe_coverage.published_counts()
    measured = probe_coverage.counts(results)
    assert measured["total"] == published["total"] == len(inventory.registry())
    documented_unseen = _listed("Rows in (c)") | _listed("Rows in (b)")
    regressed = sorted(name for name, r in results.items()
                       if r["status"] != "seen" and name not in documented_unseen)
    assert not regressed, f"capture no longer sees these probed functions: {regressed}"
    assert measured["seen"] >= published["seen"]
    assert measured["seen"] / measured["total"] > 0.95


def test_probes_agree_with_the_inventory(results):
    rows = inventory.load()
    disagreements = []
    for name, r in results.items():
        row = rows[name]
        if r["status"] != "seen" or row["classified_by"] == "hand":
            continue
        measured = (r["kind"], str(r["inplace"]), str(r["multi_output"]), r.get("seen_as", ""))
        recorded = (row["kind"], row["inplace"], row["multi_output"], row["seen_as"])
        if measured != recorded:
            disagreements.append(f"{name}: probe {measured}, inventory {recorded}")
    assert not disagreements, "\n".join(disagreements)


def test_unseen_rows_are_really_unseen(results):
    # The probe can fail a row: these calls run fine but never reach capture as themselves.
    assert results["torch.Tensor.set_"]["status"] == "not_seen"
    assert results["torch.lobpcg"]["status"] == "not_seen"
    assert results["torch.nn.functional.linear"]["status"] == "seen"


@pytest.mark.parametrize("name", ["torch.nn.functional.conv_transpose2d", "torch.Tensor.addmv_",
                                  "torch.nn.functional.multi_head_attention_forward", "torch.lstm",
                                  "torch.Tensor.__setitem__", "torch.Tensor.T.__get__"])
def test_probe_verdict_matches_a_full_trace(name, results):
    # The same call through the public tl.trace path lands as an op whose func is the registry callable.
    func = inventory.registry()[name]
    args, kwargs = RECIPES[name]() if name in RECIPES else next(
        probe_coverage.guessed_calls(torch.overrides.get_testing_overrides()[func]))
    log = tl.trace(lambda: func(*args, **kwargs), ())
    funcs = [op.func for op in log.ops if op.kind == "op"]
    assert any(f == func for f in funcs), f"{name} not among {funcs}"
    assert results[name]["status"] == "seen"


def test_regeneration_keeps_hand_rows_and_drops_vanished_ones(results, tmp_path):
    previous = tmp_path / "previous.csv"
    rows = list(inventory.load().values())
    rows.append({"name": "torch.function_torch_removed", "kind": "op", "inplace": "0", "multi_output": "0",
                 "flops": "", "caveat": "", "seen_as": "", "classified_by": "hand"})
    inventory.save(rows, previous)
    target = tmp_path / "inventory.csv"
    written, dropped = regen_inventory.regenerate(target, previous=previous, results=results)
    assert dropped == ["torch.function_torch_removed"]
    regenerated = inventory.load(target)
    checked_in = inventory.load()
    assert set(regenerated) == set(checked_in)
    hand = [n for n, r in checked_in.items() if r["classified_by"] == "hand"]
    assert hand and all(regenerated[n] == checked_in[n] for n in hand)
    # Every probed row comes out as checked in (the flops column may move as formulas are added).
    changed = [n for n, r in regenerated.items() if r["classified_by"] == "probe"
               and {k: v for k, v in r.items() if k != "flops"}
               != {k: v for k, v in checked_in[n].items() if k != "flops"}]
    assert not changed, changed
    with open(target, newline="") as handle:
        assert tuple(next(csv.reader(handle))) == inventory.COLUMNS
