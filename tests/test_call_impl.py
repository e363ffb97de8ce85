"""Module calls through the replaced ``nn.Module._call_impl`` (``capture/call_impl.py``).

The replacement must be in place exactly while a trace runs (shared by traces in several threads, gone
when the last ends, out of Dynamo's sight while a compiled region compiles), reach classes that define
their own ``_call_impl``, and record a module call as its caller sees it: the module's own hooks run
inside the call.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from torchlens.capture import call_impl  # noqa: E402
from untouched import CALL_IMPL, CALL_IMPL_CODE, assert_clean_process, assert_untouched, snapshot  # noqa: E402
from zoo import Pair  # noqa: E402


def _owner_of(op) -> str | None:
    call = op.module_call
    return call.label if call is not None else None


# ----- the module's own hooks run inside its call ------------------------------------------------
def test_a_forward_hook_runs_inside_its_module_call_and_its_result_is_the_calls_output():
    model, x = Pair(), torch.randn(2, 4)
    handle = model.fc.register_forward_hook(lambda module, args, output: output * 2)
    try:
        expected = model(x)
        before = snapshot(model, (x,))
        log = tl.trace(model, x)
        assert_untouched(before, snapshot(model, (x,)))
    finally:
        handle.remove()
    assert torch.equal(log.output, expected)
    ops = {op.type: op for op in log.ops if op.kind == "op"}
    assert _owner_of(ops["mul"]) == "fc:1"  # the hook's op belongs to the call it ran in
    assert log.module_calls[0].output_ops == [ops["mul"].label]  # what the caller received
    assert log.module_calls[1].input_ops == [ops["mul"].label]  # ... and passed on
    assert log.module_calls[0].start_ns <= log[ops["mul"].label].start_ns <= log.module_calls[0].end_ns


def test_a_forward_pre_hook_runs_inside_its_module_call_and_the_calls_input_is_the_callers():
    model, x = Pair(), torch.randn(2, 4)
    handle = model.act.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    try:
        expected = model(x)
        log = tl.trace(model, x)
    finally:
        handle.remove()
    assert torch.equal(log.output, expected)
    ops = {op.type: op for op in log.ops if op.kind == "op"}
    act = log.module_calls[1]
    assert _owner_of(ops["add"]) == "act:1"
    assert act.input_ops == [ops["linear"].label]  # what the caller passed, before the hook replaced it
    assert act.output_ops == [ops["tanh"].label]
    assert ops["add"].parents == [ops["linear"].label]


def test_a_global_hook_of_the_users_runs_inside_each_module_call():
    from torch.nn.modules.module import register_module_forward_hook

    model, x = Pair(), torch.randn(2, 4)
    handle = register_module_forward_hook(lambda module, args, output: output + 0 if module is model.fc else None)
    try:
        expected = model(x)
        log = tl.trace(model, x)
    finally:
        handle.remove()
    assert torch.equal(log.output, expected)
    add = next(op for op in log.ops if op.type == "add")
    assert _owner_of(add) == "fc:1" and log.module_calls[0].output_ops == [add.label]


def test_a_module_whose_own_hooks_run_its_forward_from_torchs_inner_names_its_childrens_call_site():
    """With a hook on the Sequential its forward runs from ``_call_impl``'s ``inner``: its children's calls
    are still made at the Sequential's own call site."""
    x = torch.randn(2, 4)

    def lines(hooked: bool) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        if hooked:
            model.register_forward_pre_hook(lambda module, args: None)
        outer = nn.ModuleDict({"seq": model})
        log = tl.trace(lambda t: outer["seq"](t), x, root=outer)
        return [(op.label, op.source.line if op.source else None) for op in log.ops]

    plain, hooked = lines(False), lines(True)
    assert plain == hooked
    assert all(line is not None for label, line in plain if not label.startswith(("input", "output"))), plain


# ----- classes with their own _call_impl --------------------------------------------------------
class CallsSuper(nn.Linear):
    """Overrides _call_impl and reaches nn.Module's through super()."""

    def _call_impl(self, *args, **kwargs):
        return super()._call_impl(*args, **kwargs) + 1


