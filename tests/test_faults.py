"""Fault injection: whatever goes wrong inside a traced forward, the caller sees the original exception
(type and message, plus one torchlens note saying where it happened), capture is fully torn down, and
the model and torch behave exactly as before.

Each ``@CASE`` returns a one-line outcome; scripts/reliability_report.py collects them into
docs/reliability.md, and the last test here checks that page is current.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import threading
import weakref

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from random_models import FAULTS, Program, build, programs  # noqa: E402
from torchlens.validate import outputs_equal  # noqa: E402
from interrupts import Normalized, interrupt_every_line, signature  # noqa: E402
from reliability_cases import case, outcome, titles  # noqa: E402
from untouched import assert_clean_process, assert_untouched, snapshot  # noqa: E402
from zoo import Pair  # noqa: E402

CASE = case("Faults")


@pytest.fixture(autouse=True, scope="module")
def _collect_compile_garbage():
    """torch.compile leaves reference cycles holding weak proxies; collect them here, not during
    another module's tests (a gc callback there would meet dead proxies)."""
    yield
    gc.collect()


def traced_failure(model, args, expected: BaseException | None = None) -> BaseException:
    """Trace a model that raises; check the exception, its note, and the teardown. Returns it."""
    before = snapshot(model, args if isinstance(args, tuple) else (args,))
    with pytest.raises(BaseException) as info:
        tl.trace(model, args)
    exc = info.value
    if expected is not None:
        assert type(exc) is type(expected) and str(exc) == str(expected), \
            f"caller saw {exc!r}, the model raises {expected!r}"
    notes = getattr(exc, "__notes__", [])
    assert len(notes) == 1 and notes[0].startswith("torchlens: raised"), notes
    assert "nothing is left installed" in notes[0]
    assert_untouched(before, snapshot(model, args if isinstance(args, tuple) else (args,)))
    assert_clean_process()
    return exc


def untraced_failure(model, x) -> BaseException | None:
    try:
        model(x.clone())
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt is one of the injected faults
        return exc
    return None


# ----- an exception that refuses notes ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FrozenError(Exception):
    """An exception declared as a frozen dataclass: setting any attribute, ``__notes__`` included, raises."""

    code: int


class NotesNotAList(Exception):
    def __init__(self):
        super().__init__("notes set by the model's own code")
        self.__notes__ = ("a tuple, to which add_note cannot append",)


class RaisesAfterALayer(nn.Module):
    def __init__(self, error: BaseException):
        super().__init__()
        self.fc, self.error = nn.Linear(4, 4), error

    def forward(self, x):
        self.fc(x)
        raise self.error


@pytest.mark.parametrize("make", [lambda: FrozenError(7), NotesNotAList])
def test_an_exception_that_refuses_notes_reaches_the_caller_as_the_model_raised_it(make):
    # The failure to add the note (FrozenInstanceError; "Cannot add note: __notes__ is not a list") replaced
    # the model's exception, and the abandoned trace was never released.
    error, x = make(), torch.randn(2, 4)
    model, made = RaisesAfterALayer(error), []
    model.fc.register_forward_hook(lambda module, inputs, output: made.append(weakref.ref(output)))
    before = snapshot(model, (x,))
    with pytest.raises(type(error)) as raised:
        tl.trace(model, x)
    assert raised.value is error and getattr(error, "__notes__", None) == getattr(make(), "__notes__", None)
    assert_untouched(before, snapshot(model, (x,)))
    assert_clean_process()
    assert made and not [r for r in made if r() is not None], "the abandoned trace's activations are kept"


# ----- a fault at a random op, in a random model -------------------------------------------------
def _set_inject(model, value: bool) -> None:
    for m in model.modules():
        if "inject" in vars(m):
            m.inject = value


