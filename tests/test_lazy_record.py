"""A trace's columns are derived on first read (record/finalize.py), from what was read when the forward ended.

Whatever can change after a trace (a module's class, the model's parameters, a returned tensor written in
place, a parameter's data) reads as it was when the forward ended, however late the columns are first read;
every order of first reads gives the same record; and ``cleanup`` before any read loses nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize

import torchlens as tl

from zoo import zoo

COLUMNS = ("labels", "op_layer_labels", "pass_numbers", "groups", "group_sizes", "op_types", "func_names", "kinds",
           "call_indices", "slots", "op_meta", "op_parents", "module_call_indices", "inplace_flags", "io_paths",
           "param_addresses")
FIRST_READS = ("labels", "module_calls", "kinds", "op_meta", "modules")


def _record(log) -> dict:
    record = {name: getattr(log, name) for name in COLUMNS}
    record["module_calls"] = [(mc.label, mc.module.class_name, mc.parent.label if mc.parent else None,
                               [c.label for c in mc.children], mc.input_ops, mc.output_ops) for mc in log.module_calls]
    record["modules"] = [(m.address, m.all_addresses, m.class_name, m.param_names, m.num_calls) for m in log.modules]
    return record


def _derived(log) -> set:
    return {"_kind", "_labels", "_call_rows", "_param_addresses"} & set(vars(log))


@pytest.mark.parametrize("name", sorted(zoo()))
def test_every_order_of_first_reads_gives_the_same_record(name):
    records = []
    for first in FIRST_READS:
        model, args, kwargs = zoo()[name]
        torch.manual_seed(0)  # the dropout case draws the same masks each time
        log = tl.trace(model, args, kwargs)
        getattr(log, first)
        records.append(_record(log))
    for first, record in zip(FIRST_READS[1:], records[1:]):
        assert record == records[0], f"reading {first} first gave another record"


def test_a_trace_nobody_reads_derives_no_column():
    model, args, kwargs = zoo()["small_cnn"]
    log = tl.trace(model, args, kwargs)
    assert not _derived(log)
    log.op_parents
    assert _derived(log) == {"_kind"}  # one group at a time
    log.module_calls
    log.labels
    assert _derived(log) == {"_kind", "_labels", "_call_rows"} and log._raw is not None
    log.param_addresses
    # then the raw lists go
    assert _derived(log) == {"_kind", "_labels", "_call_rows", "_param_addresses"} and log._raw is None


def test_a_parameter_outside_the_index_is_named_by_its_shape_when_the_forward_ends():
    outside = nn.Parameter(torch.ones(3, 4))  # held by no module of the model
    model = nn.Linear(4, 4)
    log = tl.trace(lambda x: model(x) @ outside.t(), torch.randn(2, 4), root=model)
    assert "_param_addresses" in vars(log)  # read when the forward ended, not on first read
    outside.data = torch.ones(5, 4)  # the shape it would be named by now
    assert log["linear_1_1"].params == ("weight", "bias")
    assert any(p == ("<unregistered parameter (3, 4)>",) for p in log.param_addresses.values())


class _Wrapper(nn.Module):
    """Holds its module as ``_orig_mod``, as a torch.compile wrapper does: shown as the class it wraps."""

    def __init__(self, inner):
        super().__init__()
        self._orig_mod = inner

    def forward(self, x):
        return self._orig_mod(x)


def test_a_wrapper_shows_the_class_it_wraps_inside_the_model_and_outside_it():
    torch.manual_seed(0)
    model = nn.Sequential(_Wrapper(nn.Linear(4, 4)), nn.ReLU())
    log = tl.trace(model, torch.randn(2, 4))
    assert [(m.address, m.class_name) for m in log.modules] == [("0", "Linear"), ("0", "Linear"), ("1", "ReLU")]
    outside, inner = _Wrapper(nn.Tanh()), nn.Linear(4, 4)  # a wrapper the root's walk never saw
    log = tl.trace(lambda x: outside(inner(x)), torch.randn(2, 4), root=inner)
    assert [m.class_name for m in log.modules] == ["Linear", "Tanh", "Tanh"]


def test_a_module_class_swapped_after_the_trace_reads_as_traced():
    class Scaled(nn.Module):
        def forward(self, w):
            return w * 1.0

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    log = tl.trace(model, torch.randn(2, 4))
    parametrize.register_parametrization(model[0], "weight", Scaled())  # a new class; weight moves away
    model[1].register_parameter("extra", nn.Parameter(torch.zeros(1)))
    assert type(model[0]).__name__ == "ParametrizedLinear" and "weight" not in model[0]._parameters
    assert [(m.address, m.class_name, m.param_names) for m in log.modules] == [
        ("0", "Linear", ["weight", "bias"]), ("1", "ReLU", [])]
    assert log["linear_1_1"].params == ("0.weight", "0.bias")


def test_parameters_registered_after_the_trace_on_the_root_or_outside_the_model_are_not_listed():
    root, outside = nn.Linear(4, 4), nn.Linear(4, 4)
    for called, address in ((root, "self"), (outside, "<unregistered Linear #1>")):
        log = tl.trace(lambda x: outside(root(x)) * 2, torch.randn(2, 4), root=root)
        called.register_parameter("extra", nn.Parameter(torch.zeros(1)))
        assert [(m.address, m.param_names) for m in log.modules if m.address == address] == \
            [(address, ["weight", "bias"])]
        del called.extra


def test_a_parameter_outside_the_model_is_named_by_its_shape_when_traced():
    w = nn.Parameter(torch.randn(4, 3))
    log = tl.trace(lambda x: torch.matmul(x, w), torch.randn(2, 4))
    w.data = torch.randn(5, 5)  # same object, another shape
    assert [op.params for op in log.ops if op.params] == [("<unregistered parameter (4, 3)>",)]


def test_a_returned_tensor_written_in_place_after_the_trace_keeps_its_metadata():
    log = tl.trace(nn.Linear(4, 3), torch.randn(2, 4))
    log.output.t_()  # the caller's tensor, changed in place after the trace
    out = log.outputs[0]
    assert out.shape == (2, 3) and log[log.op_parents[out.index][0][1]].shape == (2, 3)


def test_cleanup_before_any_read_keeps_every_column():
    model, args, kwargs = zoo()["shared_module"]
    expected = _record(tl.trace(model, args, kwargs))
    log = tl.trace(model, args, kwargs)
    log.cleanup()
    assert _record(log) == expected and log.is_cleaned_up


def test_threads_reading_a_trace_first_get_one_record():
    import sys

    model, args, kwargs = zoo()["mlp"]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often enough to interleave their first reads
    try:
        _read_from_threads(model, args, kwargs)
    finally:
        sys.setswitchinterval(interval)


def _read_from_threads(model, args, kwargs):
    import threading

    for _ in range(5):
        log = tl.trace(model, args, kwargs)
        start, seen = threading.Barrier(6), []

        def read():
            start.wait()
            seen.append((log._call_rows, log.labels, log.op_parents))  # module_calls: views over _call_rows

        threads = [threading.Thread(target=read) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(seen) == 6 and all(all(a is b for a, b in zip(s, seen[0])) for s in seen)
        assert all(mc._trace is log for mc in log.module_calls) and log.ops[-1].module_call is None