def _wrapped(impl):
    @functools.wraps(impl)
    def run(self, *args, **kwargs):
        return impl(self, *args, **kwargs) * 2
    return run


class WrapsOriginal(nn.Linear):
    """Holds a wrapper of torch's _call_impl (what ``torch.compiler.disable`` does to a module class)."""

    _call_impl = _wrapped(nn.Module._call_impl)


class ChildOfWrapping(WrapsOriginal):
    """Reaches its base class's _call_impl: that class's attribute is replaced."""


class Overriding(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = CallsSuper(4, 4)
        self.b = WrapsOriginal(4, 4)
        self.c = ChildOfWrapping(4, 4)
        self.d = nn.Linear(4, 4)

    def forward(self, x):
        return self.d(self.c(self.b(self.a(x))))


def test_classes_that_define_their_own_call_impl_are_module_calls_once_each():
    model, x = Overriding(), torch.randn(2, 4)
    own = {cls: vars(cls)["_call_impl"] for cls in (CallsSuper, WrapsOriginal)}
    expected = model(x)
    log = tl.trace(model, x)
    assert torch.equal(log.output, expected)
    assert [mc.label for mc in log.module_calls] == ["a:1", "b:1", "c:1", "d:1"]
    owners = [(op.type, _owner_of(op)) for op in log.ops if op.kind == "op"]
    # The override's own op (CallsSuper's + 1, WrapsOriginal's * 2) is inside the call.
    assert owners == [("linear", "a:1"), ("add", "a:1"), ("linear", "b:1"), ("mul", "b:1"),
                      ("linear", "c:1"), ("mul", "c:1"), ("linear", "d:1")], owners
    assert [mc.parent for mc in log.module_calls] == [None] * 4
    assert all(vars(cls)["_call_impl"] is impl for cls, impl in own.items())  # each class's own is back
    assert "_call_impl" not in vars(ChildOfWrapping)
    assert_clean_process()


def test_a_class_compiled_with_disable_is_a_module_call():
    torch.manual_seed(0)

    @torch.compiler.disable
    class Disabled(nn.Linear):
        pass

    model, x = nn.Sequential(Disabled(4, 4), nn.ReLU()), torch.randn(2, 4)
    own = vars(Disabled)["_call_impl"]
    log = tl.trace(model, x)
    assert torch.equal(log.output, model(x))
    assert [mc.label for mc in log.module_calls] == ["0:1", "1:1"]
    assert vars(Disabled)["_call_impl"] is own
    assert_clean_process()


def test_a_call_impl_that_is_not_a_function_is_named_in_a_warning():
    class Odd(nn.Linear):
        _call_impl = staticmethod(lambda *args, **kwargs: None)  # never called below

    model = nn.Sequential(nn.Linear(4, 4))
    model.add_module("odd", Odd(4, 4))
    with pytest.warns(UserWarning, match="_call_impl of .*Odd is not a function"):
        tl.trace(lambda t: model[0](t), torch.randn(2, 4), root=model)
    assert_clean_process()


# ----- in place exactly while a trace runs --------------------------------------------------------
class Probe(nn.Module):
    """Looks at nn.Module._call_impl from inside the forward, and calls a module from another thread."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append(call_impl.receiver() is not CALL_IMPL)
        other = []
        side = threading.Thread(target=lambda: other.append(self.fc(x)))
        side.start()
        side.join()
        return self.fc(x) + other[0]


def test_the_replacement_is_in_place_only_during_the_trace_and_other_threads_are_not_recorded():
    model, x = Probe(), torch.randn(2, 4)
    assert vars(nn.Module)["_call_impl"] is CALL_IMPL
    log = tl.trace(model, x)
    assert model.seen == [True]
    assert [mc.label for mc in log.module_calls] == ["fc:1"]  # the other thread's call is not one
    assert vars(nn.Module)["_call_impl"] is CALL_IMPL and not call_impl.installed()
    assert not any(site.threads or site.recorders for site in call_impl._sites.values())


def test_only_the_code_of_torchs_function_is_swapped_while_a_trace_runs():
    """No class attribute is written (that would invalidate every module class's attribute cache): the
    function stays torch's object with torch's signature, and runs torch's code again after the trace."""
    import inspect

    signature, seen = str(inspect.signature(CALL_IMPL)), []

    class Look(nn.Module):
        def forward(self, x):
            seen.append((vars(nn.Module)["_call_impl"] is CALL_IMPL, CALL_IMPL.__code__ is not CALL_IMPL_CODE,
                         str(inspect.signature(CALL_IMPL))))
            return x + 1

    log = tl.trace(nn.Sequential(Look()), torch.randn(2))
    assert seen == [(True, True, signature)]
    assert [mc.label for mc in log.module_calls] == ["0:1"]
    assert CALL_IMPL.__code__ is CALL_IMPL_CODE and not call_impl.installed()
    assert_clean_process()


def test_the_swapped_code_can_be_hashed_as_profilers_and_dynamo_hash_code_objects():
    """A code object hashes its constants: the relay's slot is one of them, so it must hash (a list would
    make every ``{frame.f_code}`` of a profiler raise inside a traced forward)."""
    codes = []

    def profile(frame, event, arg):
        if event == "call":
            codes.append(frame.f_code)

    class Look(nn.Module):
        def forward(self, x):
            codes.append(CALL_IMPL.__code__)
            return x + 1

    sys.setprofile(profile)
    try:
        tl.trace(nn.Sequential(Look()), torch.randn(2))
    finally:
        sys.setprofile(None)
    relay = [c for c in codes if c is not CALL_IMPL_CODE and c.co_name == CALL_IMPL_CODE.co_name]
    assert relay and len({*codes}) <= len(codes)  # hashed, each one
    assert hash(relay[0]) == hash(relay[0]) and relay[0] == relay[0]


def test_the_replacement_stays_while_another_thread_still_traces():
    entered, release, seen = threading.Event(), threading.Event(), []

    class Gate(nn.Module):
        def forward(self, x):
            if threading.current_thread().name == "long":
                entered.set()
                release.wait(10)
                seen.append(call_impl.receiver() is not CALL_IMPL)
            return x + 0

    model = nn.Sequential(nn.Linear(4, 4), Gate(), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    logs = {}
    long = threading.Thread(target=lambda: logs.setdefault("long", tl.trace(model, x)), name="long")
    long.start()
    assert entered.wait(10)
    logs["short"] = tl.trace(model, x)  # begins after the long trace and ends before it
    release.set()
    long.join(10)
    assert seen == [True]
    labels = [mc.label for mc in logs["long"].module_calls]
    assert labels == [mc.label for mc in logs["short"].module_calls] == ["0:1", "1:1", "2:1"], labels
    assert_clean_process()


def test_a_compiled_region_compiles_with_torchs_own_call_impl():
    torch._dynamo.reset() if "torch._dynamo" in sys.modules else None
    seen = []

    def backend(graph, example_inputs):
        seen.append(call_impl.receiver() is CALL_IMPL and CALL_IMPL.__code__ is CALL_IMPL_CODE)
        return graph.forward

    torch.manual_seed(0)
    block = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), backend=backend)
    model, x = nn.Sequential(nn.Linear(4, 4), block), torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        log = tl.trace(model, x)  # the first call of the compiled block: Dynamo compiles it inside the trace
    assert seen == [True]
    assert [op.type for op in log.ops if op.kind == "op"] == ["linear", "compiled"]
    assert [mc.label for mc in log.module_calls] == ["0:1", "1:1"]
    assert torch.equal(log.output, model(x))
    assert_clean_process()


def test_a_model_that_raises_leaves_nothing_and_the_note_names_the_innermost_call():
    class Fails(nn.Module):
        def forward(self, x):
            raise RuntimeError("inner failure")

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), Fails()))
    with pytest.raises(RuntimeError, match="inner failure") as info:
        tl.trace(model, torch.randn(2, 4))
    assert "module call 1.1:1" in info.value.__notes__[0]
    assert "nothing is left installed" in info.value.__notes__[0]
    assert_clean_process()
    assert not call_impl.installed() and list(call_impl._sites) in ([], [id(nn.Module)])


