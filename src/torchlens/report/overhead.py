"""Paired-ratio overhead measurement: two arms, alternating order, a predicate fixed before the run.

A single "Nx slower" figure is easy to get wrong: the first arm of every round runs on colder caches,
machine load drifts between rounds, and an instrumented arm may quietly run different work (a lost
fused fast path, a second forward).  ``measure_overhead`` guards against each:

* the arms alternate A-B / B-A (or in seeded random order) after a warm-up, and every pair gives one
  ratio, so drift that hits both arms of a pair cancels; within a pair each arm keeps its fastest of a
  few interleaved blocks, so a burst of load from other processes does not decide a pair;
* the refusal predicate (minimum pairs, maximum dispersion of the paired ratios, agreeing witnesses)
  is an argument, so it is declared before any number exists;
* two execution-scope witnesses: the arms' outputs must be equal in every pair, and both arms must
  make the same number of ``nn.Module`` calls (counted on untimed witness calls);
* when the predicate fails there is no point estimate, only a one-sided lower confidence bound on the
  ratio (the floor) and the reasons; a witness mismatch voids the floor too.

Confidence bounds are distribution-free order statistics of the paired ratios (the binomial
sign-test interval for a median), so no normality is assumed.  Besides torch and the standard library it
imports only package modules that need nothing else (``checks``, and ``tree`` with its ``errors``), so a
benchmark worker in another environment can load it from a checkout without importing ``torchlens``
(``benchmarks/overhead_matrix.py``).
"""

from __future__ import annotations

import math
import os
import platform
import random
import statistics
import threading
from dataclasses import asdict, dataclass, field
from time import perf_counter_ns

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from ..checks import check_int, check_number
from ..tree import outputs_equal, tensor_leaves

__all__ = ["measure_overhead", "RefusalPredicate", "OverheadResult", "machine_fingerprint"]


@dataclass(frozen=True)
class RefusalPredicate:
    """When a measurement may publish a point estimate.  Fixed before the run; recorded in the result.

    Args:
        min_pairs: fewest admissible pairs for a point estimate.
        max_relative_iqr: largest (Q3 - Q1) / median of the paired ratios.
        min_ratio: if set, a confidence interval wholly below it is physically impossible (an additive
            instrument cannot make the program faster) and refuses the measurement.
        confidence: level of the two-sided interval; the floor is one-sided at the same level.
    """

    min_pairs: int = 10
    max_relative_iqr: float = 0.25
    min_ratio: float | None = None
    confidence: float = 0.95

    def __post_init__(self):
        check_number(self.confidence, "confidence", "give a level between 0.5 and 1 (0.95)", who="RefusalPredicate")
        if not 0.5 < self.confidence < 1.0:
            raise ValueError(f"confidence must lie in (0.5, 1), got {self.confidence}")
        check_int(self.min_pairs, "min_pairs", "give the fewest pairs a point estimate needs, 1 or more (10)",
                  who="RefusalPredicate", at_least=1)
        # NaN compares false with every spread: a NaN bound would refuse nothing.
        check_number(self.max_relative_iqr, "max_relative_iqr", "give the largest spread of the ratios, above 0 "
                     "(0.25)", who="RefusalPredicate")
        if self.max_relative_iqr <= 0:
            raise ValueError(f"max_relative_iqr must be > 0, got {self.max_relative_iqr}")
        if self.min_ratio is not None:
            check_number(self.min_ratio, "min_ratio", "give the ratio no measurement can fall below, or None",
                         who="RefusalPredicate")

    def describe(self) -> str:
        """The predicate in one line, as a result prints it (``pairs>=10, relIQR<=0.25, ...``)."""
        parts = [f"pairs>={self.min_pairs}", f"relIQR<={self.max_relative_iqr:g}"]
        if self.min_ratio is not None:
            parts.append(f"CI not below {self.min_ratio:g}")
        parts.append("outputs equal, module calls equal")
        return ", ".join(parts)


