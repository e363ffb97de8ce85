"""torchlens's module records, witnessed by ``torch.utils.module_tracker.ModuleTracker``.

Each zoo model is traced inside a ``ModuleTracker``.  Our own global forward hooks, registered after the
tracker's, snapshot its ``parents`` set (with a timestamp) whenever a module is entered or left; the set in
effect when an op started is the tracker's view of that op's module stack.  It must equal the unordered
set of module addresses torchlens recorded for the op.  No ``TorchFunctionMode`` samples the tracker: only
hooks, so the witness cannot change which code paths the model takes.

Documented exceptions, none of them in the zoo: a module re-entered while already active (recursion;
the tracker's set cannot hold it twice); a module that is not a descendant of the root (the tracker names
it by bare class name).  Cases that agree by construction and are checked below: one instance registered
under two names (the tracker uses the first name, torchlens's ``Module.all_addresses`` holds both) and a
direct ``.forward()`` call (no hooks fire, so neither side sees a module call).  By design, the ops a module's own
forward hooks run are inside torchlens's call of it and outside the tracker's, whose global hook left it already.

torchlens must stay strictly richer: call order, an instance map, and the call index of a reused module.
"""

from __future__ import annotations

import bisect
from time import perf_counter_ns

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.module_tracker import ModuleTracker

import torchlens as tl
from zoo import zoo


def trace_under_tracker(model, args, kwargs=None):
    """Trace ``model`` inside a ModuleTracker; return the trace and the tracker's timestamped snapshots."""
    events = []
    with ModuleTracker() as tracker:
        def snapshot(*_):
            events.append((perf_counter_ns(), frozenset(tracker.parents)))

        handles = [register_module_forward_pre_hook(snapshot), register_module_forward_hook(snapshot)]
        try:
            log = tl.trace(model, args, kwargs)
        finally:
            for handle in handles:
                handle.remove()
    return log, events


def tracker_addresses(names, log, root_name) -> frozenset:
    """Tracker FQNs (``Global``, ``Root``, ``Root.a.b``) as torchlens module addresses."""
    by_alias = {alias: module.address for module in log.modules for alias in module.all_addresses}
    out = set()
    for name in names:
        if name in ("Global", root_name):
            continue
        out.add(by_alias[name.split(".", 1)[1]])
    return frozenset(out)


def torchlens_addresses(op) -> frozenset:
    out, call = set(), op.module_call
    while call is not None:
        out.add(call.module.address)
        call = call.parent
    return frozenset(out)


def tracker_set_at(events, t_ns):
    times = [t for t, _ in events]
    i = bisect.bisect_right(times, t_ns) - 1
    return events[i][1] if i >= 0 else frozenset()


@pytest.mark.parametrize("name", sorted(zoo()))
def test_per_op_module_sets_equal_the_trackers(name):
    model, args, kwargs = zoo()[name]
    log, events = trace_under_tracker(model, args, kwargs)
    root_name = type(model).__name__
    ops = [op for op in log.ops if op.kind == "op"]
    assert ops
    for op in ops:
        seen = tracker_addresses(tracker_set_at(events, op.start_ns), log, root_name)
        assert seen == torchlens_addresses(op), op.label


@pytest.mark.parametrize("name", sorted(zoo()))
def test_module_entries_match_torchlens_call_order_and_counts(name):
    model, args, kwargs = zoo()[name]
    log, events = trace_under_tracker(model, args, kwargs)
    root_name = type(model).__name__
    entered, previous = [], frozenset()
    for _, parents in events:
        new = parents - previous
        entered += sorted(tracker_addresses(new, log, root_name))
        previous = parents
    chronological = sorted(log.module_calls, key=lambda call: call.start_ns)
    assert entered == [call.module.address for call in chronological]
    for module in log.modules:
        assert entered.count(module.address) == module.num_calls


def test_torchlens_tells_apart_calls_the_tracker_merges():
    model, args, kwargs = zoo()["shared_module"]
    log, events = trace_under_tracker(model, args, kwargs)
    fc_ops = [op for op in log.ops if op.kind == "op" and op.module_call and op.module_call.address == "fc"]
    tracker_sets = {tracker_set_at(events, op.start_ns) for op in fc_ops}
    assert len(fc_ops) == 3 and len(tracker_sets) == 1  # the tracker: three ops, one indistinct set
    assert [op.module for op in fc_ops] == ["fc:1", "fc:2", "fc:3"]  # torchlens: the call index
    assert [op.module_call.call_index for op in fc_ops] == [1, 2, 3]
    starts = [call.start_ns for call in log.module_calls]
    assert starts == sorted(starts)  # chronological call order
    fc = log["fc"]
    assert fc.num_calls == 3 and fc.call_labels == ["fc:1", "fc:2", "fc:3"]  # instance -> its calls


class Aliased(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = self.first  # one instance, two names

    def forward(self, x):
        return self.second(x).relu()


class DirectForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc.forward(x) * 2  # no hooks fire: not a module call, for either side


def test_documented_exceptions_agree_through_the_instance_map():
    log, events = trace_under_tracker(Aliased(), torch.randn(2, 4))
    linear = next(op for op in log.ops if op.func_name == "linear")
    assert tracker_addresses(tracker_set_at(events, linear.start_ns), log, "Aliased") == {"first"}
    assert torchlens_addresses(linear) == {"first"}
    assert log.modules[0].all_addresses == ["first", "second"]  # torchlens keeps both names

    log, events = trace_under_tracker(DirectForward(), torch.randn(2, 4))
    for op in log.ops:
        if op.kind == "op":
            assert tracker_addresses(tracker_set_at(events, op.start_ns), log, "DirectForward") == frozenset()
            assert op.module_call is None


@pytest.mark.parametrize("name", ["gpt2", "bert", "whisper", "lstm"])
def test_real_models_module_sets_equal_the_trackers(name):
    # The zoo's modules are shallow; transformers models nest blocks in ModuleLists, run an encoder and a decoder
    # (Whisper) and compute attention outside any submodule; nn.LSTM's ops include its hidden-state zeros.
    import real_models

    model, args, kwargs = real_models.build(name)
    model.eval()
    log, events = trace_under_tracker(model, args, kwargs)
    root_name = type(model).__name__
    ops = [op for op in log.ops if op.kind == "op"]
    assert len(ops) > 5 and any(torchlens_addresses(op) for op in ops)
    for op in ops:
        tracked = tracker_addresses(tracker_set_at(events, op.start_ns), log, root_name)
        assert tracked == torchlens_addresses(op), op.label


def test_a_modules_own_forward_hook_ops_are_the_one_difference_by_design():
    import real_models

    model = real_models.small_gpt2_lm()
    block = model.transformer.h[0]
    handle = block.mlp.register_forward_hook(lambda module, args, output: output * 0.5)
    try:
        log, events = trace_under_tracker(model, (torch.randint(0, 64, (1, 5)),))
    finally:
        handle.remove()
    differ = []
    for op in log.ops:
        if op.kind == "op":
            tracked = tracker_addresses(tracker_set_at(events, op.start_ns), log, type(model).__name__)
            if tracked != torchlens_addresses(op):
                differ.append((op.func_name, op.module, sorted(torchlens_addresses(op) - tracked)))
    assert differ == [("mul", "transformer.h.0.mlp:1", ["transformer.h.0.mlp"])]
