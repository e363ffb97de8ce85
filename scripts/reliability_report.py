"""Write docs/reliability.md from the reliability suite.

Runs every scenario registered in tests/reliability_cases.py (faults, contexts and wrappers,
concurrency, memory budget), each with its assertions, and writes one table row per scenario with the
outcome it returned; the property-test section is rendered from the random-model generator's own
tables.  tests/test_faults.py fails when the page differs from what this script would write.

Run:  .venv/bin/python scripts/reliability_report.py [--check]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
PAGE = os.path.join(ROOT, "docs", "reliability.md")
SUITE = ("test_faults", "test_contexts", "test_standard_paths", "test_concurrency", "test_budget")
AREAS = {
    "Faults": "An exception, interrupt or odd forward during a trace.",
    "Contexts and wrappers": "Global torch modes, unusual tensors, and wrapped or compiled models.",
    "Standard paths": "Inference mode, nested and sparse tensors, higher-order ops and compiled submodules "
                      "(`tests/test_standard_paths.py`).",
    "Concurrency": "Traces in several threads, and torch work beside a trace.",
    "Memory budget": "`max_saved_bytes`: where saving stops, and what is still recorded.",
}

INTRO = """\
# Reliability

A trace is only useful if it is either right or plainly refused. This page lists every fault, context
and model class the reliability suite puts `tl.trace` through, and what happened. Each row is a test:
the outcome column is the line that scenario returned after its assertions passed, so the page cannot
claim more than the suite checks. `scripts/reliability_report.py` writes this page from the suite, and
a test fails when the page is out of date.

After every scenario the suite also checks that nothing was left installed: no torch function mode on
the stack, no global module hooks, `torch.overrides.has_torch_function` and `nn.Module._call_impl` are
torch's own, and no attribute, hook or patch added to torch, the model, its parameters or the input
tensors.

When the model raises, the caller gets the model's own exception, unchanged, with one note (Python
3.11+) saying where in the forward it happened:

```python
import torch
import torchlens as tl


class WrongShape(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) @ torch.ones(3, 3)


try:
    tl.trace(WrongShape(), torch.randn(2, 4))
except RuntimeError as err:
    notes = getattr(err, "__notes__", [])
    print(err)
    print(notes)
assert torch._C._len_torch_function_stack() == 0  # capture is gone
```
"""

PROPERTIES = """\
## Random models

`tests/test_properties.py` generates models as real Python source (each step on its own line, loops as
real `for` loops, submodules as real attributes) from these step families: {families}; plus calls of
generated blocks nested up to three deep, blocks shared between call sites and registered under two
names, and Python loops over parameterised and parameter-free bodies. Every step template also runs on
its own. For each model the suite checks:

| property | how it is checked |
|---|---|
| faithful | the traced output is bit-identical to an untraced run on the same input,\
 with gradients on or under `torch.no_grad()` |
| replayable | `tl.validate` finds no mismatch; every op is replayed or listed with a reason,\
 and the only reason accepted is a read through a view after an in-place write |
| deterministic | two traces agree on every label, parent, module call, shape and source line |
| consistent passes | the j-th call of a shared module holds pass j of the same layers |
| clean | nothing is installed or added afterwards (see above) |

`tests/test_faults.py` draws random models again and injects one fault ({faults}) at a random step of
a random block; the caller sees exactly the untraced run's exception, with one added note naming the
torch call or module call, and the model then runs and traces exactly like an unfaulted twin.
"""

LIMITS = """\
## Limits found along the way

- Interrupts are handled anywhere: in the per-op handler, the module hooks, and every line of the trace
  driver's setup and teardown and of torch's own temporary mode pop (`handle_torch_function`). Each
  cleanup is idempotent and run twice (once by its `with`, once by a `finally` below it), because Python
  cannot make a `with` statement immune to an interrupt landing on its exit line; the checks assume one
  interrupt per trace, as the tests inject. When an interrupt leaves torch's push-back of the mode
  suspended inside `contextlib`, teardown resumes it (so it cannot reinstall the mode later) and removes
  the mode by identity, never popping an empty stack.
- Autocast is replayed as each op ran: around the traced call, or opened inside the model's own
  forward (each op records the autocast state it ran under).
- `torch.inference_mode()` is traced, around the trace or inside forward, with weaker write detection:
  inference tensors have no version counter, so in-place writes to them are known by name only
  (`add_`, `__setitem__`, `out=`, `inplace=True`); `Trace.caveats` says so. Use `torch.no_grad()` (same
  kernels, same values) for the full guarantees.
