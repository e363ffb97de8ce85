"""``nonfinite_origin`` on traces whose parameters it cannot read: cleaned up, or loaded from disk.

Parameters are not flagged at capture; they are read from the live model when the report is asked for.  A
trace that no longer holds the model cannot say whether an op's weight held the NaN, so no op that read a
parameter may be called a certain origin "from finite inputs" there.
"""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
from zoo import MLP

UNCHECKED = "not checked: the trace no longer holds the model"


@pytest.fixture(scope="module")
def nan_head():
    """An MLP whose head weight holds a NaN: every value before the head is finite, and its output is not."""
    torch.manual_seed(0)
    model = MLP().eval()
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    return model, torch.randn(3, 16)


def _cleaned_up(model, x, _):
    log = tl.trace(model, x, save="none", record_finite=True)
    log.cleanup()
    return log


def _loaded(model, x, tmp_path):
    return tl.load(tl.trace(model, x).save(tmp_path / "run"))


def test_the_live_trace_blames_the_parameter(nan_head):
    report = tl.debug.nonfinite_origin(tl.trace(*nan_head, save="none", record_finite=True))
    assert report.origin_kind == "parameter" and report.parameters == ("head.weight",) and report.certain


@pytest.mark.parametrize("made", [_cleaned_up, _loaded])
def test_an_op_reading_an_unchecked_parameter_is_no_certain_origin(nan_head, made, tmp_path):
    report = tl.debug.nonfinite_origin(made(*nan_head, tmp_path))
    assert not report.parameters_checked and report.origin.func_name == "linear" and report.origin.module == "head:1"
    assert not report.certain and f"(parameter head.weight, {UNCHECKED})" in report.possible_origins
    printed = str(report)
    assert "from finite inputs" not in printed and "call nonfinite_origin before cleanup()" in printed


def test_an_op_reading_no_parameter_stays_certain_on_a_cleaned_up_trace():
    log = tl.trace(lambda x: torch.log(x - 5).relu(), torch.ones(3), save="none", record_finite=True)
    log.cleanup()
    report = tl.debug.nonfinite_origin(log)
    assert report.certain and report.origin.func_name == "log" and report.possible_origins == ()


def test_a_parameter_of_a_module_a_traced_function_called_is_not_taken_for_finite(nan_head):
    # tl.trace(lambda x: model(x), x) holds no model: the head's weight is named by its shape and was never
    # checked, where the report called the head's linear the certain origin "from finite inputs".
    model, x = nan_head
    report = tl.debug.nonfinite_origin(tl.trace(lambda t: model(t), x))
    assert report.parameters_checked and report.parameters == () and report.origin.func_name == "linear"
    weight = "(parameter <unregistered parameter (4, 16)>, not checked: no parameter of the traced model)"
    assert not report.certain and weight in report.possible_origins
    assert "from finite inputs" not in str(report) and "trace the module itself" in str(report)
    assert tl.debug.nonfinite_origin(tl.trace(model.forward, x)).origin_kind == "parameter"
