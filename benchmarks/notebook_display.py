"""What a notebook keeps for a displayed trace: ``_repr_html_`` bytes against the full viewer's.

For a 12-layer BERT (small widths, random weights: the op count does not depend on width) and a GPT-2
with more layers, it reports the ops, the full interactive viewer page (what every display used to
embed), the notebook display (summary, tables and the gzip-packed viewer), and the median seconds of
five ``_repr_html_`` calls.  Sizes are exact; the times are for orientation on a shared machine.
Run: ``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/notebook_display.py``.
"""

from __future__ import annotations

import statistics
import time

import torch

import torchlens as tl


def _bert(layers):
    import transformers

    config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100)
    return transformers.BertModel(config).eval(), torch.randint(0, 100, (1, 8))


def _gpt2(layers):
    import transformers

    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval(), torch.randint(0, 100, (1, 8))


def main() -> None:
    torch.manual_seed(0)
    print(f"{'model':<16} {'ops':>6} {'full viewer':>12} {'display':>10} {'ratio':>6} {'display s':>10}")
    for name, (model, ids) in (("bert-12", _bert(12)), ("gpt2-40", _gpt2(40))):
        log = tl.trace(model, ids)
        full = len(log.render(None, format="html").encode("utf-8"))
        times = []
        for _ in range(5):
            started = time.perf_counter()
            shown = log._repr_html_()
            times.append(time.perf_counter() - started)
        size = len(shown.encode("utf-8"))
        print(f"{name:<16} {len(log):>6} {full:>12,} {size:>10,} {full / size:>6.1f} {statistics.median(times):>10.2f}")


if __name__ == "__main__":
    main()