class _FallsBack(nn.Module):
    """Tries one block and falls back on another when it raises, as models do around optional kernels; a hook
    that returns nothing runs first."""

    def __init__(self):
        super().__init__()
        self.hook = nn.Identity()
        self.hook.forward = lambda x: None
        self.fast = nn.Sequential(nn.ReLU(), nn.Linear(5, 4))  # the wrong input size: raises after its ReLU
        self.slow = nn.Linear(4, 4)

    def forward(self, x):
        self.hook(x)
        try:
            return self.fast(x)
        except RuntimeError:
            return self.slow(x)


def test_module_calls_left_by_an_exception_the_forward_caught_are_named_as_returning_nothing():
    """A call an exception left lists no outputs, as one that returned None does: a caveat tells them apart,
    naming it and the calls inside it the exception left, and neither the others nor those a stop left."""
    model, x = _FallsBack(), torch.randn(2, 4)
    log = tl.trace(model, x)
    assert torch.equal(log.output, model(x))
    assert [(call.label, call.output_ops) for call in log.module_calls] == [
        ("hook:1", []), ("fast:1", []), ("fast.0:1", ["relu_1_1:1"]), ("fast.1:1", []), ("slow:1", ["linear_1_2:1"])]
    caught = [text for text in log.caveats if "exception that the forward caught" in text]
    assert len(caught) == 1 and "(fast:1, fast.1:1)" in caught[0] and caught[0] in str(log)
    for site in ("slow", "relu_1_1:1"):  # the stop leaves slow:1, or fast:1 and fast.0:1
        stopped = tl.trace(model, x, stop_after=site)
        named = [text for text in stopped.caveats if "exception that the forward caught" in text]
        assert named == ([] if site == "relu_1_1:1" else caught), site
    assert_clean_process()


