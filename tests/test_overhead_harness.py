"""The paired-ratio harness on synthetic arms of known relative cost.

Arms are sleep-free busy loops, so their cost ratio is set by iteration counts.  Nothing here times
torchlens itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn as nn

from torchlens.report.overhead import (OverheadResult, RefusalPredicate, _lower_bound, _median_interval, _order_rank,
                                       measure_overhead)
from torchlens.tree import outputs_equal


def busy(iterations: int, result=1):
    def arm():
        total = 0
        for i in range(iterations):
            total += i
        return result
    return arm


LOOSE = RefusalPredicate(min_pairs=9, max_relative_iqr=0.5)


def test_ratio_of_n_and_2n_loops_is_near_two():
    result = measure_overhead(("N", busy(20_000)), ("2N", busy(40_000)), pairs=11, repeats=5,
                              predicate=LOOSE)
    assert result.admitted, str(result)
    assert 1.6 <= result.ratio <= 2.5, str(result)
    lo, hi = result.ci
    assert lo <= result.ratio <= hi
    assert result.floor is not None and result.floor <= result.ratio
    assert result.delta_ns > 0 and result.b_ns > result.a_ns
    assert result.pairs == 11 and len(result.ratios) == 11
    assert result.outputs_equal == 11 and result.module_calls == (0, 0)


def test_swapped_arms_give_the_reciprocal_ratio():
    result = measure_overhead(("2N", busy(40_000)), ("N", busy(20_000)), pairs=11, repeats=5, predicate=LOOSE)
    assert result.admitted, str(result)
    assert 0.4 <= result.ratio <= 0.625, str(result)


def test_noisy_arm_is_refused_with_a_floor():
    # Arm B costs 1x or 8x arm A at random (seeded): the paired ratios spread far beyond the bound.
    rng = itertools.cycle([1, 8, 1, 8, 8, 1, 1, 8, 1, 8, 8, 1, 8])
    heavy = busy(5_000)

    def noisy():
        for _ in range(next(rng)):
            heavy()
        return 1

    result = measure_overhead(("steady", busy(5_000)), ("noisy", noisy), pairs=13, repeats=1,
                              min_sample_s=0, predicate=RefusalPredicate(min_pairs=9, max_relative_iqr=0.25))
    assert not result.admitted
    assert result.ratio is None and result.ci is None and result.delta_ns is None
    assert any("relIQR" in reason for reason in result.reasons), result.reasons
    assert result.floor is not None and 0.5 < result.floor < 8
    assert "REFUSED" in str(result) and "floor >=" in str(result)
    assert result.cell().endswith("(refused)")


def test_arms_returning_different_outputs_are_refused_without_a_floor():
    result = measure_overhead(("a", busy(1_000, torch.ones(3))), ("b", busy(1_000, torch.zeros(3))), pairs=9)
    assert not result.admitted
    assert result.floor is None and result.ratio is None
    assert result.outputs_equal == 0
    assert any("outputs differ" in reason for reason in result.reasons)
    assert "no floor" in str(result)


def test_arms_making_different_module_calls_are_refused():
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def once():
        return layer(x).detach()

    def twice():
        layer(x)  # a second forward: same output, different execution scope
        return layer(x).detach()

    with torch.no_grad():
        result = measure_overhead(("once", once), ("twice", twice), pairs=9)
    assert not result.admitted and result.floor is None
    assert result.module_calls == (1, 2)
    assert any("module calls differ" in reason for reason in result.reasons)


def test_module_call_witness_is_removed_afterwards():
    from torch.nn.modules import module as module_mod

    before = dict(module_mod._global_forward_pre_hooks)
    layer = nn.Linear(2, 2)
    measure_overhead(lambda: layer(torch.ones(1, 2)).detach(), lambda: layer(torch.ones(1, 2)).detach(), pairs=3)
    assert dict(module_mod._global_forward_pre_hooks) == before


def test_too_few_pairs_are_refused_by_the_declared_predicate():
    result = measure_overhead(busy(2_000), busy(2_000), pairs=5, predicate=RefusalPredicate(min_pairs=10))
    assert not result.admitted
    assert any("5 pairs < 10" in reason for reason in result.reasons)


def test_physically_impossible_ratio_is_refused():
    # An "instrumented" arm that is much cheaper than its baseline cannot be an additive instrument.
    predicate = RefusalPredicate(min_pairs=9, max_relative_iqr=1.0, min_ratio=1.0)
    result = measure_overhead(("base", busy(40_000)), ("instrumented", busy(4_000)), pairs=9, predicate=predicate)
    assert not result.admitted
    assert any("physically impossible" in reason for reason in result.reasons)


def test_arm_order_alternates():
    order = []
    measure_overhead(("a", lambda: order.append("a")), ("b", lambda: order.append("b")), pairs=4,
                     warmup=1, repeats=1, min_sample_s=0)
    timed = order[2:-2]  # after the warm-up pair, before the closing witness calls
    assert timed == ["a", "b", "b", "a", "a", "b", "b", "a"]

    shuffled = []
    measure_overhead(("a", lambda: shuffled.append("a")), ("b", lambda: shuffled.append("b")), pairs=16,
                     warmup=1, repeats=1, min_sample_s=0, order="random", seed=3)
    firsts = shuffled[2:-2][::2]
    assert set(firsts) == {"a", "b"}


def test_result_prints_one_line_with_predicate_and_fingerprint():
    result = measure_overhead(("N", busy(2_000)), ("N again", busy(2_000)), pairs=9, predicate=LOOSE)
    line = str(result)
    assert "\n" not in line
    assert "predicate: pairs>=9" in line and "9 pairs" in line
    assert f"torch {torch.__version__}" in line and "threads" in line
    record = result.to_dict()
    assert record["schema"] == "torchlens.overhead_measurement.v1"
    assert record["fingerprint"]["threads"] == torch.get_num_threads()
    assert isinstance(result, OverheadResult)


def test_a_system_without_load_averages_measures_and_records_the_load_as_unknown(monkeypatch):
    import os

    monkeypatch.delattr(os, "getloadavg")  # as on Windows, which has no load averages
    result = measure_overhead(("N", busy(2_000)), ("N again", busy(2_000)), pairs=9, predicate=LOOSE)
    assert result.fingerprint["load_1_5_15"] is None and result.fingerprint["threads"] == torch.get_num_threads()
    assert result.pairs == 9


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="zero-argument callable"):
        measure_overhead(3, busy(10))
    with pytest.raises(ValueError, match="order"):
        measure_overhead(busy(10), busy(10), order="aabb")
    with pytest.raises(ValueError, match="pairs"):
        measure_overhead(busy(10), busy(10), pairs=0)


def test_order_statistic_bounds_match_the_binomial():
    # n = 7: P(B <= 0) = 1/128 <= 0.025 < P(B <= 1): the interval is [min, max].
    assert _order_rank(7, 0.025) == 1
    # n = 21, one-sided 5%: P(B <= 5) = 0.0133, P(B <= 6) = 0.0392, P(B <= 7) = 0.0946.
    assert _order_rank(21, 0.05) == 7
    assert _order_rank(4, 0.05) == 0 and _lower_bound([1.0, 2.0, 3.0, 4.0], 0.05) is None
    values = list(range(1, 22))
    assert _lower_bound(values, 0.05) == 7
    assert _median_interval(values, 0.025) == (6, 16)
    tail = sum(math.comb(21, k) for k in range(7)) / 2 ** 21
    assert tail <= 0.05


def test_a_cuda_output_in_a_dataclass_is_synchronized(monkeypatch):
    """The sync decision walks the output as the trace does: a dataclass output on CUDA (found by no walk of
    tuples, lists and dicts) was timed without synchronizing, measuring kernel launches only."""
    import dataclasses

    from torchlens.report.overhead import _needs_sync

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor

    class OnCuda(torch.Tensor):
        is_cuda = True  # stands in for a CUDA tensor on a machine without one

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_cuda = torch.ones(2).as_subclass(OnCuda)
    assert _needs_sync(None, Output(on_cuda)) and _needs_sync(None, {"out": [on_cuda]})
    assert not _needs_sync(None, Output(torch.ones(2)))


def test_same_output_is_exact():
    a = torch.tensor([1.0, float("nan")])
    assert outputs_equal((a, {"k": 2}), (a.clone(), {"k": 2}))
    assert not outputs_equal(a, a.double())
    assert not outputs_equal(torch.ones(2), torch.ones(2) + 1e-7)
    assert not outputs_equal([torch.ones(1)], (torch.ones(1),))


def test_equal_outputs_in_a_dataclass_or_object_are_compared_by_their_tensors():
    """A traced arm of a model returning a dataclass gives the untraced arm's output: the harness compares the
    tensors inside (the comparison tl.validate uses), rather than calling every pair different."""
    import torchlens as tl

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor

    class Holder:
        def __init__(self, t):
            self.t = t

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return Out(self.fc(x))

    model, x = Model(), torch.randn(2, 3)
    result = measure_overhead(lambda: model(x), lambda: tl.trace(model, x).output, pairs=3, warmup=1, repeats=1)
    assert result.outputs_equal == 3, str(result)
    a = torch.ones(3)
    assert outputs_equal(Holder(a), Holder(a.clone())) and not outputs_equal(Holder(a), Holder(a + 1))
    assert not outputs_equal(Out(a), Out(a.double()))


def test_predicate_rejects_meaningless_settings():
    with pytest.raises(ValueError, match="confidence"):
        RefusalPredicate(confidence=1.5)
    with pytest.raises(ValueError, match="min_pairs"):
        RefusalPredicate(min_pairs=0)


@pytest.mark.parametrize("option, value, error, message", [
    # pairs=2.5 failed in range(), pairs=True made one pair, pairs="3" failed on "'<' not supported".
    ("pairs", 2.5, TypeError, r"measure_overhead: pairs=2\.5 is a float, not an int; give a count of 1 or more"),
    ("pairs", True, TypeError, r"pairs=True is a bool"),
    ("pairs", "3", TypeError, r"pairs='3' is a str"),
    # max_calls_per_sample=0 was taken as 1, min_sample_s=nan failed in math.ceil.
    ("max_calls_per_sample", 0, ValueError, r"max_calls_per_sample=0 is below 1"),
    ("min_sample_s", float("nan"), ValueError, r"min_sample_s=nan is not a number \(NaN\)"),
    # device="gpu" was read only where CUDA is available: unseen on a CPU machine, torch's error after the warm-up.
    ("device", "gpu", ValueError, r"measure_overhead: device='gpu' is not a torch device \(.*\); give one such as "),
    ("device", 1.5, TypeError, r"measure_overhead: device=1\.5 is a float; give one such as 'cuda' or 'cpu'"),
])
def test_a_count_or_duration_that_cannot_work_is_refused_before_any_call(option, value, error, message):
    calls = []
    with pytest.raises(error, match=message):
        measure_overhead(lambda: calls.append(1), lambda: calls.append(1), **{option: value})
    assert not calls


def test_a_nan_bound_of_the_predicate_is_refused():
    # max_relative_iqr=nan compared false with every spread, so no measurement was ever refused for its spread.
    with pytest.raises(ValueError, match=r"RefusalPredicate: max_relative_iqr=nan is not a number \(NaN\)"):
        RefusalPredicate(max_relative_iqr=float("nan"))
    with pytest.raises(TypeError, match=r"RefusalPredicate: min_pairs=2\.5 is a float, not an int"):
        RefusalPredicate(min_pairs=2.5)


def test_a_predicate_or_compare_of_the_wrong_kind_is_refused_before_any_call():
    # predicate=3 failed on "'int' object has no attribute 'min_pairs'" after every pair was timed; compare=3 on
    # "'int' object is not callable" at the first pair.
    calls = []
    with pytest.raises(TypeError, match=r"measure_overhead: predicate= takes a RefusalPredicate .* got int"):
        measure_overhead(lambda: calls.append(1), lambda: calls.append(1), predicate=3)
    with pytest.raises(TypeError, match=r"measure_overhead: compare= takes a function f\(output_a, output_b\) -> bool"):
        measure_overhead(lambda: calls.append(1), lambda: calls.append(1), compare=3)
    assert not calls


def test_outputs_holding_a_cache_object_are_compared_by_their_tensors():
    # A transformers causal LM returns its key/value cache as an object, which has no == of its own: two
    # identical forwards must still agree, or no such model could ever be measured.
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        first, second = model(ids), model(ids)
        other = model(ids.flip(-1))
    assert first.past_key_values is not None
    assert outputs_equal(first, second)
    assert not outputs_equal(first, other)
    with torch.no_grad():
        result = measure_overhead(lambda: model(ids), lambda: model(ids), pairs=3, warmup=1, repeats=1,
                                  min_sample_s=0, predicate=RefusalPredicate(min_pairs=3, max_relative_iqr=10))
    assert result.outputs_equal == 3 and not any("outputs differ" in r for r in result.reasons)
