"""``tl.debug.hot_path``: ranking a trace's torch calls by time, FLOPs or activation memory."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl
from zoo import LoopRNN, zoo


def test_the_seed_recipe_runs_verbatim():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    x = torch.randn(32, 64)
    log = tl.trace(model, x)
    ranked = tl.debug.hot_path(log, by="duration").to_pandas()
    log.cleanup()
    assert list(ranked.columns) == ["address", "count", "total", "percent"]
    assert list(ranked["total"]) == sorted(ranked["total"], reverse=True)
    assert set(ranked["address"]) == {"linear_1_1:1", "relu_1_2:1", "linear_2_3:1"}
    assert ranked.attrs["by"] == "duration" and "Timer" in ranked.attrs["note"]
    assert abs(ranked["percent"].sum() - 100.0) < 1e-6


def test_result_is_an_object_with_rows_metadata_and_a_readable_table():
    model, args, kwargs = zoo()["mlp"]
    log = tl.trace(model, args, kwargs)
    result = tl.debug.hot_path(log, by="flops")
    assert isinstance(result, tl.debug.HotPath)
    totals = [row["total"] for row in result.rows]
    assert totals == sorted(totals, reverse=True)
    assert result.total == int(log.flops) and result.unit == "FLOPs"
    text = str(result)
    assert "grouped by op" in text and result.rows[0]["address"] in text


def test_rows_are_indexed_by_position_and_anything_else_is_refused_saying_how():
    # hot[True] gave row 1, hot["linear_1_1:1"] said "list indices must be integers or slices, not str", and
    # hot[100] "list index out of range".
    model, args, kwargs = zoo()["mlp"]
    result = tl.debug.hot_path(tl.trace(model, args, kwargs), by="flops")
    assert result[0] is result.rows[0] and result[-1] is result.rows[-1] and result[1:3] == result.rows[1:3]
    address = result.rows[0]["address"]
    with pytest.raises(TypeError, match=rf"indexed by position \(an int or a slice\), not str; find a row by its "
                                        rf"address with next\(r for r in hot\.rows if r\['address'\] == '{address}'\)"):
        result[address]
    for key in (True, None, 1.5):
        with pytest.raises(TypeError, match=rf"a hot path's rows are a list, .* not {type(key).__name__}$"):
            result[key]
    with pytest.raises(IndexError, match=rf"hot path row 100 is out of range: it has {len(result)} rows"):
        result[100]


def test_durations_are_the_instrumented_call_times_counted_once_per_call():
    log = tl.trace(lambda x: torch.max(x, dim=1), torch.randn(4, 9))
    result = tl.debug.hot_path(log, by="duration")
    values = next(op for op in log.ops if op.kind == "op")
    assert [row["address"] for row in result.rows] == [values.label]  # the indices share the call's time
    assert result.rows[0]["total"] == values.duration
    assert "instrumented" in str(result) and "torch.utils.benchmark.Timer" in str(result)


def test_layer_grouping_sums_every_pass():
    log = tl.trace(LoopRNN().eval(), torch.randn(2, 8))
    by_layer = {row["address"]: row for row in tl.debug.hot_path(log, by="duration", group="layer")}
    layer = log["linear_1_2"]
    assert by_layer["linear_1_2"]["count"] == layer.num_passes == 16
    assert by_layer["linear_1_2"]["total"] == pytest.approx(sum(op.duration for op in layer.ops))


def test_module_grouping_is_inclusive_of_nested_calls():
    model, args, kwargs = zoo()["small_cnn"]
    log = tl.trace(model, args, kwargs)
    rows = {row["address"]: row for row in tl.debug.hot_path(log, by="memory", group="module")}
    assert set(rows) == {call.label for call in log.module_calls}
    for call in log.module_calls:
        ops = [log[label] for label in call.op_labels if log[label].kind == "op"]
        # an in-place op (the CNN's ReLU(inplace=True)) wrote into a tensor another op produced: it adds 0
        assert rows[call.label]["total"] == sum(0 if op.is_inplace else op.nbytes for op in ops)
        assert rows[call.label]["count"] == len(ops)
    assert rows["features:1"]["total"] > rows["features.4:1"]["total"]


class LoopedLine(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(3):
            x = torch.tanh(self.fc(x))
        return x.sum()


def test_source_grouping_collects_every_execution_of_a_line():
    log = tl.trace(LoopedLine(), torch.randn(2, 8))
    rows = {row["address"]: row for row in tl.debug.hot_path(log, by="flops", group="source")}
    lines, start = inspect.getsourcelines(LoopedLine.forward)
    loop_line = start + next(i for i, text in enumerate(lines) if "torch.tanh" in text)
    key = f"{os.path.relpath(inspect.getsourcefile(LoopedLine))}:{loop_line}"  # relative to the working directory
    assert rows[key]["count"] == 6  # linear and tanh, three times
    assert rows[key]["total"] == sum(tl.report.op_flops(op) for op in log.ops if op.source and
                                     op.source.line == loop_line)


def test_source_grouping_falls_back_to_the_module_for_a_bare_sequential():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    log = tl.trace(model, torch.randn(3, 8))
    keys = [row["address"] for row in tl.debug.hot_path(log, by="flops", group="source")]
    assert sorted(keys) == ["0 (Linear)", "1 (ReLU)", "2 (Linear)"]
    torch_dir = os.path.dirname(torch.__file__)
    assert not any(torch_dir in key for key in keys)


def test_ops_without_a_metric_value_are_excluded_and_named():
    log = tl.trace(lambda x: torch.sort(x * 2, dim=-1).values, torch.randn(3, 5))
    result = tl.debug.hot_path(log, by="flops")
    sort = next(op for op in log.ops if op.func_name == "sort")
    assert result.excluded == (sort.label,)
    assert sort.label not in [row["address"] for row in result.rows]
    assert result.to_pandas().attrs["excluded"] == [sort.label]
    assert f"excluded, no flops value: 1 op ({sort.label})" in str(result)


def test_a_cleaned_up_trace_still_ranks_by_duration_flops_and_memory():
    model, args, kwargs = zoo()["transformer_fastpath"]
    log = tl.trace(model, args, kwargs)
    before = {by: tl.debug.hot_path(log, by=by, group="module").rows for by in ("duration", "flops", "memory")}
    log.cleanup()
    for by, rows in before.items():
        assert tl.debug.hot_path(log, by=by, group="module").rows == rows


@pytest.mark.parametrize("kwargs, valid", [({"by": "time"}, "duration, flops, memory"),
                                           ({"group": "file"}, "op, layer, module, source"),
                                           ({"by": ["duration"]}, "duration, flops, memory")])
def test_unknown_metric_or_grouping_is_refused_with_the_valid_values(kwargs, valid):
    log = tl.trace(F.relu, torch.randn(3))
    with pytest.raises(ValueError, match=valid):
        tl.debug.hot_path(log, **kwargs)


def test_a_total_of_zero_gives_no_row_a_share():
    # The FLOPs of an empty batch, or gradients all zero, total 0: every row read 0.0%, as if it cost nothing
    # beside the others, where a share of nothing is undefined.
    from torchlens.cli import hot_path_text

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    empty = tl.trace(model, torch.randn(0, 8))
    zeroed = tl.trace(model, torch.randn(3, 8), grads=True)
    zeroed.backward(zeroed.output.sum() * 0)
    for log, by in ((empty, "flops"), (zeroed, "grad_norm")):
        ranked = tl.debug.hot_path(log, by=by)
        assert ranked.total == 0 and len(ranked) == 3 and all(row["total"] == 0 for row in ranked)
        assert all(row["percent"] != row["percent"] for row in ranked)  # NaN
        assert ranked.to_pandas()["percent"].isna().all()
        text = str(ranked)
        assert "0.0%" not in text and "percent: n/a, a share of a total of 0 is undefined" in text
        text = hot_path_text(log, 5, by=by)
        assert "0.0%" not in text and "percent: n/a, a share of a total of 0 is undefined" in text
    ranked = tl.debug.hot_path(tl.trace(model, torch.randn(3, 8)), by="flops")
    assert abs(sum(row["percent"] for row in ranked) - 100.0) < 1e-6 and "n/a" not in str(ranked)