def test_the_modules_own_call_impl_override_found_once_per_model_class():
    """Which classes replace _call_impl is read from the model's cached index: one lookup per class."""
    from torchlens.record.model_index import index_of

    model = Overriding()
    types = index_of(model).module_types()
    assert types == (Overriding, CallsSuper, WrapsOriginal, ChildOfWrapping, nn.Linear)
    assert call_impl.owners_overriding(types) == [CallsSuper, WrapsOriginal]
    assert index_of(model).module_types() is types


def test_dynamo_first_imported_during_a_trace_keeps_torchs_own_call_impl():
    """Dynamo records ``nn.Module._call_impl`` when imported, to recognise unpatched modules: imported
    inside a traced forward it would record the replacement, which teardown gives back."""
    import torch._dynamo.utils as dynamo_utils

    kept = dynamo_utils.unpatched_nn_module_call_impl

    class ImportsDynamo(nn.Module):
        def forward(self, x):
            dynamo_utils.unpatched_nn_module_call_impl = vars(nn.Module)["_call_impl"]  # what its import records
            return x + 1

    try:
        tl.trace(ImportsDynamo(), torch.randn(2))
        assert dynamo_utils.unpatched_nn_module_call_impl is CALL_IMPL
    finally:
        dynamo_utils.unpatched_nn_module_call_impl = kept


def test_a_replacement_teardown_could_not_undo_is_named_in_the_note(monkeypatch):
    """The note on an exception says what is still installed, and it is true: here a teardown that does
    nothing leaves nn.Module._call_impl replaced."""
    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("model failure")

    monkeypatch.setattr(call_impl.Replacement, "release_all", lambda self: None)
    try:
        with pytest.raises(ValueError) as info:
            tl.trace(Fails(), torch.randn(2))
        assert call_impl.receiver() is not CALL_IMPL
        assert "capture could not remove nn.Module._call_impl replaced" in info.value.__notes__[0]
    finally:
        for site in list(call_impl._sites.values()):  # what the real teardown does
            site.recorders.clear()
            site.threads.clear()
            site.update()
    assert_clean_process()


def test_no_frame_of_the_forward_outlives_the_trace():
    """Capture looks at the frames that make module calls; holding one after the trace would hold the
    driver's frame behind it, with every record, until a collector pass."""
    import gc
    import types

    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    forward = nn.Sequential.forward.__code__
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        tl.trace(model, x)
        alive = [o for o in gc.get_objects() if isinstance(o, types.FrameType) and o.f_code is forward]
    finally:
        if collecting:
            gc.enable()
    assert alive == []