def check_injected_fault(program: Program) -> str | None:
    model, x = build(program)
    expected = untraced_failure(model, x)
    if expected is None:  # the fault sits in a block this model never calls
        return None
    twin, _ = build(program)
    _set_inject(twin, False)
    reference = tl.trace(twin, x.clone())

    exc = traced_failure(model, x.clone(), expected)
    body, _, kind = program.fault
    where = "the root forward"
    if body >= 0:
        block = next(m for m in model.modules() if type(m).__name__ == f"Block{body}")
        address = next(name for name, m in model.named_modules() if m is block)
        where = f"module call {address}:1"
    assert where in exc.__notes__[0], (where, exc.__notes__)
    if kind in ("torch error", "failed allocation"):
        op = "'add'" if kind == "torch error" else "'empty'"
        assert f"raised by torch call {op}" in exc.__notes__[0], exc.__notes__

    # Afterwards the same model, fault switched off, runs and traces exactly like its twin.
    _set_inject(model, False)
    assert outputs_equal(model(x.clone()), twin(x.clone()))
    assert signature(tl.trace(model, x.clone())) == signature(reference)
    return exc.__notes__[0]


@st.composite
def faulty_programs(draw):
    program = draw(programs(max_steps=6))
    body = draw(st.integers(-1, len(program.blocks) - 1))
    steps = program.root if body < 0 else program.blocks[body]
    program.fault = (body, draw(st.integers(0, len(steps))), draw(st.sampled_from(sorted(FAULTS))))
    return program


