"""The real-model corpus with its key/value cache on: does a trace record the cache, and does validation
leave it as one forward would?

For each transformers entry of tests/real_models.py that keeps a cache, a prefix runs untraced (no
grad), then the next step is traced with that cache passed in (``past_key_values=``, or Mamba's
``cache_params=``), and validated on a copy of it.  Per model it prints:

- ``cache in`` / ``cache out``: the trace's inputs and outputs whose path runs through the cache;
- ``unattributed``: tensors ops read that the trace never saw made (0 when the cache's tensors are inputs);
- ``validate``: the verdict of ``tl.validate`` on the step;
- ``extended once``: the cache ``tl.validate`` was given is, afterwards, exactly what one untraced step
  makes of it (validation runs its reference forward on a copy).

Run:  HF_HUB_OFFLINE=1 PYTHONPATH=src python scripts/cache_corpus.py [names...]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import real_models  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.tree import tensor_leaves  # noqa: E402

MODELS = ("gpt2", "llama", "mistral", "qwen2", "t5", "bart", "whisper", "mamba")


def row(name) -> str:
    model, prefix, step, key = real_models.cache_steps(name)
    with torch.no_grad():
        cache = getattr(model(**prefix, use_cache=True), key)
    kept = copy.deepcopy(cache)
    log = tl.trace(model, (), {**step, key: cache, "use_cache": True})
    cache_in = sum(op.io_path.startswith(f"input.{key}.") for op in log.ops if op.kind == "input")
    cache_out = sum(op.io_path.startswith(f"output.{key}.") for op in log.ops if op.kind == "output")
    given, once = copy.deepcopy(kept), copy.deepcopy(kept)
    result = tl.validate(model, (), {**step, key: given, "use_cache": True})
    model(**step, **{key: once}, use_cache=True)  # with grad on, as validate runs (kernels differ without)
    a, b = tensor_leaves(given, attrs=True), tensor_leaves(once, attrs=True)
    extended_once = len(a) == len(b) and all(p == q and torch.equal(s, t) for (p, s), (q, t) in zip(a, b))
    return (f"| {name} | {type(cache).__name__} | {cache_in} | {cache_out} | {log.unattributed} | "
            f"{result.status} | {extended_once} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(MODELS))
    options = parser.parse_args()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    print("| model | cache | cache in | cache out | unattributed | validate | extended once |")
    print("|---|---|---|---|---|---|---|")
    for name in options.names:
        try:
            print(row(name), flush=True)
        except Exception as exc:  # noqa: BLE001 - a crash is a row of the report
            print(f"| {name} | crashed: {type(exc).__name__}: {str(exc)[:120]} | | | | | |", flush=True)


if __name__ == "__main__":
    main()
