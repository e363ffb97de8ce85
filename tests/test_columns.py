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
    assert [op.label for op in param.ops] == param.op_labels == \
        [op.label for op in log.ops if "conv.weight" in op.params]
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


_RAW_LISTS = {"module_calls", "calls", "records"}  # CaptureState's raw lists, and the Trace's named calls


def _positional_reads_of_raw_records(path) -> list:
    """``item[<int>]`` where ``item`` is one entry of a raw list (``st.module_calls[m]``, ``calls[c]`` with
    ``calls = st.calls``), in one file: reads that would break silently if the layout changed."""
    import ast

    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        nodes, aliases, items = list(ast.walk(fn)), set(), set()

        def is_raw(e):
            return (isinstance(e, ast.Attribute) and e.attr in _RAW_LISTS) or \
                (isinstance(e, ast.Name) and e.id in aliases)

        for _ in range(2):  # an alias bound after its first use in the walk order
            for node in nodes:
                if not isinstance(node, ast.Assign):
                    continue
                pairs = [(t, node.value) for t in node.targets]
                if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(node.targets[0].elts, node.value.elts))
                for target, value in pairs:
                    if isinstance(target, ast.Name) and is_raw(value):
                        aliases.add(target.id)
                    elif isinstance(target, ast.Name) and isinstance(value, ast.Subscript) and is_raw(value.value):
                        items.add(target.id)
        for node in nodes:
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                    and type(node.slice.value) is int:
                inner = node.value
                if (isinstance(inner, ast.Name) and inner.id in items) or \
                        (isinstance(inner, ast.Subscript) and is_raw(inner.value)):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.path_independent  # reads the source, traces nothing: once, on the first pass
def test_no_file_reads_a_raw_record_by_a_bare_position():
    """Raw calls, records and module calls are read through the names of record/columns.py (``CALL_*``,
    ``RECORD_*``, ``MODULE_CALL_*``, or the ``Call`` fields), never by a literal index."""
    import importlib.util
    import pathlib

    src = pathlib.Path(importlib.util.find_spec("torchlens").submodule_search_locations[0])
    found = [f"{p.relative_to(src).parent}/{hit}" for p in sorted(src.rglob("*.py"))
             for hit in _positional_reads_of_raw_records(p)]
    assert not found, "raw records read by position (name the field):\n" + "\n".join(found)


def test_the_positional_read_check_catches_aliases_and_direct_reads(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("def f(st, m):\n    calls = st.module_calls\n    record = calls[m]\n    return record[1]\n\n"
                      "def g(st, c):\n    return st.calls[c][0]\n\n"
                      "def h(st, m):\n    return st.module_calls[m][MODULE_CALL_PARENT], st.shape[0]\n")
    assert [hit.split(": ")[1] for hit in _positional_reads_of_raw_records(source)] == ["record[1]", "st.calls[c][0]"]
