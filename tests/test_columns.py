"""The named record model (record/columns.py) and the public names over it, on real models."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
from torchlens.record.columns import Call, Kind, OpMeta
from zoo import zoo


@pytest.mark.parametrize("name", ["mlp", "batchnorm_eval", "multi_output", "dict_io", "inplace_views"])
def test_calls_and_columns_are_named_and_agree_with_the_ops(name):
    model, args, kwargs = zoo()[name]
    log = tl.trace(model, args, kwargs)
    assert log.calls and all(type(c) is Call for c in log.calls)
    for op in log.ops:
        assert log.kinds[op.index] == Kind[op.kind.upper()] and isinstance(log.kinds[op.index], Kind)
        meta = log.op_meta[op.index]
        assert isinstance(meta, OpMeta) and tuple(meta.shape) == op.shape and meta.dtype == op.dtype
        call = op.call
        if op.kind != "op":
            assert call is None and log.call_indices[op.index] == -1
            continue
        assert call is log.calls[log.call_indices[op.index]]
        assert call.func is op.func and call.first_record <= op.index < call.first_record + call.num_outputs
        mc = op.module_call
        assert (mc.index if mc is not None else -1) == call.module_call
        assert [log.ops[p].label for _, p in call.parents if p >= 0] == op.parents


def test_a_loaded_trace_has_the_same_named_columns(tmp_path):
    model, args, _ = zoo()["batchnorm_eval"]
    live = tl.trace(model, args)
    loaded = tl.load(live.save(tmp_path / "t"))
    assert all(type(c) is Call for c in loaded.calls) and all(isinstance(m, OpMeta) for m in loaded.op_meta)
    assert [c.first_record for c in loaded.calls] == [c.first_record for c in live.calls]
    assert list(loaded.kinds) == list(live.kinds)


def test_cleanup_keeps_the_call_records_named():
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args)
    before = [(c.func, c.parents, c.first_record) for c in log.calls]
    log.cleanup()
    assert all(type(c) is Call and c.args is None and c.params == () for c in log.calls)
    assert [(c.func, c.parents, c.first_record) for c in log.calls] == before


def test_ops_are_op_objects_everywhere_and_op_labels_are_the_strings():
    model, args, _ = zoo()["batchnorm_eval"]
    log = tl.trace(model, args)
    call = log["conv:1"].module_call
    assert all(isinstance(op, tl.Op) for op in call.ops) and [op.label for op in call.ops] == call.op_labels
    param = next(p for p in log.params if p.address == "conv.weight")
    assert [op.label for op in param.ops] == param.op_labels == [op.label for op in log.ops if "conv.weight" in op.params]
    buffer = next(b for b in log.buffers if b.address == "scale")
    assert [op.kind for op in buffer.ops] == ["buffer"] and [op.label for op in buffer.ops] == buffer.op_labels


def test_op_module_address_and_the_old_module_spelling():
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args)
    op = next(op for op in log.ops if op.func_name == "linear")
    assert op.module_address == "layers.0" and op.module == op.module_call.label == "layers.0:1"
    assert log.ops[0].module_address is None and log.ops[0].module is None


def test_errors_have_one_home_and_keep_their_old_bases():
    from torchlens import errors
    from torchlens.io.format import TraceFileError
    from torchlens.report.kernel_profiling import ProfilerBusyError

    assert TraceFileError is errors.TraceFileError and issubclass(TraceFileError, ValueError)
    assert ProfilerBusyError is errors.ProfilerBusyError
    assert issubclass(ProfilerBusyError, tl.TorchlensError) and issubclass(ProfilerBusyError, RuntimeError)
    with pytest.raises(tl.TorchlensError):
        tl.load(torch.__file__)  # not a trace folder


def test_the_indexes_named_below_record_match_the_call_layout():
    from torchlens.labels import passes
    from torchlens.record import columns

    names = ("CALL_FUNC", "CALL_ARGS", "CALL_KWARGS", "CALL_PARAMS", "CALL_CODE", "CALL_LINE", "CALL_SITE")
    for name in names:
        assert getattr(passes, name) == getattr(columns, name), name
    assert columns.Call._fields[columns.CALL_SITE] == "site" and len(columns.Call._fields) == 14


def test_the_shape_index_named_below_record_matches_the_meta_layout():
    from torchlens.labels import passes
    from torchlens.record import columns

    assert columns.OpMeta._fields[passes.META_SHAPE] == "shape"
