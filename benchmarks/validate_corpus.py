"""False alarms of ``tl.validate`` on a corpus of faithful traces.

Every case here traces bit-identically, so any mismatch (or an "outputs differ") is a false alarm.
The corpus: the test zoo (``tests/zoo.py``), small-config ``transformers`` models with random weights in
eval and train mode, and two-layer ``nn.LSTM``/``nn.GRU`` with grad enabled.  Prints one line per case
with an alarm and the count.  Run:  .venv/bin/python benchmarks/validate_corpus.py
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.nn as nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torchlens as tl  # noqa: E402
from zoo import zoo  # noqa: E402


def transformers_cases() -> dict:
    import transformers as T

    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return {
        "gpt2": (lambda: T.GPT2Model(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                                  bos_token_id=0, eos_token_id=0)), (ids,), {}),
        "bert": (lambda: T.BertModel(T.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=4, intermediate_size=64)), (ids,), {}),
        "llama": (lambda: T.LlamaModel(T.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=2,
                                                     intermediate_size=64)), (ids,), {}),
        "t5": (lambda: T.T5Model(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)),
               (), {"input_ids": ids, "decoder_input_ids": ids[:, :4]}),
        "swin": (lambda: T.SwinModel(T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                                  num_heads=[2, 2], window_size=4)), (image,), {}),
        "vit": (lambda: T.ViTModel(T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=64)), (image,), {}),
    }


def cases() -> list:
    rows = [(name, lambda m=m, a=a, k=k: tl.validate(m, a, k)) for name, (m, a, k) in sorted(zoo().items())]
    for name, (make, args, kwargs) in transformers_cases().items():
        for train in (False, True):
            def run(make=make, args=args, kwargs=kwargs, train=train):
                torch.manual_seed(0)
                return tl.validate(make().train(train), args, kwargs)
            rows.append((f"{name}-{'train' if train else 'eval'}", run))
    for rnn in (nn.LSTM, nn.GRU):
        def run_rnn(rnn=rnn):
            torch.manual_seed(0)
            return tl.validate(rnn(8, 16, num_layers=2), torch.randn(5, 3, 8))
        rows.append((rnn.__name__, run_rnn))
    return rows


def main() -> None:
    warnings.filterwarnings("ignore")
    alarms = 0
    rows = cases()
    for name, run in rows:
        result = run()
        if result.mismatched or result.outputs_match is False:
            alarms += 1
            print(f"{name}: false alarm: {[label for label, _ in result.mismatched][:4]} "
                  f"outputs match: {result.outputs_match}")
    print(f"{alarms} of {len(rows)} faithful cases with a validation false alarm")


if __name__ == "__main__":
    main()
