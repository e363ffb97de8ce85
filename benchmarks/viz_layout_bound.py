"""What bounding Graphviz's placement costs and saves: each picture laid out with its bound and without it.

Every picture torchlens writes caps the network simplex that places each layer's nodes (``nslimit`` in its
graph attributes, see src/torchlens/viz/dot.py).  This lays out the same DOT text twice, as written and with the
bound taken out, and reports:

- the seconds each takes on the shape the bound is for: a recurrent cell applied in a Python loop that reads its
  input at every step, collapsed to depth 0, at growing step counts;
- over the pictures of common models (the test zoo, the overhead benchmark's models, small transformers models,
  each at several depths and in both views), how many are laid out byte for byte as without the bound.

Run:  .venv/bin/python benchmarks/viz_layout_bound.py [--steps 30 45 60] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import sys
import time

import torch

import torchlens as tl
from torchlens.viz.layout import find_engine, layout

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
import models  # noqa: E402  (the overhead benchmark's models)
import zoo  # noqa: E402  (the test suite's models)

BOUND = re.compile(r"nslimit=\d+, ")


def unbounded(text: str) -> str:
    return BOUND.sub("", text, count=1)


def seconds(text: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        layout([text])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def loop_rows(steps: list, repeat: int) -> list:
    rows = ["| loop steps | nodes | bound | laid out with it, s | without it, s |", "|---|---|---|---|---|"]
    for n in steps:
        text = tl.trace(zoo.StepLoop(), torch.randn(2, n, 8)).render(depth=0)
        nodes = text.count("[id=")
        bound = BOUND.search(text).group(0).rstrip(", ")
        rows.append(f"| {n} | {nodes} | {bound} | {seconds(text, repeat):.2f} | "
                    f"{seconds(unbounded(text), repeat):.2f} |")
    return rows


def common_models() -> list:
    """(name, model, args) for the pictures of common models."""
    cases = [(name, model, args) for name, (model, args, kwargs) in zoo.zoo().items() if not kwargs]
    cases += [(name, *models.build(name)) for name in ("mlp20", "resnet", "transformer", "gpt2", "loop_rnn")]
    try:
        from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel
    except ImportError:
        return cases
    tokens = (torch.randint(0, 100, (1, 8)),)
    cases.append(("transformers GPT-2", GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2,
                                                                   vocab_size=100)).eval(), tokens))
    cases.append(("transformers BERT", BertModel(BertConfig(num_hidden_layers=2, hidden_size=32, vocab_size=100,
                                                            num_attention_heads=2, intermediate_size=64)).eval(),
                  tokens))
    return cases


def identical_pictures() -> tuple:
    same, differing, bounded_s, unbounded_s = 0, [], 0.0, 0.0
    for name, model, args in common_models():
        log = tl.trace(model, *args)
        for depth in (None, 0, 1, 2):
            for view in ("unrolled", "rolled"):
                text = log.render(depth=depth, view=view)
                start = time.perf_counter()
                with_bound = layout([text])[0]
                middle = time.perf_counter()
                without = layout([unbounded(text)])[0]
                bounded_s, unbounded_s = bounded_s + middle - start, unbounded_s + time.perf_counter() - middle
                if with_bound == without:
                    same += 1
                else:
                    differing.append(f"{name} depth={depth} {view}")
    return same, differing, bounded_s, unbounded_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[30, 45, 60])
    parser.add_argument("--repeat", type=int, default=3)
    options = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    print(f"layout engine: {find_engine()}\n")
    print("\n".join(loop_rows(options.steps, options.repeat)))
    same, differing, bounded_s, unbounded_s = identical_pictures()
    print(f"\npictures of common models laid out byte for byte as without the bound: {same} of "
          f"{same + len(differing)} (all of them: {bounded_s:.1f} s with the bound, {unbounded_s:.1f} s without)")
    for picture in differing:
        print(f"  differs: {picture}")


if __name__ == "__main__":
    main()
