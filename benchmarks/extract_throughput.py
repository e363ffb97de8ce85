"""Extraction throughput: ``tl.extract`` against a hand-written forward-hook extractor, same layers.

Both arms run the same model over the same batches under ``torch.no_grad()``, keep the outputs of the
same modules, and write them to disk in safetensors shards of the same size; the hook arm is the short
script people write by hand (hooks that copy outputs to the CPU, ``save_file`` per shard).  What
``tl.extract`` adds on top is the per-batch trace (every op recorded), the progress manifest and
atomic commits that make it resumable, and the final per-layer consolidation that makes the result
one memory-mappable array per layer.  Arms alternate order across repeats; the median of each is
reported with the ratio, on this machine, in one run.

Run:  .venv/bin/python benchmarks/extract_throughput.py [--batches 40] [--batch-size 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import SmallResNet  # noqa: E402

import torchlens as tl  # noqa: E402

LAYERS = ["stem", "blocks.1", "blocks.3", "blocks.5", "head"]
SHARD_BYTES = 64 << 20


def hook_extractor(model, batches, layers, out) -> None:
    """The hand-written baseline: forward hooks, CPU copies, one safetensors file per shard."""
    from safetensors.torch import save_file

    modules = dict(model.named_modules())
    buffers = {name: [] for name in layers}
    handles = [modules[name].register_forward_hook(lambda m, i, o, name=name: buffers[name].append(o.detach().cpu()))
               for name in layers]
    size, shard = 0, 0
    try:
        with torch.no_grad():
            for x in batches:
                model(x)
                size += sum(b[-1].numel() * b[-1].element_size() for b in buffers.values())
                if size >= SHARD_BYTES:
                    save_file({k: torch.cat(v) for k, v in buffers.items()}, os.path.join(out, f"{shard}.safetensors"))
                    shard, size = shard + 1, 0
                    for v in buffers.values():
                        v.clear()
            if size:
                save_file({k: torch.cat(v) for k, v in buffers.items()}, os.path.join(out, f"{shard}.safetensors"))
    finally:
        for h in handles:
            h.remove()


def torchlens_extractor(model, batches, layers, out) -> None:
    tl.extract(model, batches, layers, out, shard_bytes=SHARD_BYTES, progress=False)


def timed(arm, model, batches) -> float:
    out = tempfile.mkdtemp(prefix="tl-bench-")
    try:
        started = time.perf_counter()
        arm(model, batches, LAYERS, out)
        return time.perf_counter() - started
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image", type=int, default=32, help="input height and width")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()

    torch.manual_seed(0)
    model = SmallResNet().eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(opts.batch_size, 3, opts.image, opts.image, generator=g) for _ in range(opts.batches)]
    arms = {"forward hooks": hook_extractor, "tl.extract": torchlens_extractor}
    timed(torchlens_extractor, model, batches[:2])  # warm-up: lazy imports, allocator
    times = {name: [] for name in arms}
    for r in range(opts.repeats):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for name in order:
            times[name].append(timed(arms[name], model, batches))

    n = opts.batches * opts.batch_size
    print(f"SmallResNet, {opts.batches} batches of {opts.batch_size}x3x{opts.image}x{opts.image}, layers "
          f"{', '.join(LAYERS)}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {opts.repeats} alternating repeats")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:<14} {median:7.3f} s   {n / median:9.1f} inputs/s   (runs: "
              f"{', '.join(f'{s:.3f}' for s in samples)})")
    ratio = statistics.median(times["tl.extract"]) / statistics.median(times["forward hooks"])
    print(f"  ratio tl.extract / forward hooks: {ratio:.2f}x the time")


if __name__ == "__main__":
    main()
