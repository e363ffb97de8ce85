"""Code outside ``record/`` reads a Trace through its public accessors and declares what it adds to one.

The private columns a ``Trace`` is built from (``_labels``, ``_parents`` ...) are ``record/``'s to lay out;
every other layer reads the documented accessors of ``record/trace.py`` (``labels``, ``op_parents`` ...),
so the columns can change without touching the bridges (docs/architecture.md).
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

import pytest
import torch

import torchlens as tl
from torchlens.record.trace import Trace

from zoo import LoopRNN

SRC = pathlib.Path(importlib.util.find_spec("torchlens").submodule_search_locations[0])

PRIVATE_COLUMNS = ("_labels", "_activations", "_module_call", "_group", "_layer_labels", "_func_names", "_types",
                   "_group_size", "_parents", "_pass", "_param_addresses", "_io", "_dropped", "_finite", "_slot",
                   "_model", "_inplace", "_cleaned", "_alias_reads")
_NAMES = "|".join(PRIVATE_COLUMNS)
# An attribute read (``log._labels``) or a name handed to getattr / hasattr (``"_labels"``).
PRIVATE_READ = re.compile(rf"\.({_NAMES})\b|[\"']({_NAMES})[\"']")

# accessor -> the private column it must return, unchanged (not a copy: bridges bind it once per loop)
ACCESSORS = {"labels": "_labels", "op_layer_labels": "_layer_labels", "module_call_indices": "_module_call",
             "op_parents": "_parents", "pass_numbers": "_pass", "groups": "_group", "group_sizes": "_group_size",
             "op_types": "_types", "func_names": "_func_names", "slots": "_slot", "inplace_flags": "_inplace",
             "io_paths": "_io", "saved_activations": "_activations", "dropped_activations": "_dropped",
             "finite_flags": "_finite", "param_addresses": "_param_addresses", "alias_reads": "_alias_reads"}


def test_no_file_outside_record_reads_a_private_trace_column():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] == "record":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE_READ.search(line):
                found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not found, "private Trace columns read outside record/ (use the Trace accessors):\n" + "\n".join(found)


def test_the_pattern_catches_reads_and_spares_longer_names():
    assert PRIVATE_READ.search("x = log._labels[i]") and PRIVATE_READ.search('getattr(log, "_cleaned", False)')
    assert PRIVATE_READ.search("trace._module_call[first]") and PRIVATE_READ.search("log._model.named_parameters()")
    assert not PRIVATE_READ.search("trace._module_call_frames") and not PRIVATE_READ.search("trace._model_params")
    assert not PRIVATE_READ.search("trace.module_call_indices[i]")


def _traced():
    torch.manual_seed(0)
    return tl.trace(LoopRNN(steps=3), torch.randn(2, 8), record_finite=True, grads=True)


def test_each_accessor_is_its_column_and_agrees_with_the_records():
    log = _traced()
    for accessor, column in ACCESSORS.items():
        assert getattr(log, accessor) is getattr(log, column), accessor
    assert log.op_children == log._children()
    assert log.labels == log.op_labels and log.labels is not log.op_labels
    for op in log.ops:
        i = op.index
        assert log.labels[i] == op.label and log.op_layer_labels[i] == op.layer_label
        assert [log.labels[p] for _, p in log.op_parents[i]] == op.parents
        assert [log.labels[c] for c in log.op_children[i]] == op.children
        m = log.module_call_indices[i]
        assert (log.module_calls[m] if m >= 0 else None) == op.module_call
        assert log.pass_numbers[i] == op.pass_index and log.func_names[i] == op.func_name
        assert log.group_sizes[log.groups[i]] == op.num_passes
        assert torch.equal(log.saved_activations[i], op.activation)
    assert log.group_sizes[log.groups[log.labels.index("linear_1_2:3")]] == 3
    assert set(log.finite_flags) == set(range(len(log))) - {i for i, k in enumerate(log.kinds) if k == 3}
    assert log.param_addresses[log.labels.index("linear_1_2:1")] == ("cell.weight", "cell.bias")


def test_every_record_with_ops_names_their_labels_in_op_labels():
    # A layer of three passes answered op_labels from its first op, which has none (AttributeError).
    log = _traced()
    records = [*log.layers, *log.module_calls, *log.params]
    assert any(layer.num_passes == 3 for layer in log.layers)
    for record in records:
        assert record.op_labels == [op.label for op in record.ops], record
    assert log["linear_1_2"].op_labels == ["linear_1_2:1", "linear_1_2:2", "linear_1_2:3"]


def test_keep_activations_releases_the_rest():
    log = _traced()
    log.keep_activations({0, 1})
    assert set(log.saved_activations) == {0, 1}
    assert log.ops[1].has_activation and not log.ops[2].has_activation


def _record_owned_attributes() -> set:
    """Every ``self.X = ...`` the Trace class itself makes (in ``__init__`` or any of its methods)."""
    tree = ast.parse((SRC / "record" / "trace.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trace")
    return {t.attr for node in ast.walk(cls) if isinstance(node, (ast.Assign, ast.AugAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for t in ast.walk(target)
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_every_attribute_set_on_a_trace_from_outside_record_is_declared_on_the_class(tmp_path):
    log = _traced()
    log.backward(log.output.sum())
    log.flops, str(log), log.summary()
    log.save(tmp_path / "t")
    loaded = tl.load(tmp_path / "t")
    log.cleanup()
    log.save(tmp_path / "cleaned")  # saved without its parameters' gradients: the loaded trace says why
    cleaned = tl.load(tmp_path / "cleaned")
    owned = _record_owned_attributes()
    for trace in (log, loaded, cleaned):
        undeclared = sorted(name for name in vars(trace) if name not in owned and not hasattr(Trace, name))
        assert not undeclared, f"set on a Trace from outside record/ but not declared on the class: {undeclared}"
    assert log._flops_col is not None and loaded.loaded_from is not None and log._root_class == "LoopRNN"


def test_output_producer_refuses_what_is_not_an_output_node():
    # Any op's index was read as an output node: an op's first parent came back as its "producer", an input
    # (no parents) raised a bare IndexError, and a label a bare TypeError from the list.
    log = _traced()
    out = log.outputs[0].index
    assert log.output_producer(out) == log.labels.index(log.outputs[0].parents[0])
    assert log.output_producer(out - len(log)) == log.output_producer(out)
    linear = log.labels.index("linear_1_2:2")
    for index in (linear, 0, len(log)):
        with pytest.raises(ValueError, match=rf"index={index} is not an output node.*are \[{out}\]"):
            log.output_producer(index)
    for index in (True, "output_1:1", 1.0, None):
        with pytest.raises(TypeError, match="output_producer: index=.* not an int; give the op index of an output"):
            log.output_producer(index)


def test_a_record_is_in_the_trace_that_made_it_and_in_no_other():
    # `log["linear_1_2:1"] in log` was False: a record is no label string, so it was looked up as a key and refused.
    log, other = _traced(), _traced()
    records = [log["linear_1_2:1"], log["linear_1_2"], log.module_calls[0], log.modules[0], log.params[0]]
    assert all(record in log for record in records)
    assert not any(record in other for record in records)
    assert "linear_1_2:1" in log and 0 in log and len(log) not in log and "linear_9_9:1" not in log


class _Pair(torch.nn.Module):
    def forward(self, x):
        return x * 2, x * 3


class _PairThenNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pair, self.bn = _Pair(), torch.nn.BatchNorm1d(4)

    def forward(self, x):
        a, b = self.pair(x)
        return self.bn(a - b)


def test_a_call_returning_several_tensors_is_named_by_its_first_and_a_buffer_path_by_log_buffers():
    # As a forward hook's output[0]: the first tensor a call returned. A buffer's address names no op: the
    # lookup refuses it and says where its record is.
    log = tl.trace(_PairThenNorm().eval(), torch.randn(2, 4))
    assert log["pair"].label == log["pair:1"].label == "mul_1_1:1"
    with pytest.raises(KeyError, match="bn.running_mean is a buffer, whose record is in log.buffers"):
        log["bn.running_mean"]


def test_drop_written_refuses_what_is_not_a_list_of_op_indices():
    # A lone index raised "'int' object is not iterable", and a label ("ab" read letter by letter), a bool, a float
    # or an index past the trace was passed over: drop_written seemed to have looked where it never did.
    log = _traced()
    log.drop_written([0, -1, len(log) - 1])
    for indices in (3, "linear_1_2:1", b"\x00"):
        with pytest.raises(TypeError, match=r"drop_written: indices=.* not a list of op indices; give a list"):
            log.drop_written(indices)
    for index in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match=r"drop_written: index=.* not an int; give a list of op indices below"):
            log.drop_written([index])
    for index in (len(log), -len(log) - 1):
        with pytest.raises(ValueError, match=rf"drop_written: index={index} is not an op of this trace"):
            log.drop_written((index,))


def test_inputs_and_outputs_are_indexed_as_the_ops_are():
    # log.inputs[True] was the second input and log.outputs["output_1:1"] raised the list's own "list indices must
    # be integers or slices, not str", where log.ops refuses both; what they hold is unchanged.
    class TwoInTwoOut(torch.nn.Module):
        def forward(self, a, b):
            return a + b, a * b

    log = tl.trace(TwoInTwoOut(), (torch.randn(3), torch.randn(3)))
    for records, kind in ((log.inputs, "input"), (log.outputs, "output")):
        ops = [op for op in log.ops if op.kind == kind]
        assert len(records) == 2 and records == ops and list(records) == ops and records[-1] == ops[-1]
        assert [op.label for op in records[:1]] == [ops[0].label]
        for flag in (True, False):
            with pytest.raises(TypeError, match=r"index the Op records with an int or a slice, not a bool"):
                records[flag]
        with pytest.raises(TypeError, match=r"indexed by position \(an int or a slice\), not by name: log\["):
            records[ops[0].label]
        with pytest.raises(IndexError, match=r"Op index 2 is out of range: this trace has 2 Op records"):
            records[2]
        assert list(records.to_pandas()["label"]) == [op.label for op in ops]
