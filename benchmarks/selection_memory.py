"""What a ``save=`` selection of every block holds at its peak during the forward.

A selection of module addresses (``tl.extract``'s ``layers=``) keeps each module's output, saved as the call
returns: nothing inside a selected call is held meanwhile.  The peak is measured as the smallest
``max_saved_bytes`` under which the trace saves every selected output (found by bisection: a budget the peak
exceeds stops saving with a warning), and reported beside the bytes of the selected outputs alone and of
``save="all"``.  The memory really held is measured too: the bytes of every live tensor's storage as the
model's last module starts (``gc``, each storage once), with the selection, with ``save="all"`` and with
``save="none"``.  With ``--baseline DIR`` (another revision's ``src/torchlens``) the same is measured there in
a worker process, beside this revision.  Deterministic: the figures do not move with the host's load.  Needs
``transformers`` (models from small configs, random weights, no download).

Run:  .venv/bin/python benchmarks/selection_memory.py [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def _live_bytes() -> int:
    """The bytes of the storages of every tensor alive now, each storage once."""
    import gc

    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def live_at_last_module(tl, model, ids, save, last) -> int:
    """The live tensor bytes as module ``last`` starts, inside ``tl.trace(model, ids, save=save)``."""
    seen = []
    handle = model.get_submodule(last).register_forward_pre_hook(lambda module, args: seen.append(_live_bytes()))
    try:
        with torch.no_grad():
            tl.trace(model, ids, save=save)
    finally:
        handle.remove()
    return seen[0]


def _models():
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

    torch.manual_seed(0)
    ids = torch.randint(0, 99, (2, 64), generator=torch.Generator().manual_seed(1))
    gpt2 = GPT2Model(GPT2Config(n_embd=64, n_layer=6, n_head=4, vocab_size=99, n_positions=64)).eval()
    bert = BertModel(BertConfig(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, intermediate_size=128,
                                vocab_size=99, max_position_embeddings=64)).eval()
    return {"GPT-2, 6 blocks, d=64, 2x64 tokens": (gpt2, ids, [f"h.{i}" for i in range(6)], "ln_f"),
            "BERT, 6 layers, d=64, 2x64 tokens": (bert, ids, [f"encoder.layer.{i}" for i in range(6)], "pooler")}


def _saves_everything(tl, model, ids, selection, budget: int) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tl.trace(model, ids, save=selection, max_saved_bytes=budget)
    return not any("max_saved_bytes" in str(w.message) for w in caught)


def peak_held(tl, model, ids, selection, last) -> dict:
    """Bytes of the selected outputs, of save="all", and the smallest budget that saves the selection."""
    with torch.no_grad():
        outputs = tl.trace(model, ids, save=selection).saved_bytes
        everything = tl.trace(model, ids).saved_bytes
        # low fails (the outputs alone need it); high, twice save="all", saves all (checked: an older revision's
        # budget counted a tensor saved for two ops twice, so its peak could pass what save="all" holds).
        low, high = outputs - 1, 2 * everything
        if not _saves_everything(tl, model, ids, selection, high):
            high = float("nan")
            return {"outputs": outputs, "all": everything, "peak": high, **live(tl, model, ids, selection, last)}
        while high - low > max(64, outputs // 1000):
            middle = (low + high) // 2
            low, high = (low, middle) if _saves_everything(tl, model, ids, selection, middle) else (middle, high)
    return {"outputs": outputs, "all": everything, "peak": high, **live(tl, model, ids, selection, last)}


def live(tl, model, ids, selection, last) -> dict:
    return {f"live {name}": live_at_last_module(tl, model, ids, save, last)
            for name, save in (("selection", selection), ("all", "all"), ("none", "none"))}


def measure() -> dict:
    import torchlens as tl

    return {name: peak_held(tl, *entry) for name, entry in _models().items()}


def _in_worker(source: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.abspath(source))}
    done = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another revision's src/torchlens directory, measured beside this one")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(measure()))
        return
    this = _in_worker(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "torchlens"))
    base = _in_worker(options.baseline) if options.baseline else None
    print("| model | selected outputs KiB | save=\"all\" KiB | peak held KiB (x outputs)" +
          (" | baseline peak KiB (x outputs)" if base else "") +
          " | live MiB at the last module: selection / all / none" + (" | baseline: selection |" if base else " |"))
    print("|---|---|---|---|---|" + ("---|---|" if base else ""))
    for name, row in this.items():
        cells = [name, f"{row['outputs'] / 1024:.0f}", f"{row['all'] / 1024:.0f}",
                 f"{row['peak'] / 1024:.0f} ({row['peak'] / row['outputs']:.1f}x)"]
        if base:
            old = base[name]
            cells.append(f"{old['peak'] / 1024:.0f} ({old['peak'] / old['outputs']:.1f}x)")
        cells.append(" / ".join(f"{row['live ' + k] / 2**20:.1f}" for k in ("selection", "all", "none")))
        if base:
            cells.append(f"{base[name]['live selection'] / 2**20:.1f}")
        print("| " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