@settings(max_examples=25, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(faulty_programs())
def test_fault_at_a_random_op_of_a_random_model(program):
    assume(check_injected_fault(program) is not None)


@CASE
def fault_kinds_at_fixed_positions():
    """Every injected fault kind, raised inside a block nested two deep."""
    from random_models import Step

    notes = []
    for kind in sorted(FAULTS):
        blocks = [[Step("module", 0, 0, 0), Step("block", 0, 1, 0)], [Step("unary", 0, 0, 0)]]
        root = [Step("unary", 1, 0, 0), Step("block", 0, 1, 0)]
        program = Program(blocks, root, seed=1, fault=(1, 1, kind))
        note = check_injected_fault(program)
        assert note is not None, f"{kind} was never raised"
        notes.append(f"{kind}: {note.split(';')[0].removeprefix('torchlens: ')}")
    return "original exception re-raised; notes: " + " / ".join(notes)


# ----- hooks, interrupts and odd forwards --------------------------------------------------------
@CASE
def user_forward_hook_raises():
    """A user forward hook raises after its module ran."""
    model, x = Pair(), torch.randn(2, 4)

    def hook(module, args, output):
        raise ValueError("hook refused the output")

    handle = model.fc.register_forward_hook(hook)
    try:
        exc = traced_failure(model, x)
    finally:
        handle.remove()
    assert isinstance(exc, ValueError) and str(exc) == "hook refused the output"
    assert "module call fc:1" in exc.__notes__[0]
    assert outputs_equal(model(x), Pair()(x))
    where = exc.__notes__[0].split(" in ")[1].split(" after")[0]
    return f"ValueError re-raised unchanged; note names {where}"


@CASE
def user_forward_pre_hook_raises():
    """A user forward pre-hook raises before its module ran."""
    model, x = Pair(), torch.randn(2, 4)
    handle = model.act.register_forward_pre_hook(lambda module, args: (_ for _ in ()).throw(KeyError("no")))
    try:
        exc = traced_failure(model, x)
    finally:
        handle.remove()
    assert isinstance(exc, KeyError) and "module call act:1" in exc.__notes__[0]
    return "KeyError re-raised unchanged; note names module call act:1"


@CASE
def keyboard_interrupt_inside_capture():
    """KeyboardInterrupt at every other line capture's per-op handler and module call recorder run."""
    model, x = Pair(), torch.randn(2, 4)
    capture = tl.capture
    files = {m.__file__ for m in (capture.mode, capture.modules, capture.call_impl, capture.state, capture.fastpath)}
    setup_and_teardown = {"__enter__", "__exit__", "_release"}  # not mid-forward; see the page's notes
    interrupted = 0
    for target in range(1, 10_000, 2):
        seen = [0]

        def local(frame, event, arg):
            if event == "line":
                seen[0] += 1
                if seen[0] == target:
                    raise KeyboardInterrupt(f"interrupt at line event {target}")
            return local

        def tracer(frame, event, arg):
            code = frame.f_code
            return local if code.co_filename in files and code.co_name not in setup_and_teardown else None

        sys.settrace(tracer)
        try:
            tl.trace(model, x)
        except KeyboardInterrupt as exc:
            assert str(exc) == f"interrupt at line event {target}"
            interrupted += 1
        finally:
            sys.settrace(None)
        assert_clean_process()
        if seen[0] < target:
            break
    assert interrupted > 50, f"only {interrupted} interrupts landed in capture code"
    assert signature(tl.trace(model, x)) == signature(tl.trace(Pair(), x))
    return "every interrupt re-raised KeyboardInterrupt unchanged and left nothing installed"


class OwnCallImpl(nn.Linear):
    """Defines its own _call_impl (reaching nn.Module's through super())."""

    def _call_impl(self, *args, **kwargs):
        return super()._call_impl(*args, **kwargs)

    own = _call_impl


@CASE
def keyboard_interrupt_in_the_trace_driver():
    """KeyboardInterrupt at every line of tl.trace's setup and teardown (driver, mode stack, _call_impl, shim)."""
    capture = tl.capture
    driver = {capture.session.__file__, capture.inputs.__file__, capture.teardown.__file__,
              capture.compiled.__file__}
    parts = {capture.fastpath.__file__, capture.modules.__file__, capture.call_impl.__file__,
             capture.dispatch.__file__}
    setup_and_teardown = {"__enter__", "__exit__", "_release", "pause", "resume", "_acquire", "_release_all",
                          "update", "_unsee_in_dynamo", "owners_overriding", "unsupported_overrides",
                          "acquire", "release_all", "install", "uninstall", "_swap", "restore", "changed",
                          "_recorder_for", "_kept_recorders", "bind", "unbind", "_dispatcher"}
    model, x = Normalized(), torch.randn(2, 4)

    def traced(code):
        return code.co_filename in driver or (code.co_filename in parts and code.co_name in setup_and_teardown)

    landed = interrupt_every_line(lambda: tl.trace(model, x), traced)
    assert landed > 100, f"only {landed} interrupts landed in the trace driver"
    assert signature(tl.trace(model, x)) == signature(tl.trace(Normalized(), x))

    # A class with its own _call_impl: a second replaced attribute, set up and restored beside nn.Module's.
    overriding = nn.Sequential(Normalized(), OwnCallImpl(4, 4))
    with_override = interrupt_every_line(lambda: tl.trace(overriding, x), traced)
    assert with_override > landed, (with_override, landed)
    assert vars(OwnCallImpl)["_call_impl"] is OwnCallImpl.own
    assert [mc.label for mc in tl.trace(overriding, x).module_calls] == ["0:1", "0.fc:1", "1:1"]

    # The same with a compiled submodule: routing its forward, and running it with capture suspended.
    import warnings

    with_compiled = nn.Sequential(Normalized(), torch.compile(nn.Linear(4, 4), backend="eager"))
    expected = with_compiled(x)  # compiled before the interrupts start
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's own, as interrupts land in its compiles (.grad reads)
        in_compiled = interrupt_every_line(lambda: tl.trace(with_compiled, x), traced)
        log = tl.trace(with_compiled, x)
    assert in_compiled > landed, (in_compiled, landed)  # the routing and suspension lines were hit too
    assert torch.equal(log.output, expected) and "compiled" in [op.type for op in log.ops]
    assert "forward" in vars(with_compiled[1]) and type(vars(with_compiled[1])["forward"]).__name__ != "CompiledCall"
    return ("every interrupt re-raised unchanged; afterwards no mode, hook, replaced _call_impl (nn.Module's "
            "or a class's own) or shim installed, the collector on, the thread not marked as tracing, and the "
            "next trace identical")


@CASE
def keyboard_interrupt_in_torchs_hook_registration():
    """KeyboardInterrupt in torch's register_forward_hook and _pre_hook (module sites, module selections).

    At each line, as a trace hooks an intervention's module site or a `save=`/`grads=` module selection.  One
    landing once the hook was in the module's dict, before its handle was kept, left the hook on the module
    for good: every later call of the module ran it, traced or not (an intervention's raised IndexError)."""
    model, x = Normalized(), torch.randn(2, 4)
    registers = {nn.Module.register_forward_pre_hook.__code__, nn.Module.register_forward_hook.__code__}
    stranded = []

    def run(options):
        try:
            tl.trace(model, x, **options)
        finally:
            stranded.extend((name, options) for name, module in model.named_modules()
                            if module._forward_hooks or module._forward_pre_hooks)

    for options in ({"intervene": {"fc": tl.scale(2.0)}}, {"save": ["fc"]}, {"grads": ["fc"]}):
        landed = interrupt_every_line(lambda: run(options), lambda code: code in registers)
        assert landed > 5, (options, landed)
    assert stranded == []
    assert torch.equal(model(x), Normalized()(x))
    assert signature(tl.trace(model, x)) == signature(tl.trace(Normalized(), x))
    return ("every interrupt re-raised unchanged; the hook removed also when torch had registered it and its "
            "handle was not yet kept; the module's later calls, traced or not, run as before")


@CASE
def keyboard_interrupt_in_torch_mode_push_pop():
    """KeyboardInterrupt at every line of torch's handle_torch_function, its temporary mode pop and contextlib
    (torch's own, which a trace still meets wherever its shorter dispatcher does not answer), and at every
    line of capture's dispatcher."""
    import contextlib

    import torch.overrides

    from torchlens.capture import dispatch, teardown

    files = {torch.overrides.__file__, contextlib.__file__}
    model, x = Normalized(), torch.randn(2, 4)
    in_contextlib = lambda code: code.co_filename == contextlib.__file__  # noqa: E731
    closed, close, install = [], teardown.close_pending_pushes, dispatch.install

    def counting(mode):
        closed.append(close(mode))
        return closed[-1]

    teardown.close_pending_pushes = counting
    dispatch.install = lambda: None  # every Python-level torch function through torch's own
    try:
        landed = interrupt_every_line(lambda: tl.trace(model, x), lambda code: code.co_filename in files,
                                       collect=in_contextlib)
    finally:
        teardown.close_pending_pushes, dispatch.install = close, install
    assert landed > 20, f"only {landed} interrupts landed in torch's mode handling"
    assert any(closed), "no interrupt ever left torch's push-back suspended: the repair went untested"
    assert signature(tl.trace(model, x)) == signature(tl.trace(Normalized(), x))

    from accel_paths import on_path

    for compiled, least in ((False, 10), (True, 1)):  # its Python body, and the frame of the compiled one
        with on_path(compiled):
            in_dispatcher = interrupt_every_line(
                lambda: tl.trace(model, x), lambda code: code.co_filename == dispatch.__file__
                and code.co_name in ("handle_torch_function", "handle_torch_function_compiled", "_overloads"))
            assert in_dispatcher >= least, f"only {in_dispatcher} interrupts landed in capture's dispatcher"
            assert signature(tl.trace(model, x)) == signature(tl.trace(Normalized(), x))
    return ("every interrupt re-raised unchanged (never 'pop from empty mode stack'); the mode stack "
            "repaired, including when torch's push-back was left suspended inside contextlib; the same for "
            "capture's own dispatcher")


@CASE
def generator_forward():
    """A forward written as a generator (its body would run after tracing ended)."""

    class Gen(nn.Module):
        def forward(self, x):
            yield x + 1

    with pytest.raises(TypeError, match="returned a generator") as info:
        tl.trace(Gen(), torch.randn(2))
    assert_clean_process()
    return f"TypeError: {str(info.value).split(';')[0]}"


class SelfEditing(nn.Module):
    """Replaces one submodule, deletes another and hooks a third, all during its own forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        y = self.extra(self.fc(x))
        del self.extra
        self.fc = nn.Linear(4, 4)  # initialised under capture: its init ops are traced
        self.out.register_forward_hook(lambda m, a, o: o * 2)
        return self.out(self.fc(y))


@CASE
def model_edits_its_own_submodules():
    """The model replaces, deletes and hooks its own submodules during forward."""
    x = torch.randn(2, 4)
    twin = SelfEditing()
    torch.manual_seed(1)
    expected = twin(x)
    model = SelfEditing()
    torch.manual_seed(1)
    log = tl.trace(model, x)
    assert outputs_equal(log.output, expected)
    assert_untouched(snapshot(twin), snapshot(model))  # the model's own edits, and nothing of ours
    assert_clean_process()
    calls = [mc.label for mc in log.module_calls]
    # Addresses are those the modules had when the forward began; the Linear made mid-forward has none.
    assert calls == ["fc:1", "extra:1", "<unregistered Linear #1>:1", "out:1"], calls
    return "trace matches an untraced run; module calls " + ", ".join(f"`{c}`" for c in calls)


@CASE
def nested_trace_call():
    """tl.trace called from inside a forward that is being traced."""

    class Nested(nn.Module):
        def forward(self, x):
            return tl.trace(nn.Identity(), x).output

    with pytest.raises(tl.NestedTraceError) as info:
        tl.trace(Nested(), torch.randn(2))
    assert_clean_process()
    assert len(tl.trace(Pair(), torch.randn(2, 4)).ops) > 0  # tracing still works afterwards
    return f"NestedTraceError: {str(info.value).split(';')[0]}"


@CASE
def exception_caught_inside_the_model():
    """The model catches an error from a torch op and carries on."""

    class Fallback(nn.Module):
        def forward(self, x):
            try:
                y = torch.linalg.cholesky(x @ x.T - 10 * torch.eye(2))  # not positive definite
            except torch.linalg.LinAlgError:
                y = torch.zeros(2, 2)
            return x.sum() + y.sum()

    x = torch.randn(2, 3)
    log = tl.trace(Fallback(), x)
    assert outputs_equal(log.output, Fallback()(x))
    result = tl.validate(Fallback(), x)
    assert result.passed and result.outputs_match
    assert "cholesky" not in [op.func_name for op in log.ops]  # it produced nothing
    return f"trace completes; {len(log)} ops recorded, validation replayed {result.replayed} ops exactly"


@CASE
def exception_in_another_thread_during_a_trace():
    """A thread other than the tracing one raises inside a module while a trace runs."""
    ready, done = threading.Event(), threading.Event()
    errors = []

    class Waits(nn.Module):
        def forward(self, x):
            ready.set()
            done.wait(5)
            return x * 2

    def other():
        ready.wait(5)
        try:
            Pair()(torch.randn(3))
        except RuntimeError as exc:
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=other)
    thread.start()
    log = tl.trace(Waits(), torch.randn(2))
    thread.join()
    assert len(errors) == 1 and not getattr(errors[0], "__notes__", None)  # not annotated: not ours
    assert [op.kind for op in log.ops] == ["input", "op", "output"] and log[1].type == "mul"
    assert_clean_process()
    return "the other thread's error is its own (no note); the trace holds only the tracing thread's op"


@pytest.mark.parametrize("title", titles("Faults"))
def test_case(title):
    assert outcome("Faults", title)


def test_reliability_page_is_current():
    """docs/reliability.md is generated from the registered cases: regenerate it after changing one."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "scripts", "reliability_report.py")
    spec = importlib.util.spec_from_file_location("reliability_report", path)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    with open(os.path.join(root, "docs", "reliability.md")) as f:
        current = f.read()
    assert current == report.render(), "docs/reliability.md is stale: run scripts/reliability_report.py"


def test_the_failing_torch_call_is_numbered_as_the_trace_numbers_its_ops():
    # The note counted from 1 with the input, one past the index print(log) and log.ops give the same call
    # where it succeeds.
    class Product(nn.Module):
        def __init__(self, rows):
            super().__init__()
            self.rows = rows

        def forward(self, x):
            return torch.mm(x * 2, torch.ones(self.rows, 2))

    mm = next(op for op in tl.trace(Product(4), torch.randn(3, 4)).ops if op.func_name == "mm")
    with pytest.raises(RuntimeError) as failed:
        tl.trace(Product(5), torch.randn(3, 4))
    assert f"raised by torch call 'mm' (op #{mm.index})" in failed.value.__notes__[0], failed.value.__notes__
    assert f"({mm.index}) {mm.label}" in str(tl.trace(Product(4), torch.randn(3, 4)))


def test_the_failing_torch_call_is_named_after_a_failure_the_forward_caught():
    # The note named the first torch call that raised in the forward: one the model caught and recovered from
    # (a shape it tried first) took the place of the call whose exception ended the trace, and the note fell
    # back on naming the module call alone.
    class TriesFirst(nn.Module):
        def forward(self, x):
            try:
                x = torch.mm(x, torch.ones(5, 2))
            except RuntimeError:  # the wrong shape: the other way
                x = x[:, :2]
            return torch.cat([x, torch.ones(2, 3)])

    with pytest.raises(RuntimeError) as failed:
        tl.trace(TriesFirst(), torch.randn(3, 4))
    assert "raised by torch call 'cat'" in failed.value.__notes__[0], failed.value.__notes__
    assert_clean_process()
