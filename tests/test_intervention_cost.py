"""What resolving and checking label sites costs grows with the sites, not with the sites times the model.

Each test counts the work a site does (links of the module-call chain built, function names read) on a
model where a per-site search would multiply it, and checks the intervened run is still the plain one.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
import torchlens as tl  # noqa: E402
from zoo import LoopRNN  # noqa: E402


class _Nested(nn.Module):
    """``depth`` modules, each calling the next; the innermost runs ``ops`` elementwise ops."""

    def __init__(self, depth: int, ops: int):
        super().__init__()
        self.ops = ops
        self.inner = _Nested(depth - 1, ops) if depth > 1 else None

    def forward(self, x):
        if self.inner is not None:
            return self.inner(x)
        for _ in range(self.ops):
            x = torch.tanh(x)
        return x


def test_sites_at_every_op_of_a_deep_module_build_each_module_calls_link_once(monkeypatch):
    # Each label site built the chain of module calls open around its op from the trace, link by link: a
    # predicate accepting the n ops of a call nested d deep built n * d links (the resolution was the larger
    # part of what an identity at every op cost).  The ops of one call, and the calls of one parent, now share
    # what was built once.
    from torchlens.intervene import sites

    depth, ops = 12, 40
    model, x = _Nested(depth, ops), torch.randn(2, 3)
    reference = tl.trace(model, x)
    built = []
    real_link = sites.ChainLink
    monkeypatch.setattr(sites, "ChainLink", lambda *a: built.append(1) or real_link(*a))
    log = tl.trace(model, x, reference=reference, intervene={(lambda op: op.type == "tanh"): tl.scale(1.0)})
    assert len(log.interventions) == ops
    assert len(built) <= depth
    assert torch.equal(log.output, model(x))
    deepest = "inner." * (depth - 1)
    assert log["tanh_1_1:1"].module == deepest[:-1] + ":1"


def test_sites_at_consecutive_calls_read_each_calls_function_once_and_a_stop_there_agrees(monkeypatch):
    # The check that each site's call is the reference's counted the calls of each function from each line:
    # a site at every call read every call's function name twice (once for its own site, once again when the
    # next site counted the calls before it).  A stop site at an intervention's call asks for the same count.
    from torchlens.intervene import runtime

    steps = 30
    model, x = LoopRNN(steps=steps).eval(), torch.randn(2, 8)
    reference = tl.trace(model, x)
    calls = len(reference.calls)
    named = []
    real_name = runtime.func_name_of
    monkeypatch.setattr(runtime, "func_name_of", lambda f: named.append(1) or real_name(f))
    log = tl.trace(model, x, reference=reference, intervene={(lambda op: True): lambda t, op: None})
    assert len(log.interventions) == calls and len(named) <= calls + 1
    assert torch.equal(log.output, reference.output)
    last_pass = f"tanh_1_4:{steps}"
    stopped = tl.trace(model, x, reference=reference, stop_after=last_pass, intervene={last_pass: tl.scale(0.0)})
    assert stopped.stopped_after == last_pass and torch.equal(stopped[last_pass].activation, torch.zeros(2, 8))


def test_a_trace_with_module_sites_only_keeps_the_hot_path_for_every_op(monkeypatch):
    # Module sites are applied by forward hooks on their modules and need no look at any op, so a trace with
    # module sites only runs every op on the hot path (the compiled handler, where built), as a plain trace
    # does; label sites keep it too (test_label_sites_keep_every_call_on_the_hot_path).
    from torchlens.capture.mode import CaptureMode
    from zoo import MLP

    torch.manual_seed(0)  # unseeded, some draws gave an MLP whose ReLUs all shut behind layers.2: no edit showed
    model, x = MLP(width=8, depth=6).eval(), torch.randn(2, 8)
    general = []
    real_general = CaptureMode._call_with_features
    counted = lambda self, *a: general.append(1) or real_general(self, *a)  # noqa: E731
    monkeypatch.setattr(CaptureMode, "_call_with_features", counted)
    plain = tl.trace(model, x)
    assert not general
    hooked = model.layers[2].register_forward_hook(lambda module, args, out: out * 0.5)
    try:
        expected = model(x)
    finally:
        hooked.remove()
    edited = tl.trace(model, x, intervene={"layers.2": tl.scale(0.5)})
    assert not general
    assert torch.equal(edited.output, expected) and not torch.equal(edited.output, plain.output)
    assert torch.equal(edited["layers.2"].original, plain["layers.2"].activation)
    assert [a.label for a in edited.interventions] == [plain["layers.2"].label]
    tl.trace(model, x, reference=plain, intervene={plain["layers.2"].label: tl.scale(0.5)})
    assert not general  # a label site's call is recorded on the hot path, then its action applied


def _loop_with_zeroed_pass(model, x, zeroed: int):
    """LoopRNN's forward by hand, its tanh zeroed at pass ``zeroed`` (from 1)."""
    h = torch.zeros_like(x)
    for step in range(1, model.steps + 1):
        h = torch.tanh(model.cell(x) + h)
        h = (torch.zeros_like(h) if step == zeroed else h) * 0.5
    return h


