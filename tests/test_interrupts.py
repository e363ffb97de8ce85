"""Interrupts in the intervention hooks, the gradient capture and the model put back: whatever line a
KeyboardInterrupt lands on, it reaches the caller unchanged and nothing is left installed or emptied."""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from interrupts import Normalized, interrupt_every_line, signature  # noqa: E402
from torchlens.validate import outputs_equal  # noqa: E402
from untouched import assert_untouched, snapshot  # noqa: E402


class _Doubled(torch.autograd.Function):
    """A custom Function: a trace with gradients wraps Function.apply to follow its outputs."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class WithFunction(Normalized):
    def forward(self, x):
        return _Doubled.apply(super().forward(x))


def _in_files(*modules):
    files = {m.__file__ for m in modules}
    return lambda code: code.co_filename in files


def test_keyboard_interrupt_in_intervention_hooks_leaves_torch_functions_on():
    """An interrupt on the exit line of ``with DisableTorchFunction():`` in an intervention hook skipped its
    exit: torch functions stayed off in the thread, and every later trace recorded no op."""
    import torchlens.intervene as intervene
    from torchlens.intervene import actions, checkpointing, runtime, sites

    model, x = Normalized(), torch.randn(2, 4)
    for site in ("fc", "linear_1_1:1"):  # a module site (a forward hook), a label site (the per-op handler)
        landed = interrupt_every_line(lambda: tl.trace(model, x, intervene={site: tl.scale(2.0)}),
                                       _in_files(intervene, runtime, sites, actions, checkpointing))
        assert landed > 100, (site, landed)
    assert signature(tl.trace(model, x)) == signature(tl.trace(Normalized(), x))


class Centred(Normalized):
    """A buffer (``tl.validate``'s copy of the model deep-copies it, which torch does under ``no_grad()``) read
    under ``no_grad()`` (replay runs that op so)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("centre", torch.zeros(4))

    def forward(self, x):
        with torch.no_grad():
            shift = x.mean(0) - self.centre
        return super().forward(x - shift)


def test_keyboard_interrupt_in_torchs_grad_mode_switch_leaves_gradients_as_they_were(tmp_path):
    """torch's ``no_grad()`` and ``set_grad_enabled()`` switch back in Python code.  An interrupt landing there as a
    trace checked a value for NaN (``record_finite=True``), as ``tl.validate`` copied the model or replayed an op
    run under ``no_grad()``, or as ``tl.extract`` left a batch's ``no_grad()`` block left gradients off in the
    thread: every later forward built no graph."""
    from torch.autograd import grad_mode

    model, x = Centred(), torch.randn(2, 4)
    folders = iter(range(1000))
    runs = {"record_finite": lambda: tl.trace(model, x, record_finite=True), "validate": lambda: tl.validate(model, x),
            "extract": lambda: tl.extract(model, [x, x], ["fc"], tmp_path / str(next(folders)), progress=False)}
    for name, run in runs.items():
        landed = interrupt_every_line(run, lambda code: code.co_filename == grad_mode.__file__)
        assert landed > 10, (name, landed)
    assert model(x).requires_grad and tl.trace(model, x, record_finite=True).output.requires_grad


def test_keyboard_interrupt_in_gradient_capture_never_strands_its_lock():
    """An interrupt on the exit line of ``with _receivers_lock:`` left that lock held, and the teardown
    waiting for it hung the process; every interrupt now ends with the lock free."""
    from torchlens.capture import function_outputs, grads

    model, x = WithFunction(), torch.randn(2, 4, requires_grad=True)
    done, outcome_of_run = threading.Event(), []

    def interrupt_everywhere():  # in a thread, so that a hang fails the test instead of stopping it
        try:
            outcome_of_run.append(interrupt_every_line(lambda: tl.trace(model, x, grads=True),
                                                       _in_files(grads, function_outputs)))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome_of_run.append(exc)
        finally:
            done.set()

    threading.Thread(target=interrupt_everywhere, daemon=True).start()
    assert done.wait(120), "a trace hung after an interrupt in the gradient capture"
    if isinstance(outcome_of_run[0], BaseException):
        raise outcome_of_run[0]
    assert outcome_of_run[0] > 50, outcome_of_run
    assert function_outputs._receivers_lock.acquire(blocking=False)
    function_outputs._receivers_lock.release()

    log = tl.trace(model, x, grads=True)  # and gradients still arrive, equal to an untraced backward's
    log.backward(log.output.sum())
    twin, twin_x = WithFunction(), x.detach().clone().requires_grad_()
    twin(twin_x).sum().backward()
    assert torch.equal(x.grad, twin_x.grad) and all(op.has_grad for op in log.ops if op.kind == "op")


def test_keyboard_interrupt_while_a_model_is_put_back_never_empties_it():
    """A label site's reference pass puts the modules' attributes back; an interrupt between clearing a
    module's attribute dictionary and refilling it left the module with none (no parameters, no submodules)."""
    from torchlens.capture import restore

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train(), torch.randn(3, 4)
    before = snapshot(model, (x,))

    def run():
        try:
            tl.trace(model, x, intervene={"linear_1_1:1": tl.scale(2.0)})
        finally:  # every module keeps exactly its attributes, interrupted or not
            assert_untouched(before, snapshot(model, (x,)))

    landed = interrupt_every_line(run, _in_files(restore))
    assert landed > 100, landed
    expected = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    expected.load_state_dict(model.state_dict())
    assert outputs_equal(tl.trace(model, x).output, expected(x))


def test_keyboard_interrupt_while_modules_are_met_leaves_no_hook_and_torch_functions_on():
    """A callable naming no model has its modules noted by a global pre-hook as they are first called
    (``FirstCalls``).  An interrupt between registering it and entering the block left the hook installed
    for good, and one on the exit line of its ``with DisableTorchFunction():`` left torch functions off."""
    from torchlens.capture import restore

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train(), torch.randn(3, 4)

    def in_first_calls(code):
        return code.co_filename == restore.__file__ and code.co_name in ("__enter__", "_called")

    landed = interrupt_every_line(lambda: tl.validate(lambda t: model(t), x), in_first_calls)
    assert landed > 5, landed
    assert tl.validate(lambda t: model(t), x).passed


def test_an_interrupt_in_the_setup_or_teardown_searches_the_heap_only_when_torch_lifted_the_mode(monkeypatch):
    """Removing the mode searches the whole heap (``gc.get_referrers``) for a push-back torch left suspended,
    which only an interrupt inside torch's temporary pop can leave.  It ran as well for every interrupt
    landing before the mode was pushed, at about 60 ms each in a process holding a few models."""
    from torchlens.capture import inputs, session, teardown

    searches = []
    monkeypatch.setattr(teardown, "close_pending_pushes", lambda mode: searches.append(mode) or 0)
    model, x = Normalized(), torch.randn(2, 4)
    driver = {session.__file__, inputs.__file__}
    landed = interrupt_every_line(lambda: tl.trace(model, x), lambda code: code.co_filename in driver)
    assert landed > 100, landed
    assert searches == []  # the driver's lines run with the mode on the stack, or not yet or no longer on it
    assert signature(tl.trace(model, x)) == signature(tl.trace(Normalized(), x))


def test_keyboard_interrupt_in_the_compile_watch_puts_torchs_hop_entry_back(monkeypatch):
    """In a process where Dynamo is not imported, a trace stands in for torch's ``_hop_compile_and_call``
    until it ends.  An interrupt landing between forgetting torch's function and putting it back left the
    stand-in in place for good.  (The no-Dynamo path is forced here: an earlier test may have imported it.)"""
    from torchlens.capture import compiled

    monkeypatch.setattr(compiled, "_callback_handler", lambda: None)
    model, x = Normalized(), torch.randn(2, 4)
    landed = interrupt_every_line(lambda: tl.trace(model, x), _in_files(compiled))
    assert landed > 10, landed
    assert signature(tl.trace(model, x)) == signature(tl.trace(Normalized(), x))


def test_keyboard_interrupt_as_a_dropped_trace_is_freed_still_removes_its_gradient_hooks():
    """Dropping a trace made with ``grads=True`` removes its tensor hooks in a finalizer.  An interrupt landing
    there ended it part-way, and Python ignores what a finalizer raises: the hooks left on the input kept the
    dead trace's gradient store alive and filled it on every later backward through that input."""
    from torchlens.capture import grads

    model, x = Normalized(), torch.randn(2, 4, requires_grad=True)
    left, ignored, report = [], [], sys.unraisablehook

    def run():
        log = tl.trace(model, x, grads=True)
        del log  # an interrupt in its finalizer is reported as ignored, not raised
        left.extend(hook for hook in (x._backward_hooks or {}).values())

    sys.unraisablehook = lambda unraisable: ignored.append(unraisable.exc_type)
    try:
        interrupt_every_line(run, lambda code: code is grads._remove_all.__code__)
    finally:
        sys.unraisablehook = report
    assert left == [] and set(ignored) <= {KeyboardInterrupt}
    # The compiled hooks remove themselves as they die, without this finalizer: only the Python path meets it.
    assert ignored or tl.capture.accel.compiled("_autograd") is not None or tl.capture.accel.compiled("_grads")
    model(x).sum().backward()
    assert torch.equal(x.grad, torch.autograd.grad(Normalized()(x).sum(), x)[0])


class Offset(Normalized):
    """Makes a tensor with a factory (``torch.arange``): replay makes it on the device it was made on."""

    def forward(self, x):
        return super().forward(x + torch.arange(4.0))


def test_keyboard_interrupt_as_replay_runs_a_factory_leaves_no_device_mode_on_the_stack():
    """Replay ran a factory inside ``with torch.device(...)``, entered and left through an ``ExitStack``.  An
    interrupt landing between pushing that block's mode and noting its exit, or as the stack unwound, left
    the mode on the torch function-mode stack for good: every later factory call in the thread went through
    it, and every later trace ran under a mode it did not put there."""
    import contextlib

    from torch.utils import _device

    model, x = Offset(), torch.randn(2, 4)
    log = tl.trace(model, x)
    assert log.validate().passed  # (and torch's list of factories is read: its lines are not counted below)
    files = {contextlib.__file__, _device.__file__}
    landed = interrupt_every_line(lambda: log.validate(), lambda code: code.co_filename in files)
    assert landed > 10, landed
    assert log.validate().passed and signature(tl.trace(model, x)) == signature(log)


def test_keyboard_interrupt_as_replay_leaves_an_ops_autocast_block_leaves_autocast_off():
    """Replay runs each op of a trace made under autocast inside an autocast block of its own, entered and left
    through an ``ExitStack``.  An interrupt landing as the stack unwound left autocast on in the thread: every
    later forward there ran at lower precision."""
    import contextlib

    from torch.amp import autocast_mode

    model, x = Normalized(), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log = tl.trace(model, x)
    expected = model(x)
    files = {contextlib.__file__, autocast_mode.__file__}
    landed = interrupt_every_line(lambda: log.validate(), lambda code: code.co_filename in files)
    assert landed > 10, landed
    assert log.validate().passed and torch.equal(model(x), expected) and expected.dtype == torch.float32


def test_keyboard_interrupt_as_the_saved_tensor_hooks_are_popped_leaves_none_pushed():
    """``saved_for_backward=True`` runs the forward under saved-tensor hooks, which torch's ``saved_tensors_hooks``
    and a ``contextlib`` block around it popped in Python.  An interrupt landing there left the trace's pack hook
    as the thread's default for good: every later op saving a tensor for backward called it, and every later
    ``saved_for_backward=True`` trace took them for the caller's own and observed nothing."""
    import contextlib

    from torch.autograd import graph

    model, x = Normalized(), torch.randn(2, 4)
    files = {contextlib.__file__, graph.__file__}
    landed = interrupt_every_line(lambda: tl.trace(model, x, saved_for_backward=True),
                                  lambda code: code.co_filename in files)
    assert landed > 5, landed
    log = tl.trace(model, x, saved_for_backward=True)
    assert log.saved_for_backward_bytes > 0 and signature(log) == signature(tl.trace(Normalized(), x))
