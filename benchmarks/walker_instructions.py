"""Instructions per call of the tensor walker, counted by callgrind: this revision beside another.

The walker is ``torchlens.tree.tensor_leaves``, and the values are of the shapes a trace walks: capture
walks module calls' arguments and results that are not a lone tensor, finalize walks the model's output,
and validation and extraction walk whole return values; a transformers model returns a ``ModelOutput``
(an ``OrderedDict`` subclass) holding a cache object, whose key and value tensors finalize finds among
the cache's attributes (``attrs=True``, the walk of a model's inputs and output).  Per value and revision, a worker
process warms up (200 calls), then makes ``--calls`` calls inside one ``operator.call``, the only place
callgrind collects (``trace_instructions.instructions``).  Needs valgrind and, for the ``ModelOutput``
value, transformers.  Run:

    python benchmarks/walker_instructions.py [--baseline /path/to/other/src/torchlens] [--calls 100]
        [--values "tensor,ModelOutput with a cache"]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_VALUES = ("tensor", "tuple of 2 tensors", "dict of 2 tensors and None", "list of 100 tensors",
           "nested containers", "ModelOutput with a cache", "ModelOutput with a 12-layer cache (attrs)")
_ATTRS = {"ModelOutput with a 12-layer cache (attrs)"}  # walked as finalize walks a model's output


def _value(name: str):
    import torch

    t = torch.ones(2)
    if name.startswith("ModelOutput"):
        from transformers import DynamicCache
        from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

        cache = DynamicCache()
        if name in _ATTRS:
            for layer in range(12):
                cache.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), layer)
        return CausalLMOutputWithCrossAttentions(logits=t, past_key_values=cache)
    return {"tensor": t, "tuple of 2 tensors": (t, t), "dict of 2 tensors and None": {"a": t, "b": t, "c": None},
            "list of 100 tensors": [t] * 100, "nested containers": (t, [t, (t, 1)], {"k": t})}[name]


def _worker(name: str, baseline: str | None, calls: int) -> None:
    import gc
    import operator

    sys.path.insert(0, _HERE)
    from models import baseline_package

    package = baseline_package(baseline) if baseline else __import__("torchlens")
    walk, value, attrs = package.tree.tensor_leaves, _value(name), name in _ATTRS
    for _ in range(200):
        walk(value, attrs=attrs)
    gc.collect()
    gc.disable()
    operator.call(lambda: [walk(value, attrs=attrs) for _ in range(calls)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another revision's src/torchlens directory")
    parser.add_argument("--calls", type=int, default=100, help="calls counted per value")
    parser.add_argument("--values", default=",".join(_VALUES), help="comma-separated subset of the values")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        _worker(options.worker, options.baseline, options.calls)
        return
    sys.path.insert(0, _HERE)
    from trace_instructions import instructions

    revisions = [None] + ([options.baseline] if options.baseline else [])
    print("| value | instructions per call" + (" | baseline | this / baseline" if options.baseline else "") + " |")
    print("|---|---" + ("|---|---" if options.baseline else "") + "|")
    with tempfile.TemporaryDirectory() as folder:
        for name in options.values.split(","):
            counts = [instructions([__file__, "--worker", name, "--calls", str(options.calls)]
                                   + (["--baseline", path] if path else []), os.path.join(folder, "callgrind.out"))
                      / options.calls for path in revisions]
            cells = [f"{c:,.0f}" for c in counts] + ([f"{counts[0] / counts[1]:.2f}"] if options.baseline else [])
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
