"""How far can ``tl.validate`` be trusted on real models?  Count its false alarms and false passes.

Runs every entry of the real-model corpus (tests/real_models.py) in every mode and prints, per model and
mode:

- ``same``: the traced output equals an untraced run bit for bit, and the trace drew exactly as much from
  the RNG as the untraced run (both seeded alike); ``draws``: whether the forward draws from the RNG;
- ``replayed``, ``skipped`` (not replayed, of which ``random`` gave randomness as the reason) and
  ``mismatch`` from ``tl.validate``.  The trace is faithful whenever ``same`` holds, so every mismatch,
  and an "outputs differ" verdict, is a false alarm.  A forward that draws nothing has no random op,
  and one that draws has at least one: ops listed as random otherwise are counted as wrongly random.
  Validate must leave the RNG where one untraced forward would;
- ``false passes``, out of the checks a faithful validator must fail: ``save="none"`` and
  ``cleanup()`` traces (nothing to check: "passed" is vacuous), ``PLANTS`` saved activations replaced by
  wrong values (validate must name each planted op's call), and a forward that computes something else when
  run under capture (validate's traced run must differ from its untraced reference).

A crash in trace or validate is printed in place of the row.  Totals follow.

Run:  HF_HUB_OFFLINE=1 PYTHONPATH=src python scripts/validate_corpus.py [names...] [--modes eval,train]
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import real_models  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens.tree import structures_equal, tensor_leaves  # noqa: E402

SEED = 1234
PLANTS = 3  # wrong activations planted per model and mode, one trace each


def untraced(model, args, kwargs):
    """The output of a plain run and the RNG state it leaves, from ``SEED``."""
    real_models.seed(SEED)
    out = model(*args, **kwargs)
    return out, torch.get_rng_state()


def traced(model, args, kwargs, **trace_kwargs):
    real_models.seed(SEED)
    log = tl.trace(model, args, kwargs, **trace_kwargs)
    return log, torch.get_rng_state()


def faithful(model, args, kwargs) -> tuple:
    """``(same, why, draws)``: traced output and RNG consumption equal an untraced run's; whether the
    forward draws from the RNG at all."""
    real_models.seed(SEED)
    start = torch.get_rng_state()
    expected, rng_expected = untraced(model, args, kwargs)
    log, rng_traced = traced(model, args, kwargs)
    same, why = structures_equal(log.output, expected)
    if same and not torch.equal(rng_expected, rng_traced):
        same, why = False, "the trace drew a different amount from the RNG"
    return same, why, not torch.equal(start, rng_expected)


def is_random(reason: str) -> bool:
    return "random" in reason.lower()


def vacuous_passes(model, args, kwargs) -> int:
    """Validations of traces with nothing to check that still say "passed"."""
    count = 0
    log, _ = traced(model, args, kwargs, save="none")
    count += bool(log.validate().passed)
    log, _ = traced(model, args, kwargs)
    log.cleanup()
    count += bool(log.validate().passed)
    return count


def plant_candidates(log, result) -> list:
    """Ops validate replayed exactly whose saved output is a float tensor that adding one changes (float32's
    lowest, a mask's fill value, is itself plus one: planted there, validate rightly passes)."""
    named = {label for label, _ in result.mismatched} | {label for label, _ in result.not_replayed}
    # A call is reported under its first output: every output of a call that was not checked is skipped.
    skipped = set().union(*(same_call_labels(log, op) for op in log.ops if op.label in named))
    out = []
    for op in log.ops:
        if op.kind != "op" or op.label in skipped or not op.has_activation:
            continue
        value = op.activation
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() == 0:
            continue
        if torch.equal(value + 1.0, value):
            continue
        out.append(op)
    return out


def planted_misses(model, args, kwargs, plants: int) -> tuple:
    """``(planted, missed)``: saved activations replaced by a wrong value that validate did not name."""
    log, _ = traced(model, args, kwargs)
    candidates = plant_candidates(log, log.validate())
    if not candidates:
        return 0, 0
    step = max(1, len(candidates) // plants)
    chosen = [op.label for op in candidates[::step][:plants]]
    missed = 0
    for label in chosen:
        log, _ = traced(model, args, kwargs)
        op = next(op for op in log.ops if op.label == label)
        # Replace the record's value (not the tensor in place: the model's output may share it).
        log._activations[op.index] = op.activation + 1.0
        result = log.validate()
        missed += not (same_call_labels(log, op) & {name for name, _ in result.mismatched})
    return len(chosen), missed


def same_call_labels(log, op) -> set:
    """Labels of every output of ``op``'s call: a mismatch in any output of a multi-output op (the
    second tensor ``nn.LSTM`` returns) is reported under the call's first output."""
    call = log._call[op.index]
    return {other.label for other in log.ops if other.kind == "op" and log._call[other.index] == call}


class TracedRunDiffers(torch.nn.Module):
    """Computes something else while it is being traced: an unfaithful trace that validate's comparison
    of the traced output with its untraced reference must catch."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        if not torch._C._is_torch_function_mode_enabled():
            return out
        with torch.no_grad():
            floats = [t for _, t in tensor_leaves(out) if t.is_floating_point() and t.numel()]
            if floats:
                floats[-1].add_(1.0)
        return out


def wrong_output_missed(model, args, kwargs) -> int:
    real_models.seed(SEED)
    result = tl.validate(TracedRunDiffers(model), args, kwargs)
    return int(result.outputs_match is not False)


def row(name, mode, plants):
    model, args, kwargs = real_models.build(name)
    with real_models.in_mode(model, mode):
        same, why, draws = faithful(model, args, kwargs)
        real_models.seed(SEED)
        result = tl.validate(model, args, kwargs)
        rng_kept = torch.equal(torch.get_rng_state(), untraced(model, args, kwargs)[1])
        random = sum(is_random(reason) for _, reason in result.not_replayed)
        alarms = len(result.mismatched) + (same and result.outputs_match is False)
        # A forward that draws nothing has no random op; one that draws has at least one.
        wrong_random = random if not draws else int(random == 0)
        vacuous = vacuous_passes(model, args, kwargs)
        planted, missed = planted_misses(model, args, kwargs, plants)
        wrong_out = wrong_output_missed(model, args, kwargs)
    return {"model": name, "mode": mode, "same": same, "why": why, "draws": draws, "rng_kept": rng_kept,
            "wrong_random": wrong_random, "replayed": result.replayed,
            "skipped": len(result.not_replayed), "random": random, "alarms": alarms,
            "mismatched": result.mismatched, "vacuous": vacuous, "planted": planted, "missed": missed,
            "wrong_out": wrong_out, "false_passes": vacuous + missed + wrong_out, "checks": 2 + planted + 1}


HEADER = (f"{'model':<28}{'mode':<14}{'same':<6}{'draws':<6}{'replayed':>9}{'skipped':>8}{'random':>7}"
          f"{'mismatch':>9}{'false passes':>16}")


def print_row(r) -> None:
    print(f"{r['model']:<28}{r['mode']:<14}{'yes' if r['same'] else 'NO':<6}{'yes' if r['draws'] else 'no':<6}"
          f"{r['replayed']:>9}{r['skipped']:>8}{r['random']:>7}{r['alarms']:>9}"
          f"{r['false_passes']:>10} of {r['checks']:<3}", flush=True)
    if not r["same"]:
        print(f"    not faithful: {r['why']}")
    if r["wrong_random"] and r["draws"]:
        print("    the forward draws from the RNG, but no op is listed as random")
    elif r["wrong_random"]:
        print(f"    {r['random']} ops listed as random, but the forward draws nothing from the RNG")
    if not r["rng_kept"]:
        print("    validate left the RNG elsewhere than one untraced forward would")
    for label, reason in r["mismatched"]:
        print(f"    MISMATCH {label}: {reason}")
    detail = []
    if r["vacuous"]:
        detail.append(f"{r['vacuous']} of 2 vacuous (save='none', cleanup) passed")
    if r["missed"]:
        detail.append(f"{r['missed']} of {r['planted']} planted wrong activations not named")
    if r["wrong_out"]:
        detail.append("a changed output was not noticed")
    if detail:
        print(f"    false passes: {'; '.join(detail)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="corpus entries (default: all)")
    parser.add_argument("--modes", default=",".join(real_models.MODES))
    parser.add_argument("--plants", type=int, default=PLANTS)
    opts = parser.parse_args(argv)
    names = opts.names or list(real_models.CORPUS)
    modes = opts.modes.split(",")
    warnings.simplefilter("ignore")
    rows, crashes = [], []
    print(HEADER)
    for name in names:
        for mode in modes:
            try:
                r = row(name, mode, opts.plants)
            except Exception as exc:  # noqa: BLE001 - a crash is a result to report, not to stop on
                where = traceback.extract_tb(exc.__traceback__)[-1]
                crashes.append((name, mode))
                print(f"{name:<28}{mode:<14}CRASH {type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
                      f"\n    at {os.path.relpath(where.filename, ROOT)}:{where.lineno}", flush=True)
                continue
            rows.append(r)
            print_row(r)
    print()
    print(f"runs: {len(rows) + len(crashes)} ({len(names)} models x {len(modes)} modes), crashed: {len(crashes)}")
    print(f"traced == untraced: {sum(r['same'] for r in rows)} of {len(rows)}")
    print(f"ops replayed: {sum(r['replayed'] for r in rows)}, not replayed: {sum(r['skipped'] for r in rows)} "
          f"(random: {sum(r['random'] for r in rows)})")
    print(f"false alarms (mismatches on faithful traces): {sum(r['alarms'] for r in rows)} "
          f"in {sum(bool(r['alarms']) for r in rows)} runs")
    print(f"ops wrongly listed as random (or random ops missed): {sum(r['wrong_random'] for r in rows)} "
          f"in {sum(bool(r['wrong_random']) for r in rows)} runs")
    print(f"runs after which validate left the RNG elsewhere than one forward: "
          f"{sum(not r['rng_kept'] for r in rows)}")
    print(f"false passes: {sum(r['false_passes'] for r in rows)} of {sum(r['checks'] for r in rows)} checks "
          f"(vacuous: {sum(r['vacuous'] for r in rows)}, planted activations missed: "
          f"{sum(r['missed'] for r in rows)} of {sum(r['planted'] for r in rows)}, changed outputs missed: "
          f"{sum(r['wrong_out'] for r in rows)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