@dataclass
class OverheadResult:
    """Outcome of one paired measurement; ``str()`` is one readable line."""

    label_a: str
    label_b: str
    admitted: bool
    reasons: tuple
    ratio: float | None          # median of per-pair (B / A) per-call time; None when refused
    ci: tuple | None             # two-sided interval on that median; None when refused
    floor: float | None          # one-sided lower bound on the median ratio; None if a witness failed
                                 # or there are too few pairs for any bound at this confidence
    delta_ns: float | None       # median per-pair (B - A) per-call time, ns; None when refused
    delta_floor_ns: float | None  # one-sided lower bound on that difference
    pairs: int
    ratios: list
    a_ns: float                  # median per-call time of each arm, ns (absolute scale, for disclosure)
    b_ns: float
    calls_per_sample: tuple      # how many arm calls each timed sample made (A, B)
    module_calls: tuple          # nn.Module calls per arm call, from the witness calls (A, B)
    outputs_equal: int           # pairs whose outputs agreed
    predicate: RefusalPredicate
    order: str
    warmup: int
    repeats: int
    fingerprint: dict = field(default_factory=dict)

    @property
    def relative_iqr(self) -> float | None:
        """The spread of the paired ratios, (Q3 - Q1) / median, that the predicate bounds (None below 4 pairs)."""
        return _relative_iqr(self.ratios)

    def to_dict(self) -> dict:
        """Every field as plain data, with the predicate's, the clock and a schema name (for a JSON file)."""
        out = asdict(self)
        out["predicate"] = asdict(self.predicate)
        out["relative_iqr"] = self.relative_iqr
        out["clock"] = "time.perf_counter_ns"
        out["schema"] = "torchlens.overhead_measurement.v1"
        return out

    def cell(self, digits: int = 2) -> str:
        """Compact form for a table: ``3.41x [3.30, 3.52]``, ``>= 2.90x (refused)`` or ``refused``."""
        if self.admitted:
            lo, hi = self.ci
            return f"{self.ratio:.{digits}f}x [{lo:.{digits}f}, {hi:.{digits}f}]"
        if self.floor is not None:
            return f">= {self.floor:.{digits}f}x (refused)"
        return "refused (witness)"

    def __str__(self) -> str:
        level = f"{self.predicate.confidence:.0%}"
        head = f"{self.label_b} / {self.label_a}: "
        if self.admitted:
            lo, hi = self.ci
            head += f"{self.ratio:.3g}x [{lo:.3g}, {hi:.3g}] {level} CI"
        else:
            floor = f"floor >= {self.floor:.3g}x ({level} one-sided)" if self.floor is not None else "no floor"
            head += f"REFUSED ({'; '.join(self.reasons)}); {floor}"
        fp = self.fingerprint
        return (f"{head}, {self.pairs} pairs, {self.order}, per call A {self.a_ns / 1e3:.4g} us / "
                f"B {self.b_ns / 1e3:.4g} us | predicate: {self.predicate.describe()} -> "
                f"{'admitted' if self.admitted else 'refused'} | torch {fp.get('torch')}, "
                f"{fp.get('threads')} threads, {fp.get('device')}")


def measure_overhead(arm_a, arm_b, *, pairs: int = 21, warmup: int = 3,
                     predicate: RefusalPredicate | None = None, order: str = "abba", seed: int = 0,
                     compare=None, repeats: int = 3, min_sample_s: float = 1e-3,
                     max_calls_per_sample: int = 200, device=None) -> OverheadResult:
    """Time ``arm_b`` against ``arm_a`` in alternating pairs and return an ``OverheadResult``.

    Args:
        arm_a: the baseline: a zero-argument callable returning its output, or ``(label, callable)``.
        arm_b: the instrumented arm, same form.  The ratio is B / A.
        pairs: timed pairs to run.
        warmup: untimed calls of each arm first (alternating); they also count module calls.
        predicate: the ``RefusalPredicate``; defaults to ``RefusalPredicate()``.
        order: ``"abba"`` (A-B then B-A) or ``"random"`` (seeded coin per pair).
        compare: ``f(out_a, out_b) -> bool``; defaults to exact equality (``tree.outputs_equal``).
        repeats: each arm's sample in a pair is the fastest of this many interleaved blocks, so that
            a pair hit by preemption on a shared machine still yields a usable ratio.
        min_sample_s: each block calls a fast arm repeatedly until it lasts about this long.
        max_calls_per_sample: cap on those calls per block.
        device: synchronize CUDA around every sample when this (or an arm's output) is on CUDA.
    """
    label_a, fn_a = _arm(arm_a, "a")
    label_b, fn_b = _arm(arm_b, "b")
    predicate = predicate if predicate is not None else RefusalPredicate()
    if not isinstance(predicate, RefusalPredicate):  # read only after every pair is timed
        raise TypeError(f"measure_overhead: predicate= takes a RefusalPredicate (RefusalPredicate(min_pairs=10)), got "
                        f"{type(predicate).__name__}")
    if compare is not None and not callable(compare):
        raise TypeError(f"measure_overhead: compare= takes a function f(output_a, output_b) -> bool, got "
                        f"{type(compare).__name__}")
    _check_counts(pairs=pairs, warmup=warmup, repeats=repeats, max_calls_per_sample=max_calls_per_sample)
    check_number(min_sample_s, "min_sample_s", "give the seconds a block of calls lasts at least, 0 or more (0.001)",
                 who="measure_overhead", at_least=0, finite=True)
    if order not in ("abba", "random"):
        raise ValueError(f"order must be 'abba' or 'random', got {order!r}")
    _check_device(device)
    compare = compare or outputs_equal

    # Warm-up doubles as the module-call witness and the calibration of calls per sample.
    counts_a, counts_b, first_a, first_b = [], [], [], []
    for i in range(warmup):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            fn, counts, firsts = (fn_a, counts_a, first_a) if which == 0 else (fn_b, counts_b, first_b)
            calls, elapsed, out = _witness_call(fn)
            counts.append(calls)
            firsts.append(elapsed)
    sync = _needs_sync(device, out)
    number_a = _calls_for(min(first_a), min_sample_s, max_calls_per_sample)
    number_b = _calls_for(min(first_b), min_sample_s, max_calls_per_sample)

    rng = random.Random(seed)
    times_a, times_b, equal = [], [], 0
    for i in range(pairs):
        a_first = (i % 2 == 0) if order == "abba" else rng.random() < 0.5
        t_a, out_a, t_b, out_b = _timed_pair(fn_a, number_a, fn_b, number_b, a_first, repeats, sync)
        if compare(out_a, out_b):
            equal += 1
            times_a.append(t_a)
            times_b.append(t_b)
        del out_a, out_b

    # One more witness call each after the timed run: the scope must not have changed meanwhile.
    counts_a.append(_witness_call(fn_a)[0])
    counts_b.append(_witness_call(fn_b)[0])
    return _judge(label_a, label_b, predicate, times_a, times_b, equal, pairs, counts_a, counts_b,
                  (number_a, number_b), order, warmup, repeats, sync)