- Nested tensors are recorded with `None` for each ragged dimension; `op.numel` counts every component.
  Sparse COO, CSR, CSC, BSR and BSC results are recorded with their layout and logical (dense) shape,
  and validation compares them densely (a result of another layout than the one recorded is a mismatch,
  whatever its values). `op.nbytes` of a sparse op is that of its dense shape.
- `torch.cond` (and `torch.while_loop`, `map`, `scan`) in eager mode is one op, its branches unseen;
  `flex_attention` records the ops of its eager math path. Capture stays transparent while Dynamo
  compiles their bodies.
- A `torch.compile`d submodule runs compiled and is one `compiled` op; Dynamo compiles it with none of
  torchlens's hooks, mode or shim in sight. Its parameters are not listed on that op (they are used
  inside the compiled code). `compiled="eager"` records its interior instead, with a warning. A trace
  installs no global module hook, so torch gives no warning about them when such a submodule runs.

## Scale

`benchmarks/scale_memory.py` traces two 100,000-op models with `save="none"` and measures the Python
heap the finished trace keeps (`tracemalloc`). Measured on CPU with Python 3.11 and torch 2.13:

{scale}

Run it with `.venv/bin/python benchmarks/scale_memory.py --breakdown 12` to see which source lines keep
the bytes.

`benchmarks/scale_steps.py` times every user-facing step (tracing, the first reads, printing, tables,
pictures, files, validation, gradients, selections, intervention sites, extraction, `flops_vs_dispatch`)
on a model of n blocks and of 4n, and flags a step whose time grows more than 6x: linear work grows about
4x, so a faster growth is a quadratic part to find with cProfile on the two sizes.

`benchmarks/scale_calls.py` counts instead of timing: the Python calls each step makes with a finished
trace (tables, printing, lookups, validation, files, `hot_path`, gradients, interventions, the chrome
trace) at n, 4n and 16n blocks, on three shapes: a chain of distinct blocks, one block applied n times
(one module called n times, layers of n passes) and n branches over one input (an op with n children). The
counts are the same from run to run, so they read cleanly on a loaded machine; work inside a single C call is
not counted, which the timings of `scale_steps.py` cover. `tests/test_linear_steps.py` counts the same way, in the
suite, on the shapes where a step once grew with the square: a nest of n modules (each call's depth, `op.module`,
the module table, the calls' op counts, an intervention predicate at every op) and an output of n objects each
holding a tensor (`log.save`).
"""

# Figures from the last run of benchmarks/scale_memory.py (machine-independent to within a few bytes:
# they count Python objects, not timings). Update them when the record layout changes.
SCALE = """\
| model | ops | retained per op | peak per op while tracing |
|---|---|---|---|
| recurrent (50 blocks x 500 rounds) | 100,002 | 1,102 B | 1,466 B |
| feed-forward (25,000 blocks, once each) | 100,002 | 1,511 B | 2,258 B |

Both are above the 1 KiB per op aimed for. The largest shares are the per-call tuple (about 216 B),
the tuples of parent references (about 120 B), the op's pass-qualified label (about 65 B) and its site
key (about 42 B); metadata rows (shape, dtype, device) are shared between ops that have the same ones.
The feed-forward model adds a module record, a module call and per-module parameter names for every
four ops."""


def _load_suite() -> None:
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    for name in SUITE:
        __import__(name)


def render() -> str:
    _load_suite()
    from random_models import FAMILIES, FAULTS
    from reliability_cases import outcome, titles

    parts = [INTRO, PROPERTIES.format(families=", ".join(sorted(FAMILIES)), faults=", ".join(sorted(FAULTS)))]
    for area, blurb in AREAS.items():
        rows = [f"| {title} | {outcome(area, title)} |" for title in titles(area)]
        parts.append(f"## {area}\n\n{blurb}\n\n| scenario | outcome |\n|---|---|\n" + "\n".join(rows) + "\n")
    parts.append(LIMITS.format(scale=SCALE))
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description="write docs/reliability.md from the reliability suite")
    parser.add_argument("--check", action="store_true", help="only report whether the page is current")
    args = parser.parse_args()
    text = render()
    if args.check:
        with open(PAGE) as f:
            current = f.read() == text
        print("docs/reliability.md is current" if current else "docs/reliability.md is stale")
        sys.exit(0 if current else 1)
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(PAGE, ROOT)}")


if __name__ == "__main__":
    main()
