"""Call every function of torch's overridable registry under torchlens capture; publish what capture saw.

A *probe* is one real call of a registry function on small tensors, made while torchlens's capture mode
is active (set up exactly as ``tl.trace`` sets it up: the fast-path shim, then the mode).  Arguments are
built from the parameter names of ``torch.overrides.get_testing_overrides()`` signatures, trying a few
tensor shapes and dtypes in turn; the functions whose arguments cannot be guessed from names get a
recipe in ``probe_recipes.py``.  Each registry row ends in one of three states:

- ``seen``: a probe ran and capture recorded the call as an op (tensor result) or received it and let it
  through unrecorded (non-tensor result);
- ``not_probed``: no probe could be built or every attempt raised (CUDA-only, sparse, quantized, ...);
  the row keeps its inventory classification, unmeasured;
- ``not_seen``: a probe ran but capture neither recorded nor received the call.

Run ``python scripts/probe_coverage.py`` to rewrite the table in docs/interposition_surface.md;
``--json PATH`` also dumps per-row results.  tests/test_probe_coverage.py re-runs the probes and checks
the published counts are not regressed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import pathlib
import re
import sys
import types
import warnings

import torch

from torchlens.capture.fastpath import FastPathShim
from torchlens.capture.mode import CaptureMode
from torchlens.capture.source import FrameClassifier
from torchlens.capture.state import CaptureState

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from inventory import registry  # noqa: E402
from probe_recipes import RECIPES, SKIP  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS_PAGE = ROOT / "docs" / "interposition_surface.md"
TABLE_START, TABLE_END = "<!-- probe-table:start -->", "<!-- probe-table:end -->"


# ----- argument guessing ---------------------------------------------------------------------------
def _tensor(profile: str):
    """A fresh small tensor of one of the shapes/dtypes probes try."""
    g = torch.Generator().manual_seed(0)
    if profile == "matrix":  # square and well conditioned: linalg functions accept it
        return torch.randn(3, 3, generator=g) * 0.1 + torch.eye(3) * 2
    if profile == "vector":
        return torch.rand(3, generator=g) + 0.5
    if profile == "scalar":
        return torch.tensor(0.5)
    if profile == "batch":
        return torch.randn(2, 3, 3, generator=g) * 0.1 + torch.eye(3) * 2
    if profile == "image":
        return torch.rand(1, 2, 4, 4, generator=g) + 0.1
    if profile == "long":
        return torch.tensor([[0, 1, 2], [2, 1, 0], [1, 1, 1]])
    if profile == "long_vector":
        return torch.tensor([0, 1, 2])
    if profile == "bool":
        return torch.tensor([[True, False, True], [False, True, True], [True, True, False]])
    if profile == "complex":
        return torch.randn(3, 3, dtype=torch.complex64, generator=g)
    raise ValueError(profile)


PROFILES = ("matrix", "vector", "scalar", "batch", "image", "long", "long_vector", "bool", "complex")
TENSOR = object()  # placeholder: a tensor of the attempt's profile
TENSORS = object()  # placeholder: a list of two tensors of the attempt's profile

# Per parameter name, the values attempts cycle through (a tensor is the fallback for unknown names).
_CANDIDATES = {
    "dim": [0, 1], "dim0": [0], "dim1": [1], "axis": [0], "axis0": [0], "axis1": [1], "n": [2, 1],
    "k": [1], "p": [2.0, 0.5, 2], "chunks": [1], "split_size_or_sections": [1], "indices_or_sections": [1],
    "split_sizes": [[1, 2]], "split_size": [1], "sections": [1],
    "kernel_size": [1, 2], "stride": [1, (1, 1)], "padding": [0, (0, 0)], "dilation": [1, (1, 1)],
    "groups": [1], "output_size": [1, (1, 1)], "size": [(3, 3), 1, (3,)], "shape": [(3, 3), (9,)],
    "dims": [(0,), (1, 0), 1], "value": [1.0], "eps": [1e-5], "train": [False], "training": [False],
    "momentum": [0.1], "dtype": [torch.float64], "normalized_shape": [(3,)], "start": [0], "length": [1],
    "step": [1], "scale": [1.0], "zero_point": [0], "dimension": [0], "count": [1], "shifts": [1],
    "num_samples": [1], "maxnorm": [1.0], "min": [0.0], "max": [1.0], "destination": [0, (1, 0)],
    "source": [TENSOR, 1, (0, 1)], "align_corners": [False], "reduce": ["sum", "amax", "prod"],
    "equation": ["ij->ji", "i->i", "ijk->kji"], "pad": [(1, 1)], "size1": [3], "size2": [3],
    "quant_min": [0], "quant_max": [255], "norm_type": [2.0], "names": [None], "repeats": [2],
    "index": [TENSOR, 0], "indices": [TENSOR, (TENSOR,), 0], "q": [0.5, TENSOR], "tensors": [TENSORS],
    "exponent": [2, TENSOR], "diagonal": [0], "offset": [0], "ord": [2], "upscale_factor": [1],
    "downscale_factor": [1], "sizes": [(3, 3)], "storage_offset": [0], "shift": [1], "alpha": [1.0],
    "lambd": [0.5], "threshold": [0.5], "beta": [1.0],
}


def _resolve(value, profile: str):
    if value is TENSOR:
        return _tensor(profile)
    if value is TENSORS:
        return [_tensor(profile), _tensor(profile)]
    if isinstance(value, tuple) and value and value[0] is TENSOR:
        return tuple(_tensor(profile) for _ in value)
    return value


def guessed_calls(override):
    """(args, kwargs) candidates for ``override``'s required parameters: every tensor profile, crossed
    with a few alternative values for the parameters whose type the name does not settle."""
    try:
        params = [p for p in inspect.signature(override).parameters.values()
                  if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD]
    except (TypeError, ValueError):
        return
    options = [_CANDIDATES.get(p.name, [TENSOR]) for p in params]
    variants = max((len(o) for o in options), default=1)
    for variant in range(variants):
        for profile in PROFILES:
            args = []
            for p, choices in zip(params, options):
                value = _resolve(choices[min(variant, len(choices) - 1)], profile)
                if p.kind is p.VAR_POSITIONAL:
                    args.extend([3, 3] if p.name == "size" else [value, _resolve(TENSOR, profile)]
                                if isinstance(value, torch.Tensor) else [value])
                else:
                    args.append(value)
            yield args, {}


# ----- one probe -----------------------------------------------------------------------------------
class _WitnessMode(CaptureMode):
    """The capture mode, also noting every function its handler receives."""

    def __init__(self, *a):
        super().__init__(*a)
        self.received = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.received.append(func)
        return super().__torch_function__(func, types, args, kwargs)


def _has_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_tensor(v) for v in value)
    return False


def run_under_capture(func, args, kwargs):
    """Call ``func`` once under a fresh capture; returns (result, raw calls, received functions)."""
    state = CaptureState(save_mode=0)
    mode = _WitnessMode(state, FrameClassifier())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FastPathShim(mode), mode:
            result = func(*args, **kwargs)
    return result, state.calls, mode.received


def _name_of(func) -> str:
    for name, candidate in registry().items():
        if candidate == func:
            return name
    return getattr(func, "__qualname__", repr(func))


def probe(name: str, func, override) -> dict:
    """Probe one registry row; returns ``{"status", "kind", "inplace", "multi_output", "error"}``."""
    if name in SKIP:
        return {"status": "not_probed", "error": SKIP[name]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # building quantized/sparse inputs warns; the probe is what matters
        attempts = [RECIPES[name]()] if name in RECIPES else list(guessed_calls(override) or ())
    error = "no probe could be built from the testing-override signature"
    for args, kwargs in attempts:
        torch.manual_seed(0)
        try:
            result, calls, received = run_under_capture(func, args, kwargs)
        except Exception as exc:  # the guess was wrong for this function: try the next one
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            continue
        mine = [c for c in calls if c[0] == func]
        if mine:
            return {"status": "seen", "kind": "op", "inplace": int(any(c[12] for c in mine)),
                    "multi_output": int(any(c[11] > 1 for c in mine)), "seen_as": "", "error": ""}
        if any(f == func for f in received):  # received and deliberately let through unrecorded
            return {"status": "seen", "kind": "not_op", "inplace": 0, "multi_output": 0, "seen_as": "",
                    "passthrough_tensor": int(_has_tensor(result)), "error": ""}
        distinct = {f for f in received}
        if len(distinct) == 1 and not isinstance(func, types.FunctionType):
            # A C-level alias torch respelled on the way in (``__add__`` arrives as ``add``); a Python
            # function reaching capture only through its interior calls is *not* seen.
            other = distinct.pop()
            recorded = [c for c in calls if c[0] == other]
            return {"status": "seen", "kind": "op" if recorded else "not_op",
                    "inplace": int(any(c[12] for c in recorded)),
                    "multi_output": int(any(c[11] > 1 for c in recorded)),
                    "seen_as": _name_of(other), "error": ""}
        return {"status": "not_seen", "error": f"capture received {len(received)} other call(s) but not this one"}
    return {"status": "not_probed", "error": error}


def probe_all(names=None) -> dict:
    """name -> probe result, for every registry row (or just ``names``)."""
    overrides = torch.overrides.get_testing_overrides()
    rows = registry()
    results = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: threads only add noise on a shared machine
    try:
        for name in names or rows:
            results[name] = probe(name, rows[name], overrides.get(rows[name]))
    finally:
        torch.set_num_threads(threads)
    return results


# ----- the published table -------------------------------------------------------------------------
def counts(results: dict) -> dict:
    tally = {"seen": 0, "not_probed": 0, "not_seen": 0}
    for r in results.values():
        tally[r["status"]] += 1
    tally["total"] = len(results)
    return tally


def render_table(results: dict) -> str:
    tally = counts(results)
    total = tally["total"]

    def pct(n):
        return f"{100 * n / total:.1f}%"

    def listing(status):
        return [f"- `{name}`: {r['error'].replace('`', chr(39)).replace('|', '/')}"
                for name, r in sorted(results.items()) if r["status"] == status]

    return "\n".join([
        TABLE_START,
        f"Generated by `python scripts/probe_coverage.py` on torch {torch.__version__.split('+')[0]} "
        f"({'CUDA' if torch.cuda.is_available() else 'CPU-only'} build).",
        "",
        "| Registry rows | Count | Share |",
        "|---|---:|---:|",
        f"| (a) seen by an executed probe | {tally['seen']} | {pct(tally['seen'])} |",
        f"| (b) classified but not probed | {tally['not_probed']} | {pct(tally['not_probed'])} |",
        f"| (c) probed and not seen | {tally['not_seen']} | {pct(tally['not_seen'])} |",
        f"| total | {total} | 100% |",
        "",
        "Rows in (c), probed and not seen:",
        "",
        *listing("not_seen"),
        "",
        "Rows in (b), with the error of the last probe attempt:",
        "",
        *listing("not_probed"),
        TABLE_END,
    ])


def published_counts(page=DOCS_PAGE) -> dict:
    """The counts currently printed in the docs table."""
    text = pathlib.Path(page).read_text()
    found = {}
    for key, label in (("seen", "(a)"), ("not_probed", "(b)"), ("not_seen", "(c)")):
        match = re.search(re.escape(label) + r"[^|]*\| (\d+) \|", text)
        found[key] = int(match.group(1))
    found["total"] = int(re.search(r"\| total \| (\d+) \|", text).group(1))
    return found


def write_table(results: dict, page=DOCS_PAGE) -> None:
    text = pathlib.Path(page).read_text()
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    pathlib.Path(page).write_text(text[:start] + render_table(results) + text[end:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write per-row results here")
    parser.add_argument("--no-write", action="store_true", help="print the table without editing the docs")
    opts = parser.parse_args(argv)
    results = probe_all()
    print(render_table(results))
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    if not opts.no_write:
        write_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