def _judge(label_a, label_b, predicate, times_a, times_b, equal, pairs, counts_a, counts_b, numbers,
           order, warmup, repeats, sync) -> OverheadResult:
    ratios = [b / a for a, b in zip(times_a, times_b)]
    deltas = [b - a for a, b in zip(times_a, times_b)]
    reasons = []
    witness_ok = True
    if equal < pairs:
        reasons.append(f"outputs differ in {pairs - equal} of {pairs} pairs")
        witness_ok = False
    if len(set(counts_a)) != 1 or len(set(counts_b)) != 1 or counts_a[0] != counts_b[0]:
        reasons.append(f"module calls differ (A {sorted(set(counts_a))}, B {sorted(set(counts_b))})")
        witness_ok = False
    n = len(ratios)
    if n < predicate.min_pairs and equal == pairs:
        reasons.append(f"{n} pairs < {predicate.min_pairs}")
    alpha = 1.0 - predicate.confidence
    ci = _median_interval(ratios, alpha / 2) if n else None
    rel_iqr = _relative_iqr(ratios)
    if rel_iqr is not None and rel_iqr > predicate.max_relative_iqr:
        reasons.append(f"relIQR {rel_iqr:.2f} > {predicate.max_relative_iqr:g}")
    if ci is None and n >= predicate.min_pairs:
        reasons.append(f"too few pairs for a {predicate.confidence:.0%} interval")
    if predicate.min_ratio is not None and ci is not None and ci[1] < predicate.min_ratio:
        reasons.append(f"CI below {predicate.min_ratio:g}: physically impossible, check the arms")
    admitted = not reasons
    floor = _lower_bound(ratios, alpha) if witness_ok else None
    delta_floor = _lower_bound(deltas, alpha) if witness_ok else None
    return OverheadResult(
        label_a=label_a, label_b=label_b, admitted=admitted, reasons=tuple(reasons),
        ratio=statistics.median(ratios) if admitted else None, ci=ci if admitted else None, floor=floor,
        delta_ns=statistics.median(deltas) if admitted else None, delta_floor_ns=delta_floor, pairs=n,
        ratios=ratios, a_ns=statistics.median(times_a) if times_a else math.nan,
        b_ns=statistics.median(times_b) if times_b else math.nan, calls_per_sample=numbers,
        module_calls=(counts_a[0], counts_b[0]), outputs_equal=equal, predicate=predicate, order=order,
        warmup=warmup, repeats=repeats, fingerprint=machine_fingerprint(cuda=sync))


def _check_counts(**counts) -> None:
    """Each count is an int, 1 or more: pairs=2.5 failed in range(), pairs=True made one pair."""
    for name, value in counts.items():
        check_int(value, name, "give a count of 1 or more", who="measure_overhead", at_least=1)


def _arm(arm, default: str):
    if isinstance(arm, tuple) and len(arm) == 2 and callable(arm[1]):
        return str(arm[0]), arm[1]
    if callable(arm):
        return getattr(arm, "__name__", default), arm
    raise TypeError(f"an arm is a zero-argument callable or a (label, callable) pair, got {type(arm).__name__}")


