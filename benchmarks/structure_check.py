"""The model-structure check a cached ``index_of`` runs every trace, on each path, per model.

Per model, one process times side by side (ABBA blocks, ``torch.set_num_threads(1)``):
- ``index_of (cached)`` with the check on the pure-Python path (``Structure``) and on the compiled one
  (torchlens-accel's ``_index.Snapshot``), each on its own copy of the model indexed on that path;
- the check alone: ``Structure.unchanged``, ``Snapshot.unchanged`` with the dict-version shortcut and
  ``Snapshot.unchanged`` comparing every entry (``versions=False``);
- with ``--baseline``, another revision's ``index_of (cached)``.

Models: the ResNet-like CNN of ``fixed_cost.py --steps`` (43 modules) and transformers GPT-2 and BERT
from small configs with 12 layers (random weights, nothing downloaded).  Reported: medians [quartiles]
over repeats, each the fastest of four interleaved blocks, in microseconds per check, and per module.
Needs the compiled module built (``cd accel && python setup.py build_ext --inplace``, ``accel/src`` on
``PYTHONPATH``).  Run:

    python benchmarks/structure_check.py [--baseline /path/to/other/src/torchlens] [--repeats 15]
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixed_cost import _cell, interleaved  # noqa: E402
from models import SmallResNet, baseline_package  # noqa: E402


def _models() -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

    torch.manual_seed(0)
    gpt2 = GPT2Model(GPT2Config(n_layer=12, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
                                bos_token_id=0, eos_token_id=0)).eval()
    bert = BertModel(BertConfig(num_hidden_layers=12, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                vocab_size=128, max_position_embeddings=64)).eval()
    return {"ResNet-like": SmallResNet((8, 16, 32)).eval(), "GPT-2, 12 layers": gpt2, "BERT, 12 layers": bert}


def _arms(model, packages: dict) -> dict:
    this = packages["this"]
    accel = importlib.import_module(f"{this.__name__}.capture.accel")
    model_index = importlib.import_module(f"{this.__name__}.record.model_index")
    native = accel.compiled("_index")
    if native is None:
        raise SystemExit("torchlens-accel's _index is not built: cd accel && python setup.py build_ext --inplace, "
                         "then put accel/src on PYTHONPATH")
    on_python, on_compiled = copy.deepcopy(model), copy.deepcopy(model)
    previous = accel.use(False)
    try:
        model_index.index_of(on_python)
    finally:
        accel.use(previous)
    model_index.index_of(on_compiled)
    assert isinstance(model_index._cache[id(on_python)][1], model_index.Structure)
    assert isinstance(model_index._cache[id(on_compiled)][1], native.Snapshot)
    modules = list(model_index.ModelIndex(model).submodules.values())
    structure = model_index.Structure(model, list(modules))
    versions, entries = native.Snapshot(model, list(modules)), native.Snapshot(model, list(modules), versions=False)
    assert structure.unchanged(model) and versions.unchanged(model) and entries.unchanged(model)
    arms = {
        "index_of (cached), Python check": lambda: model_index.index_of(on_python),
        "index_of (cached), compiled check": lambda: model_index.index_of(on_compiled),
        "Structure.unchanged": lambda: structure.unchanged(model),
        f"Snapshot.unchanged, {'version tags' if versions.versions else 'every entry (no version tags here)'}":
            lambda: versions.unchanged(model),
        "Snapshot.unchanged, every entry": lambda: entries.unchanged(model),
    }
    if "baseline" in packages:
        baseline_index = sys.modules[f"{packages['baseline'].__name__}.record.model_index"]
        on_baseline = copy.deepcopy(model)
        baseline_index.index_of(on_baseline)
        arms["index_of (cached), baseline"] = lambda: baseline_index.index_of(on_baseline)
    return arms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="another revision's src/torchlens directory, timed beside this one")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000, help="checks per timed block")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    import torchlens

    packages = {"this": torchlens}
    if opts.baseline:
        packages["baseline"] = baseline_package(os.path.abspath(opts.baseline))
    for name, model in _models().items():
        count = len(dict.fromkeys(map(id, model.modules())))
        arms = _arms(model, packages)
        timed = interleaved(arms, opts.repeats, opts.calls)
        print(f"\n{name}: {count} modules\n\n| arm | us per check | ns per module |\n|---|---|---|")
        for arm, values in timed.items():
            print(f"| {arm} | {_cell(values)} | {_cell([v * 1e3 / count for v in values])} |")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"\ntorch {torch.__version__}, Python {sys.version.split()[0]}, 1 torch thread, load "
          f"{tuple(round(v, 2) for v in load) if load else '?'}; medians [quartiles] of {opts.repeats} repeats, "
          "each the fastest of four interleaved blocks per arm.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
