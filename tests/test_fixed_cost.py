"""What a trace no longer redoes per call stays correct: each shortcut of the per-trace path, checked
against the change that must defeat it (benchmarks/fixed_cost.py measures what they save)."""

from __future__ import annotations

import io
import sys

import torch
import torch.nn as nn

import torchlens as tl
from torchlens import progress
from torchlens.capture.teardown import Capture
from torchlens.record import model_index
from torchlens.record.model_index import index_of


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.body(x))


def test_a_renamed_entry_with_the_same_values_is_a_changed_structure():
    model = Net()
    cached = index_of(model)
    bias = model.head._parameters.pop("bias")
    model.head._parameters["shift"] = bias  # same values in the same order: only a key differs
    index = index_of(model)
    assert index is not cached
    assert index.param_addresses[id(bias)] == "head.shift"


def test_an_entry_set_where_a_none_was_registered_is_a_changed_structure():
    model = Net()
    model.body[1].register_buffer("scale", None)  # an otherwise empty dict holding None
    cached = index_of(model)
    assert index_of(model) is cached and not any(a == "body.1.scale" for _, a in cached.buffers.values())
    model.body[1].scale = torch.ones(4)
    index = index_of(model)
    assert index is not cached
    assert [a for _, a in index.buffers.values()] == ["body.1.scale"]


class WritesItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        y = x * self.weight
        with torch.no_grad():
            self.weight.mul_(3.0)  # an in-place write to a parameter, mid-forward
        return y + self.weight


def test_a_parameter_written_in_place_keeps_its_value_before_the_write_for_replay():
    model, x = WritesItsWeight(), torch.randn(3)
    log = tl.trace(model, x)
    (writes,) = log._replay.param_writes.values()
    assert [torch.equal(before, torch.full((3,), 2.0)) for _, before in writes] == [True]
    assert torch.equal(model.weight.detach(), torch.full((3,), 6.0))
    assert log.validate().passed
    # The next trace of the same (cached) model keys the parameter afresh: its storage is the same object.
    again = tl.trace(model, x)
    (writes,) = again._replay.param_writes.values()
    assert torch.equal(writes[0][1], torch.full((3,), 6.0))


def test_replacing_stderr_is_seen_by_the_next_terminal_check(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not progress.shows_bar(None)
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert progress.shows_bar(None)
    assert progress.shows_bar(True) and not progress.shows_bar(False)


def test_a_compiled_submodule_added_after_a_trace_is_routed():
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 4)
    with torch.no_grad():
        assert "compiled" not in [op.type for op in tl.trace(model, x).ops]
        model.head = torch.compile(nn.Linear(4, 2), backend="eager")
        expected = model(x)
        log = tl.trace(model, x)
    assert "compiled" in [op.type for op in log.ops]
    assert torch.equal(log.output, expected)
    assert type(vars(model.head)["forward"]).__name__ != "CompiledCall"  # restored after the trace
    assert index_of(model).of_type(type(model.head)) == [model.head]


class Part:
    def __init__(self, name, events, fail_on_enter=False):
        self.name, self.events, self.fail_on_enter = name, events, fail_on_enter

    def __enter__(self):
        self.events.append(f"enter {self.name}")
        if self.fail_on_enter:
            raise KeyboardInterrupt(self.name)
        return self

    def __exit__(self, *exc):
        self.events.append(f"exit {self.name}")
        return False


def test_capture_tears_down_once_innermost_first_on_return():
    events = []
    with Capture((Part("a", events), Part("b", events))):
        events.append("forward")
    assert events == ["enter a", "enter b", "forward", "exit b", "exit a"]


def test_capture_leaves_a_failed_enter_to_the_drivers_second_teardown():
    events = []
    capture = Capture((Part("a", events), Part("b", events, fail_on_enter=True)))
    try:
        with capture:
            events.append("forward")
    except KeyboardInterrupt:
        capture.tear_down()
    assert events == ["enter a", "enter b", "exit b", "exit a"]


def test_an_exit_interrupted_still_exits_the_other_parts_then_raises():
    events = []

    class Interrupted(Part):
        def __exit__(self, *exc):
            super().__exit__(*exc)
            raise KeyboardInterrupt("in exit")

    capture = Capture((Part("a", events), Interrupted("b", events)))
    try:
        with capture:
            pass
    except KeyboardInterrupt as exc:
        assert str(exc) == "in exit"
    assert events == ["enter a", "enter b", "exit b", "exit a"]


def test_a_traced_model_is_indexed_once_while_unchanged():
    model, x = Net().eval(), torch.randn(2, 4)
    with torch.no_grad():
        tl.trace(model, x)
        cached = model_index._cache[id(model)][2]
        tl.trace(model, x)
    assert model_index._cache[id(model)][2] is cached


def test_a_tensor_output_is_named_and_bound_as_the_walk_names_a_nested_one():
    class ReturnsBuffer(nn.Module):  # a returned buffer becomes a source only when finalize binds it
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.arange(3.0))

        def forward(self, x):
            return self.scale

    class Nested(nn.Module):
        def forward(self, x):
            return (x + 1,)

    plain = tl.trace(ReturnsBuffer(), torch.randn(3))
    assert [op.io_path for op in plain.outputs] == ["output"]
    assert [plain[p].label for p in plain.outputs[0].parents] == ["buffer_1:1"]
    assert torch.equal(plain.outputs[0].activation, torch.arange(3.0))
    assert [op.io_path for op in tl.trace(Nested(), torch.randn(3)).outputs] == ["output.0"]
