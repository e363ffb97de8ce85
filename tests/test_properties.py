"""Property tests on random models: what must hold for any model capture is given.

For each generated model (random op DAG, nested and shared submodules, Python loops; see
random_models.py): the traced output is bit-identical to an untraced run, replay validation reproduces
every op it can and names a reason for each it cannot, labels are the same in two traces, every call of
a shared module lands on the same layers, and nothing stays installed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from random_models import build, programs  # noqa: E402
from torchlens.validate import outputs_equal  # noqa: E402
from untouched import assert_untouched, snapshot  # noqa: E402

# Fixed, modest example profile: the same models every run, quick on a loaded machine.
PROFILE = settings(max_examples=80, derandomize=True, deadline=None, database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Reasons validation may give for not replaying an op of these (RNG-free) models.
ACCEPTED_REASONS = ("it read ",)  # a value read through a view after an in-place write


def _clone(x):
    return x.clone()


def _signature(log) -> list:
    """Everything about a trace that must not vary between two runs of the same model and input."""
    return [(op.label, op.kind, op.func_name, tuple(op.parents), op.module, op.shape, op.dtype,
             op.source.line if op.source else None) for op in log.ops] + \
           [(mc.label, mc.parent.label if mc.parent else None) for mc in log.module_calls]


def check_model(program) -> None:
    model, x = build(program)
    expected = model(_clone(x))
    traced_input = _clone(x)
    before = snapshot(model, [traced_input])

    log = tl.trace(model, traced_input)
    assert outputs_equal(log.output, expected), "traced output differs from an untraced run"
    assert_untouched(before, snapshot(model, [traced_input]))

    again = tl.trace(model, _clone(x))
    assert _signature(log) == _signature(again), "two traces of one model labeled it differently"

    _check_passes(log)

    result = tl.validate(model, _clone(x))
    assert result.outputs_match, "validate: traced outputs differ from its untraced run"
    assert not result.mismatched, f"replay mismatches: {result.mismatched}"
    replayable = [op for op in log.ops if op.kind == "op" and op.multi_output_index in (None, 0, (0,))]
    assert result.replayed + len(result.not_replayed) == len(replayable)
    for label, reason in result.not_replayed:
        assert reason.startswith(ACCEPTED_REASONS), f"{label} not replayed: {reason}"
    assert_untouched(before, snapshot(model, [traced_input]))


def _check_passes(log) -> None:
    """A module object called k times: the ops directly in its j-th call are pass j of the same layers."""
    for module in log.modules:
        if module.num_calls < 2:
            continue
        per_call = []
        for j, call in enumerate(module.calls, start=1):
            inside = [log[label] for label in call.op_labels if log[label].module == call.label]
            assert all(op.pass_index == j for op in inside), \
                f"{call.label}: {[op.label for op in inside]} are not all pass {j}"
            per_call.append([op.layer_label for op in inside])
        assert all(layers == per_call[0] for layers in per_call), f"calls of {module.address} differ"


@PROFILE
@given(programs(), st.booleans())
def test_random_models_trace_faithfully(program, no_grad):
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        check_model(program)


def _every_template():
    """One small program per step template (each op family variant, block call, loop body)."""
    from random_models import FAMILIES, LOOP, Program, Step

    block = [Step("module", 0, 0, 0), Step("unary", 0, 1, 0)]
    cases = [(f"{family}[{v}]", Step(family, v, 1, 0)) for family, templates in FAMILIES.items()
             for v in range(len(templates))]
    cases += [(f"loop[{v}]", Step("loop", v, 1, 0, block=0, repeats=3)) for v in range(len(LOOP))]
    cases.append(("block", Step("block", 0, 1, 0)))
    for name, step in cases:
        # A unary step first, so that in-place steps write an intermediate as well as the input.
        yield name, Program([block], [Step("unary", 1, 0, 0), step, Step("block", 0, 2, 0)], seed=3)


def test_every_template_traces_faithfully():
    """Every step template the generator knows passes the same checks as a random model."""
    for name, program in _every_template():
        try:
            check_model(program)
        except AssertionError as exc:
            raise AssertionError(f"template {name}: {exc}") from exc
