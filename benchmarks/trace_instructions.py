"""Instructions per ``tl.trace`` of the transformers rows, counted by callgrind: figures that do not move
with the load of a shared host, for comparing two revisions.

For each model of ``transformers_overhead.py`` and each arm (the untraced forward, this revision's
``tl.trace`` and, with ``--baseline``, another revision's), a worker process runs the arm ``--few`` and then
``--many`` times under ``valgrind --tool=callgrind``; the difference of the two totals over the
difference of the counts is what one call executes, its forward included (import, model building and
warm-up cancel out), and a trace's added instructions are its count less the forward's.  The
collector is frozen and disabled before the counted traces, so that no collection lands among them, and
the instructions of idle BLAS worker threads (``blas_thread_server``, which spin for as long as they like)
are left out.  Needs valgrind (Debian's ``valgrind``); each worker takes one to two minutes.  Run:

    python benchmarks/trace_instructions.py [--baseline /path/to/other/src/torchlens] [--models GPT-2,BERT]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_IDLE = ("blas_thread_server",)  # worker threads of a BLAS library, spinning while idle


def _worker(model: str, baseline: str | None, count: int) -> None:
    """Run the model whose name starts with ``model`` ``count`` times (after a warm-up): traced by this
    revision, by the revision at ``baseline``, or untraced (``baseline`` "native")."""
    import gc

    import torch

    sys.path.insert(0, _HERE)
    from models import baseline_package
    from transformers_overhead import _models

    torch.set_num_threads(1)
    torch.backends.mha.set_fastpath_enabled(False)
    built, args, kwargs = next(v for k, v in _models().items() if k.startswith(model))
    if baseline == "native":
        def run():
            return built(*args, **kwargs)
    else:
        tl = baseline_package(baseline) if baseline else __import__("torchlens")

        def run():
            return tl.trace(built, args, kwargs)
    with torch.no_grad():
        for _ in range(5):
            run()
        gc.collect()
        gc.freeze()
        gc.disable()
        for _ in range(count):
            run()


def _counted(model: str, baseline: str | None, count: int, folder: str) -> int:
    """Instructions of a worker run, less the idle BLAS threads'."""
    out = os.path.join(folder, f"callgrind.{abs(hash((model, baseline, count)))}.out")
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
               "--worker", model, "--count", str(count)] + (["--baseline", baseline] if baseline else [])
    subprocess.run(command, check=True, capture_output=True)
    listing = subprocess.run(["callgrind_annotate", "--threshold=100", out], check=True, capture_output=True,
                             text=True).stdout
    total, idle = None, 0
    for line in listing.splitlines():
        if line.startswith("-- Auto"):
            break
        found = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S.*)$", line)
        if found is None:
            continue
        n = int(found.group(1).replace(",", ""))
        if "PROGRAM TOTALS" in found.group(2):
            total = n
        elif any(name in found.group(2) for name in _IDLE):
            idle += n
    return total - idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another revision's src/torchlens directory")
    parser.add_argument("--models", default="GPT-2,BERT,Llama,nn.TransformerEncoder",
                        help="comma-separated prefixes of transformers_overhead.py's model names")
    parser.add_argument("--few", type=int, default=10)
    parser.add_argument("--many", type=int, default=60)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        _worker(options.worker, options.baseline, options.count)
        return
    arms = {"native": "native", "this": None} | ({"baseline": options.baseline} if options.baseline else {})
    print("| model | forward | tl.trace added | " + ("baseline tl.trace added | this / baseline, added |"
                                                    if options.baseline else ""))
    print("|---|---|---|" + ("---|---|" if options.baseline else ""))
    with tempfile.TemporaryDirectory() as folder:
        for model in options.models.split(","):
            per_call = {}
            for name, path in arms.items():
                many = _counted(model, path, options.many, folder)
                few = _counted(model, path, options.few, folder)
                per_call[name] = (many - few) / (options.many - options.few)
            added = {name: v - per_call["native"] for name, v in per_call.items() if name != "native"}
            cells = [f"{per_call['native'] / 1e6:.3f} M", f"{added['this'] / 1e6:.3f} M"]
            if options.baseline:
                cells += [f"{added['baseline'] / 1e6:.3f} M", f"{added['this'] / added['baseline']:.3f}"]
            print(f"| {model} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
