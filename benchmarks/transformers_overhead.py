"""What ``tl.trace`` adds to the forwards people trace most: transformers models, called as they are called.

Models: GPT-2, BERT and Llama from small configs (2 layers, hidden 64, random weights, nothing
downloaded), each called with keyword inputs (``input_ids=``, ``attention_mask=``) as transformers users
call them, and ``torch.nn.TransformerEncoder`` (2 layers, d=64), whose layers call their attention,
feed-forward and dropout modules from helpers of their forward.  Per model, one process times side by
side (ABBA blocks, ``torch.set_num_threads(1)``, eval, ``no_grad``, torch's fused attention fast path
off so that every arm runs the same ops, as in ``trace_overhead.py``): the untraced forward, a bare
``TorchFunctionMode``, the minimal recorder mode, ``tl.trace(save="all")``, ``tl.trace(save="none")``
and, with ``--baseline``, another revision's ``tl.trace(save="all")``.  Reported: medians [quartiles]
over repeats (each the fastest of four interleaved blocks) of the time added over the untraced forward,
per trace and per op, and the added time of this revision over the baseline's.  Run:

    python benchmarks/transformers_overhead.py [--baseline /path/to/other/src/torchlens] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixed_cost import _cell, interleaved  # noqa: E402
from models import BareMode, RecorderMode, baseline_package  # noqa: E402


def _models() -> dict:
    """name -> (model in eval mode, args, kwargs)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128,
                                      bos_token_id=0, eos_token_id=0))
    bert = BertForSequenceClassification(BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                    intermediate_size=128, vocab_size=128,
                                                    max_position_embeddings=64))
    llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                                         max_position_embeddings=64))
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(2))
    return {"GPT-2 (GPT2LMHeadModel)": (gpt2.eval(), (), inputs),
            "BERT (BertForSequenceClassification)": (bert.eval(), (), inputs),
            "Llama (LlamaForCausalLM)": (llama.eval(), (), inputs),
            "nn.TransformerEncoder": (encoder.eval(), (x,), {})}


def _arms(model, args, kwargs, packages: dict) -> dict:
    def bare():
        with BareMode():
            return model(*args, **kwargs)

    def recorder():
        with RecorderMode():
            return model(*args, **kwargs)

    this = packages["this"]
    arms = {"native": lambda: model(*args, **kwargs), "bare mode": bare, "recorder": recorder,
            'tl.trace(save="all")': lambda: this.trace(model, args, kwargs),
            'tl.trace(save="none")': lambda: this.trace(model, args, kwargs, save="none")}
    if "baseline" in packages:
        arms['baseline tl.trace(save="all")'] = lambda: packages["baseline"].trace(model, args, kwargs)
    return arms


def _block_size(fn) -> int:
    start = time.perf_counter_ns()
    fn()
    return max(5, int(3e6 / max(time.perf_counter_ns() - start, 1)))  # about 3 ms a block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another revision's src/torchlens directory")
    parser.add_argument("--repeats", type=int, default=15)
    options = parser.parse_args()
    import torchlens

    packages = {"this": torchlens}
    if options.baseline:
        packages["baseline"] = baseline_package(options.baseline)
    torch.set_num_threads(1)
    torch.backends.mha.set_fastpath_enabled(False)
    rows = []
    with torch.no_grad():
        for name, (model, args, kwargs) in _models().items():
            ops = len(torchlens.trace(model, args, kwargs).ops)
            arms = _arms(model, args, kwargs, packages)
            for fn in arms.values():  # warm every path (frame verdicts, cached signatures, model index)
                fn()
            best = interleaved(arms, options.repeats, _block_size(arms['tl.trace(save="all")']))
            native = best["native"]
            added = {arm: [t - n for t, n in zip(times, native)] for arm, times in best.items() if arm != "native"}
            rows.append((name, ops, statistics.median(native), added))
    _print(rows, "baseline" in packages, options)


def _print(rows, with_baseline: bool, options) -> None:
    arms = list(rows[0][3])
    print("| model | ops | native us | " + " | ".join(f"{a} added us (per op)" for a in arms)
          + (" | this / baseline, added |" if with_baseline else " |"))
    print("|---|---|---|" + "---|" * len(arms) + ("---|" if with_baseline else ""))
    for name, ops, native, added in rows:
        cells = [f"{_cell(v)} ({statistics.median(v) / ops:.1f})" for v in added.values()]
        line = f"| {name} | {ops} | {native:.0f} | " + " | ".join(cells)
        if with_baseline:
            ratios = [a / b for a, b in zip(added['tl.trace(save="all")'], added['baseline tl.trace(save="all")'])]
            line += f" | {_cell(ratios)}"
        print(line + " |")
    print(f"\nMedians [quartiles] of {options.repeats} repeats; torch {torch.__version__}, 1 torch thread, "
          f"load {tuple(round(v, 2) for v in os.getloadavg())}.")


if __name__ == "__main__":
    main()