def test_label_sites_keep_every_call_on_the_hot_path(monkeypatch):
    # The calls at label sites' positions took the general path, which costs several times the hot path's
    # recording (the compiled handler's, where built): an action at every op cost each op that on top of the
    # action.  A site's call is now recorded on the hot path as any other, then handed to the interventions.
    from torchlens.capture.mode import CaptureMode

    model, x = LoopRNN(steps=4).eval(), torch.randn(2, 8)
    reference = tl.trace(model, x)
    general = []
    real_general = CaptureMode._call_with_features
    counted = lambda self, func, *a: general.append(func.__name__) or real_general(self, func, *a)  # noqa: E731
    monkeypatch.setattr(CaptureMode, "_call_with_features", counted)
    sites = {"tanh_1_4:3": tl.zero_ablate(), "linear_1_2:2": tl.scale(1.0)}
    log = tl.trace(model, x, reference=reference, intervene=sites)
    assert general == []
    assert torch.equal(log.output, _loop_with_zeroed_pass(model, x, 3))
    assert [a.label for a in log.interventions] == ["linear_1_2:2", "tanh_1_4:3"]
    assert torch.equal(log["tanh_1_4:3"].original, reference["tanh_1_4:3"].activation)
    assert [op.label for op in log.ops] == [op.label for op in reference.ops]
    general.clear()
    stopped = tl.trace(model, x, reference=reference, stop_after="add_1_3:4",
                       intervene={"tanh_1_4:1": tl.zero_ablate()})
    assert general == [] and stopped.stopped_after == "add_1_3:4"


def test_an_intervened_trace_derives_its_labels_only_when_read():
    # Every intervened trace derived all its labels as it ended, to name the op of each applied intervention,
    # where a plain trace leaves them until read.  Each is now named when read from the trace, and keeps its name
    # once the trace is gone.
    model, x = LoopRNN(steps=4).eval(), torch.randn(2, 8)
    reference = tl.trace(model, x)
    log = tl.trace(model, x, reference=reference, intervene={"tanh_1_4:3": tl.zero_ablate(), "cell": tl.scale(1.0)})
    assert "_labels" not in vars(log)
    assert log.ops[reference["tanh_1_4:3"].index].intervention.label == "tanh_1_4:3"
    applied = log.interventions
    del log
    assert [a.label for a in applied] == ["linear_1_2:1", "linear_1_2:2", "linear_1_2:3", "tanh_1_4:3", "linear_1_2:4"]
    assert [a.site for a in applied] == ["cell"] * 3 + ["tanh_1_4:3", "cell"]


def test_plain_function_actions_and_predicates_are_checked_without_building_a_signature(monkeypatch):
    # Each intervened trace built an inspect.signature for its predicate and its action, to refuse one that
    # cannot take its arguments before the run: tens of us per trace.  A plain function's arity is now read from
    # its code object; any other callable, and a refusal's message, still go through the signature.
    import inspect

    from torchlens.checks import _plainly_takes

    def keyword_only(t, op, *, scale):
        return None

    def with_defaults(t, op=None, *rest, scale=1.0):
        return None

    callables = [lambda t, op: None, lambda t: None, lambda *a: None, lambda t, op, k: None, keyword_only,
                 with_defaults, print]
    for func in callables:  # never a pass that the signature refuses
        for count in (1, 2, 3):
            try:
                inspect.signature(func).bind(*[None] * count)
                takes = True
            except (TypeError, ValueError):
                takes = False
            assert takes or not _plainly_takes(func, count), (func, count)
    model, x = LoopRNN(steps=2).eval(), torch.randn(2, 8)
    reference = tl.trace(model, x)

    def no_signature(*args, **kwargs):
        raise AssertionError("a signature was built")
    monkeypatch.setattr(inspect, "signature", no_signature)
    log = tl.trace(model, x, reference=reference, intervene={(lambda op: op.type == "tanh"): lambda t, op: t * 0.5})
    assert [a.label for a in log.interventions] == ["tanh_1_4:1", "tanh_1_4:2"]
    assert torch.equal(log["tanh_1_4:2"].activation, log["tanh_1_4:2"].original * 0.5)


class _Shared(nn.Module):
    """One block registered under two names (its children answer to both prefixes), in a ModuleList too."""

    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.second = self.first
        self.stack = nn.ModuleList([self.first, nn.Linear(4, 4)])

    def forward(self, x):
        return self.stack[1](self.second(self.first(x)))


def test_module_sites_are_resolved_from_the_cached_index_to_every_address_a_walk_finds(monkeypatch):
    # Each intervened trace walked the model's named_modules to resolve its module sites (some 3 us per module,
    # 200 us on a 60-module GPT-2): the model's cached index lists the same addresses, aliases included.
    from torchlens.intervene.sites import _site_modules
    from torchlens.record.model_index import index_of

    model = _Shared()
    walked, _ = _site_modules(model)
    indexed, compiled = _site_modules(model, index_of(model))
    assert compiled == {} and indexed.keys() == walked.keys() and "second.0" in indexed and "stack.0.1" in indexed
    assert all(indexed[name] is module for name, module in walked.items())
    calls = []
    monkeypatch.setattr(nn.Module, "named_modules", lambda *a, **k: calls.append(a) or iter(()))
    x = torch.randn(2, 4)
    log = tl.trace(model, x, intervene={"second.0": tl.scale(0.0)})
    assert calls == [] and [a.label for a in log.interventions] == ["linear_1_1:1", "linear_1_1:2"]
    assert torch.equal(log.output, model.stack[1](model.first[1](torch.zeros(2, 4))))


def test_a_module_put_in_after_a_trace_is_a_site_of_the_next():
    # The index is walked again when the tree changes, so a site at a module replaced since edits the new one.
    model, x = _Shared(), torch.randn(2, 4)
    tl.trace(model, x, intervene={"stack.1": tl.scale(2.0)})
    model.stack[1] = nn.Linear(4, 4)
    log = tl.trace(model, x, intervene={"stack.1": tl.zero_ablate()})
    assert torch.equal(log.output, torch.zeros(2, 4))