def _calls_for(per_call_ns: int, min_sample_s: float, cap: int) -> int:
    return max(1, min(cap, math.ceil(min_sample_s * 1e9 / max(per_call_ns, 1))))


def _timed_pair(fn_a, number_a: int, fn_b, number_b: int, a_first: bool, repeats: int, sync: bool):
    """Per-call ns of each arm, the fastest of ``repeats`` blocks, and each arm's last output.

    The blocks interleave (A B B A A B ... when A goes first), so a burst of load on a shared machine
    hits both arms of the pair alike, and taking each arm's fastest block drops preempted blocks."""
    best = [math.inf, math.inf]
    outs = [None, None]
    arms = ((0, fn_a, number_a), (1, fn_b, number_b))
    for r in range(repeats):
        for which, fn, number in (arms if a_first == (r % 2 == 0) else arms[::-1]):
            if sync:
                torch.cuda.synchronize()
            start = perf_counter_ns()
            for _ in range(number):
                out = fn()
            if sync:
                torch.cuda.synchronize()
            best[which] = min(best[which], (perf_counter_ns() - start) / number)
            outs[which] = out
            del out
    return best[0], outs[0], best[1], outs[1]


class _ModuleCallCounter:
    """Counts ``nn.Module`` calls made by this thread while active (a global forward pre-hook)."""

    def __init__(self):
        self.count = 0
        self._owner = threading.get_ident()
        self._handle = None

    def _hook(self, module, args):
        if threading.get_ident() == self._owner:
            self.count += 1

    def __enter__(self):
        self._handle = register_module_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()
        return False


def _witness_call(fn):
    """One untimed-for-the-result call: (module calls made, elapsed ns, output)."""
    with _ModuleCallCounter() as counter:
        start = perf_counter_ns()
        out = fn()
        elapsed = perf_counter_ns() - start
    return counter.count, elapsed, out


def _check_device(device) -> None:
    """A ``device=`` torch can read, before any arm runs: it is read only where CUDA is available, so a slip
    (``"gpu"``) would pass unseen on a CPU machine and fail after the warm-up on a GPU one."""
    advice = "give one such as 'cuda' or 'cpu', or None to sync when an arm's output is on CUDA"
    if device is None or isinstance(device, torch.device) or type(device) is int:  # an int: a CUDA index
        return
    if not isinstance(device, str):
        raise TypeError(f"measure_overhead: device={device!r} is a {type(device).__name__}; {advice}")
    try:
        torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"measure_overhead: device={device!r} is not a torch device ({str(exc).splitlines()[0]}); "
                         f"{advice}") from None


def _needs_sync(device, out) -> bool:
    if not torch.cuda.is_available():
        return False
    if device is not None:
        return torch.device(device).type == "cuda"
    return any(t.is_cuda for _, t in tensor_leaves(out))


def _quantile(sorted_values: list, q: float) -> float:
    position = q * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def _relative_iqr(ratios: list) -> float | None:
    if len(ratios) < 4:
        return None
    s = sorted(ratios)
    median = _quantile(s, 0.5)
    return (_quantile(s, 0.75) - _quantile(s, 0.25)) / median if median else None


def _order_rank(n: int, alpha: float) -> int:
    """Largest k with P(Binomial(n, 1/2) <= k - 1) <= alpha; 0 when no k qualifies."""
    k, tail = 0, 0.0
    while k < n:
        tail_next = tail + math.comb(n, k) / 2.0 ** n  # P(B <= k)
        if tail_next > alpha:
            break
        tail = tail_next
        k += 1
    return k


def _lower_bound(values: list, alpha: float) -> float | None:
    """One-sided (1 - alpha) lower confidence bound on the median: the k-th order statistic."""
    k = _order_rank(len(values), alpha)
    return sorted(values)[k - 1] if k >= 1 else None


def _median_interval(values: list, alpha_each_side: float) -> tuple | None:
    k = _order_rank(len(values), alpha_each_side)
    if k < 1:
        return None
    s = sorted(values)
    return s[k - 1], s[len(s) - k]


def machine_fingerprint(cuda: bool = False) -> dict:
    """What a figure depends on: torch version, threads, device, CPU count, host load (recorded, never
    used as a threshold)."""
    if cuda:
        device = f"cuda ({torch.cuda.get_device_name()})"
    else:
        device = f"cpu ({platform.machine()})"
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": device,
            "cpus": os.cpu_count(), "python": platform.python_version(), "load_1_5_15": _host_load()}


def _host_load() -> tuple | None:
    """The 1, 5 and 15 minute load averages; None where the system keeps none (Windows has no
    ``os.getloadavg``) or will not say."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except (AttributeError, OSError):
        return None
