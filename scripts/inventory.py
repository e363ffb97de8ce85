"""Torch's overridable-function registry, flattened to stable names, and our classification of it.

Capture sees a torch callable only if it reaches ``__torch_function__``, and torch lists those callables
in ``torch.overrides.get_overridable_functions()``.  ``inventory.csv`` (beside this file) pins that
registry for one torch version with one row per qualified name, saying what capture does with each:

- ``kind``: ``op`` (returns tensors, so capture records it) or ``not_op`` (returns no tensor; capture
  passes it through unrecorded).
- ``inplace`` / ``multi_output``: ``1`` when the call writes a tensor argument / returns several tensors.
- ``flops``: ``1`` / ``0`` when ``torchlens.report.flops`` has / lacks a formula for it, blank when
  unknown at generation time.
- ``caveat``: ``;``-separated tags for what capture cannot show about the call (see ``CAVEATS``).
- ``seen_as``: for a C-level alias torch respells on the way in (``__add__`` arrives as ``add``), the
  registry name capture records instead.
- ``classified_by``: ``probe`` (measured by calling it under capture), ``heuristic`` (no probe ran;
  inferred from the name), or ``hand`` (set by a person; regeneration keeps it).

``scripts/regen_inventory.py`` rewrites the file for a new torch; ``tests/test_torchnative_drift_oracle.py``
fails when the installed torch and the file disagree.
"""

from __future__ import annotations

import csv
import functools
import pathlib
import types

import torch

INVENTORY_PATH = pathlib.Path(__file__).with_name("inventory.csv")
COLUMNS = ("name", "kind", "inplace", "multi_output", "flops", "caveat", "seen_as", "classified_by")
KINDS = ("op", "not_op")
CLASSIFIERS = ("probe", "heuristic", "hand")

CAVEATS = {
    "python_composite": "a Python-level function: the torch calls inside it run with capture popped, so the "
                        "whole call is one op",
    "respelled": "torch hands capture a different function than the one called (see seen_as)",
    "passthrough": "returns a tensor but capture deliberately does not record it (requires_grad_)",
    "not_dispatched": "the call never reaches __torch_function__ as itself: capture sees its interior "
                      "calls or nothing",
    "host_escape": "hands data to the host (NumPy, lists, DLPack, CUDA array interface)",
    "device_only": "needs a device or backend this build lacks, so no probe ran here",
    "shim_hidden": "asks torch.overrides.has_torch_function at call time, which the fast-path shim answers "
                   "as if capture were off; with plain arguments the call then skips capture",
    "dispatch_level": "its effect happens below __torch_function__ (autocast casts, decompositions)",
    "fastpath": "eval-mode modules may bypass it for a fused kernel (kept on by capture/fastpath.py)",
    "nondeterministic": "draws random numbers: a replay differs unless the generator state is restored",
}


def namespace_name(namespace) -> str:
    """The dotted name of a registry key: a module, ``torch.Tensor``, or one of its properties."""
    if isinstance(namespace, types.ModuleType):
        return namespace.__name__
    if namespace is torch.Tensor:
        return "torch.Tensor"
    for owner in (torch.Tensor, torch._C.TensorBase):
        for attr, value in vars(owner).items():
            if value is namespace:
                return f"torch.Tensor.{attr}"
    return f"{getattr(namespace, '__module__', '?')}.{getattr(namespace, '__name__', repr(namespace))}"


def _attribute_names(namespace) -> dict:
    """id(object) -> the attribute names under which ``namespace`` exposes it."""
    names: dict = {}
    for attr in dir(namespace):
        try:
            value = getattr(namespace, attr)
        except Exception:  # some attributes raise on access; they are not registry entries
            continue
        names.setdefault(id(value), []).append(attr)
    return names


def _qualified(prefix: str, func, by_id: dict | None) -> str:
    if type(func).__name__ == "method-wrapper":  # a property's __get__: the key already names it
        return f"{prefix}.{func.__name__}"
    own = getattr(func, "__name__", None)
    candidates = by_id.get(id(func), []) if by_id is not None else []
    if own in candidates or not candidates:
        return f"{prefix}.{own}"
    return f"{prefix}.{sorted(candidates)[0]}"


@functools.lru_cache(maxsize=1)
def registry() -> dict:
    """Qualified name -> callable for every entry of torch's overridable-function registry."""
    flat: dict = {}
    for namespace, funcs in torch.overrides.get_overridable_functions().items():
        prefix = namespace_name(namespace)
        by_id = None if prefix.count(".") > 1 and prefix.startswith("torch.Tensor.") else _attribute_names(namespace)
        for func in funcs:
            flat.setdefault(_qualified(prefix, func, by_id), func)
    return dict(sorted(flat.items()))


def load(path=INVENTORY_PATH) -> dict:
    """The checked-in inventory: qualified name -> row dict (columns as in ``COLUMNS``)."""
    with open(path, newline="") as handle:
        return {row["name"]: row for row in csv.DictReader(handle)}


def drift(inventory_names, registry_names) -> tuple:
    """(registry functions the inventory does not classify, inventory rows torch no longer has)."""
    inventory_names, registry_names = set(inventory_names), set(registry_names)
    return sorted(registry_names - inventory_names), sorted(inventory_names - registry_names)


def save(rows: list, path=INVENTORY_PATH) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        for row in sorted(rows, key=lambda r: r["name"]):
            writer.writerow({c: row.get(c, "") for c in COLUMNS})
