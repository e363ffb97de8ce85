"""Drift oracle: the checked-in inventory must classify exactly torch's overridable-function registry.

When a torch upgrade adds overridable functions, capture may see calls nobody has classified (is it an op?
in-place? does it have a FLOPs formula?); when torch removes some, the inventory claims coverage of
functions that no longer exist.  Either way this test fails and names the functions.  Fix it by running
``python scripts/regen_inventory.py`` and reviewing the diff.
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
import inventory  # noqa: E402  (scripts/inventory.py: a development tool, not part of the package)


def _drift_message(unclassified, vanished) -> str:
    lines = [f"inventory.csv is out of date for torch {torch.__version__}; run scripts/regen_inventory.py."]
    if unclassified:
        lines.append(f"{len(unclassified)} overridable function(s) not classified: " + ", ".join(unclassified))
    if vanished:
        lines.append(f"{len(vanished)} inventory row(s) torch no longer has: " + ", ".join(vanished))
    return "\n".join(lines)


def test_inventory_classifies_exactly_the_installed_registry():
    unclassified, vanished = inventory.drift(inventory.load(), inventory.registry())
    assert not unclassified and not vanished, _drift_message(unclassified, vanished)


def test_flattening_keeps_every_registry_entry_reachable():
    # Each (namespace, callable) pair of torch's registry maps to one row, and each row to its callable.
    registry = inventory.registry()
    pairs = {(inventory.namespace_name(ns), id(f))
             for ns, funcs in torch.overrides.get_overridable_functions().items() for f in funcs}
    assert len(registry) == len(pairs)
    assert registry["torch.Tensor.abs"] is torch.Tensor.abs
    assert registry["torch.nn.functional.linear"] is torch.nn.functional.linear
    assert registry["torch.Tensor.shape.__get__"] == torch.Tensor.shape.__get__


def test_oracle_names_added_and_removed_functions():
    # The comparison the oracle relies on, fed a registry that gained and lost a function.
    rows = inventory.load()
    changed = set(inventory.registry()) - {"torch.relu"} | {"torch.brand_new_op"}
    unclassified, vanished = inventory.drift(rows, changed)
    assert unclassified == ["torch.brand_new_op"]
    assert vanished == ["torch.relu"]
    message = _drift_message(unclassified, vanished)
    assert "torch.brand_new_op" in message and "torch.relu" in message


def test_every_row_is_fully_classified():
    problems = []
    for name, row in inventory.load().items():
        if row["kind"] not in inventory.KINDS:
            problems.append(f"{name}: kind {row['kind']!r}")
        if row["inplace"] not in ("0", "1") or row["multi_output"] not in ("0", "1"):
            problems.append(f"{name}: inplace/multi_output must be 0 or 1")
        if row["flops"] not in ("0", "1", ""):
            problems.append(f"{name}: flops {row['flops']!r}")
        unknown = [t for t in filter(None, row["caveat"].split(";")) if t not in inventory.CAVEATS]
        if unknown:
            problems.append(f"{name}: unknown caveat tag(s) {unknown}")
        if row["classified_by"] not in inventory.CLASSIFIERS:
            problems.append(f"{name}: classified_by {row['classified_by']!r}")
        if "respelled" in row["caveat"] and row["seen_as"] not in inventory.registry():
            problems.append(f"{name}: seen_as {row['seen_as']!r} is not a registry function")
    assert not problems, "\n".join(problems)


def test_inventory_agrees_with_capture_on_known_functions():
    rows = inventory.load()
    assert rows["torch.nn.functional.linear"]["kind"] == "op"
    assert rows["torch.Tensor.add_"]["inplace"] == "1"
    assert rows["torch.Tensor.size"]["kind"] == "not_op"
    assert rows["torch.Tensor.shape.__get__"]["kind"] == "not_op"
    assert rows["torch.split"]["multi_output"] == "1"
    assert rows["torch.Tensor.__iadd__"]["seen_as"] == "torch.Tensor.add_"
    assert "python_composite" in rows["torch.nn.functional.normalize"]["caveat"]
    # F.normalize and poisson_nll_loss were tagged as drawing random numbers ("normal", "poisson" prefixes), and
    # alpha dropout, which draws them, was not.
    random = {name for name, row in rows.items() if "nondeterministic" in row["caveat"]}
    assert not random & {"torch.nn.functional.normalize", "torch.nn.functional.poisson_nll_loss"}
    assert {"torch.nn.functional.alpha_dropout", "torch.poisson", "torch.Tensor.normal_"} <= random


def test_the_flops_column_agrees_with_the_formula_registry():
    # A formula added to tl.report.flops (divide, addbmm, torch.special.*) left rows saying it had none: the column
    # is regenerated from the registry, so it must say what the registry says today.
    import regen_inventory  # noqa: E402  (scripts/: imports probe_coverage, which needs torchlens)

    lookup, registry = regen_inventory.flops_lookup(), inventory.registry()
    def today(name, row):
        return regen_inventory.flops_cell(registry[name], row["kind"], lookup)

    stale = [f"{name}: {row['flops']!r}, the registry says {today(name, row)!r}"
             for name, row in inventory.load().items() if row["flops"] != today(name, row)]
    assert not stale, "inventory.csv's flops column is stale; run scripts/regen_inventory.py:\n" + "\n".join(stale)
