"""Regenerate scripts/inventory.csv for the installed torch.

Usage: ``python scripts/regen_inventory.py`` (then review ``git diff`` of the CSV and re-run
``python scripts/probe_coverage.py`` to refresh the docs table).

Every registry row is probed under capture (scripts/probe_coverage.py).  A probed row takes its ``kind``,
``inplace`` and ``multi_output`` from what capture recorded; a row no probe reached is classified from its
name (``heuristic``).  Rows marked ``classified_by=hand`` in the existing file are kept verbatim as long as
torch still has the function; rows for functions torch dropped are removed and listed.

The ``flops`` column asks ``torchlens.report.flops`` whether a formula exists for the function.  If that
module is absent, the column is left blank ("unknown"); re-run this script once it exists.
"""

from __future__ import annotations

import pathlib
import sys
import types

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from probe_coverage import probe_all  # noqa: E402

import inventory  # noqa: E402
from torchlens.labels.naming import func_name_of  # noqa: E402

# Functions that draw random numbers: by exact name (with its in-place spelling), or for a family by prefix
# ("dropout2d", "fractional_max_pool3d", "randn_like"). Names alone would also take F.normalize for "normal"
# and poisson_nll_loss for "poisson", which draw nothing.
_RANDOM = ("bernoulli", "normal", "multinomial", "poisson", "exponential", "geometric", "cauchy", "log_normal",
           "random", "uniform", "rrelu", "gumbel_softmax", "binomial", "_standard_gamma", "_sample_dirichlet")
_RANDOM_FAMILIES = ("dropout", "rand", "fractional_max_pool", "alpha_dropout", "feature_alpha_dropout")
_HOST_ESCAPES = ("numpy", "tolist", "__array__", "__array_wrap__", "__dlpack__", "__dlpack_device__",
                 "__cuda_array_interface__")
_NOT_OP_PREFIXES = ("is_", "q_", "_dim", "_nnz", "qscheme", "sym_", "_sym_", "__bool__", "__int__",
                    "__float__", "__index__", "__len__", "__format__", "__repr__", "size", "dim", "numel",
                    "stride", "item", "tolist", "numpy", "element_size", "data_ptr", "get_device")


def flops_lookup():
    """func -> "1"/"0", or None when the FLOPs module is not available."""
    try:
        from torchlens.report import flops
    except ImportError:
        return None
    has_formula = getattr(flops, "has_formula", None)
    if has_formula is None:
        registry = getattr(flops, "_REGISTRY", None)
        canonical = getattr(flops, "canonical_name", None)
        if registry is None or canonical is None:
            return None

        def has_formula(func):
            return canonical(func_name_of(func)) in registry
    return lambda func: "1" if has_formula(func) else "0"


def _short(name: str) -> str:
    tail = name.rsplit(".", 2)
    return tail[-2] if tail[-1] == "__get__" else tail[-1]


def _caveats(name: str, func, result: dict) -> str:
    short = _short(name)
    tags = []
    if isinstance(func, types.FunctionType):
        tags.append("python_composite")
    if result.get("seen_as"):
        tags.append("respelled")
    if result.get("passthrough_tensor"):
        tags.append("passthrough")
    if result["status"] == "not_seen":
        tags.append("not_dispatched")
    if short.rstrip("_") in _RANDOM or short.startswith(_RANDOM_FAMILIES):
        tags.append("nondeterministic")
    if short in _HOST_ESCAPES:
        tags.append("host_escape")
    error = result.get("error", "")
    if result["status"] == "not_probed" and any(
            word in error for word in ("CUDA", "not compiled", "backend", "accelerator", "not linked")):
        tags.append("device_only")
    return ";".join(tags)


def classify(name: str, func, result: dict, flops) -> dict:
    row = {"name": name, "caveat": _caveats(name, func, result), "seen_as": result.get("seen_as", "")}
    if result["status"] == "seen":
        row.update(kind=result["kind"], inplace=str(result["inplace"]), multi_output=str(result["multi_output"]),
                   classified_by="probe")
    else:
        short = _short(name)
        not_op = short.startswith(_NOT_OP_PREFIXES)
        inplace = short.endswith("_") and not short.endswith("__")
        row.update(kind="not_op" if not_op else "op", inplace=str(int(inplace)), multi_output="0",
                   classified_by="heuristic")
    row["flops"] = flops_cell(func, row["kind"], flops)
    return row


def flops_cell(func, kind: str, flops) -> str:
    """The ``flops`` column: a function that makes no op has no formula to apply, whatever its name matches
    (``Tensor.__nonzero__`` is truthiness, not ``torch.nonzero``)."""
    if not flops:
        return ""
    return "0" if kind == "not_op" else flops(func)


def regenerate(path=inventory.INVENTORY_PATH, *, previous=None, results=None) -> tuple:
    """Rewrite the inventory at ``path``, keeping the hand rows of ``previous`` (default: ``path`` itself);
    ``results`` are probe results if already computed.  Returns (rows written, names dropped because torch
    no longer has them)."""
    previous = path if previous is None else previous
    old = inventory.load(previous) if pathlib.Path(previous).exists() else {}
    funcs = inventory.registry()
    flops = flops_lookup()
    results = probe_all() if results is None else results
    rows = []
    for name, func in funcs.items():
        kept = old.get(name)
        if kept is not None and kept.get("classified_by") == "hand":  # its classification kept; the formula is ours
            rows.append(dict(kept, flops=flops_cell(func, kept["kind"], flops)))
        else:
            rows.append(classify(name, func, results[name], flops))
    inventory.save(rows, path)
    return rows, sorted(set(old) - set(funcs))


def main() -> int:
    rows, dropped = regenerate()
    by = {}
    for row in rows:
        by[row["classified_by"]] = by.get(row["classified_by"], 0) + 1
    print(f"torch {torch.__version__}: {len(rows)} rows written to {inventory.INVENTORY_PATH} ({by})")
    if dropped:
        print("dropped (no longer in torch's registry):", ", ".join(dropped))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
