"""Putting the capture mode on torch's function-mode stack, and taking it off whatever happened.

``TorchFunctionMode.__exit__`` pops the top of the stack blindly.  That is wrong when an interrupt has
landed inside torch's own temporary pop (``_pop_mode_temporarily`` in ``handle_torch_function``, which
lifts the mode off the stack while its handler runs and pushes it back in a ``finally``):

- if the interrupt stopped the push-back, the mode is already off the stack, and a blind pop raises
  "trying to pop from empty mode stack" in place of the user's KeyboardInterrupt;
- if it landed in ``contextlib``'s ``__exit__`` before the generator was resumed, the generator is left
  suspended, and whenever it is collected its ``finally`` pushes the mode back, for good.

``ModeOnStack`` removes this mode by identity, wherever it sits, and first resumes any such suspended
push-back so that it cannot fire later.
"""

from __future__ import annotations

import gc
import inspect
import threading

import torch
import torch.overrides

from .source import release_classified

_push = torch._C._push_on_torch_function_stack
_pop = torch._C._pop_torch_function_stack
_depth = torch._C._len_torch_function_stack
_at = torch._C._get_function_stack_at
_TEMPORARY_POP = torch.overrides._pop_mode_temporarily.__wrapped__  # the generator behind the context manager


def on_stack(mode) -> bool:
    return any(torch._C._get_function_stack_at(i) is mode for i in range(_depth()))


def remove_from_stack(mode) -> None:
    """Take every occurrence of ``mode`` off the stack, keeping the modes around it in order."""
    while _depth() and torch._C._get_function_stack_at(_depth() - 1) is mode:
        _pop()  # the common case: capture's mode is on top; one call, nothing to put back
    if not on_stack(mode):
        return
    kept = [torch._C._get_function_stack_at(i) for i in range(_depth())]
    while _depth():
        _pop()
    for m in kept:
        if m is not mode:
            _push(m)


def close_pending_pushes(mode) -> int:
    """Resume every suspended ``_pop_mode_temporarily`` holding ``mode`` (it pushes the mode back)."""
    code = _TEMPORARY_POP.__code__
    pending = [g for g in gc.get_referrers(mode)
               if inspect.isgenerator(g) and g.gi_code is code and g.gi_frame is not None
               and g.gi_frame.f_locals.get("old") is mode]
    for generator in pending:
        generator.close()
    return len(pending)


class ModeOnStack:
    """Context manager: push ``mode``; on exit remove it by identity and repair what torch left."""

    def __init__(self, mode):
        self.mode = mode
        self.pushed = False  # whether the mode may be on the stack: only then can removing it need a repair
        self.removed = False  # teardown runs twice (see capture/session.py): the second is a no-op

    def __enter__(self):
        try:
            self.removed = False
            # Marked before the push: an interrupt between the two costs the heap search below, never a
            # mode left on the stack.
            self.pushed = True
            _push(self.mode)
            return self
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            self.remove()
        except BaseException:  # interrupted: finish removing (until_done), then let the interrupt through
            until_done(self.remove)
            raise
        return False

    def remove(self) -> None:
        if self.removed or not self.pushed:
            return  # removed already, or never pushed (an interrupt in the setup before it): nothing to repair
        if _depth() == 1 and _at(0) is self.mode:
            _pop()  # the common case: capture's mode alone on the stack, as pushed
            self.removed = True
            return
        if not on_stack(self.mode):
            # Lifted off by torch for a handler call whose push-back an interrupt cut short: make sure
            # no suspended push-back can put it back later.  (Rare: only then is the heap searched.)  With no
            # interrupt, the forward itself took it off (see ``refuse_lifted_mode``).
            self.mode.state.mode_lifted = True
            close_pending_pushes(self.mode)
        remove_from_stack(self.mode)
        self.removed = True


_running: dict = {}  # thread id -> the Capture that thread's trace runs inside, while it runs (capture/forks.py)


def running_captures() -> dict:
    """Each tracing thread's id -> the ``Capture`` its trace runs inside."""
    return _running


class Capture:
    """Context manager: enter one trace's capture parts in order; on exit tear them all down, innermost
    first.

    Each part cleans up after itself when its own ``__enter__`` fails, and each part's ``__exit__`` is
    idempotent and finishes even when interrupted (``until_done``).  The ``with`` exit is the one
    teardown of a forward that returns.  What can still go wrong is a single interrupt landing on a
    line of ``tear_down`` itself, or on the ``with`` line so that the exit never runs: either way an
    exception is propagating, and the driver's ``except`` calls ``tear_down`` once more.  So every part
    is removed whatever single interrupt lands wherever, and a forward that returns pays for one
    teardown, not two.
    """

    def __init__(self, parts: tuple):
        self.parts = parts
        self.forked_into = None  # the pid of a child forked inside the forward, in that child (capture/forks.py)
        self.thread = threading.get_ident()

    def __enter__(self):
        _running[self.thread] = self
        for part in self.parts:
            part.__enter__()
        return self

    def __exit__(self, *exc):
        self.tear_down()
        return False

    def tear_down(self) -> None:
        """Exit every part, innermost first; an interrupt landing meanwhile is re-raised after."""
        if _running.get(self.thread) is self:
            del _running[self.thread]
        if not _running:
            release_classified()
        interrupted = None
        for part in reversed(self.parts):
            try:
                part.__exit__(None, None, None)
            except BaseException as e:  # noqa: BLE001
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted

    def abandon(self) -> None:
        """In a forked child, where the thread that ran this trace is gone: tear down what the trace put in
        place process-wide, from the child's thread.  The parts on that thread's own mode stack went with it."""
        self.parts = tuple(part for part in self.parts if not isinstance(part, ModeOnStack))
        self.tear_down()


def leftovers(mode, parts) -> list:
    """What of one trace is still installed (for the note on an exception: it must be true)."""
    left = ["the capture mode on the torch function-mode stack"] if on_stack(mode) else []
    for part in parts:
        if getattr(part, "_handles", None):
            left.append("global module hooks")
        if getattr(part, "replaced", False):
            left.append("nn.Module._call_impl replaced")
        if getattr(part, "_counted", False):
            left.append("the fast-path shim")
        if getattr(part, "swapped", None):
            left.append("a compiled submodule's forward")
        if getattr(part, "installed", False):
            left.append("torch.autograd.Function.apply wrapped")
        if getattr(part, "registered", False):
            left.append("Dynamo compile callbacks")
        if getattr(part, "pushed_hooks", None):
            left.append("saved-tensor hooks")
    return left


def refuse_lifted_mode() -> None:
    """After a forward that returned with ``state.mode_lifted`` set: one that took capture's mode off torch's
    function-mode stack (exiting a mode entered before ``tl.trace`` pops the top of the stack, which was capture's)
    ran its later torch calls unseen, so no trace is made of it."""
    raise RuntimeError("the traced forward took the capture's mode off torch's function-mode stack, so the "
                       "torch calls after that point were not recorded and no trace is returned: a torch "
                       "function mode entered before tl.trace and exited inside the forward (by a hook, "
                       "say) pops the mode on top, which was the capture's. Enter and exit the mode both "
                       "inside the forward, or both around tl.trace")


def release_failed(state, runtime) -> None:
    """Let go of what the capture of a forward that raised holds: no trace is made of it, yet the exception's
    traceback keeps the trace's frames, and with them ``state`` and the interventions' ``runtime``, for as long
    as the exception is kept (a notebook keeps the last one).  Without this, a kept exception would keep every
    activation (and every intervened op's original value) saved before the failure, and the exception ``state``
    names (``failure``, ``raised_in``) would close a reference cycle through those frames, freeing the model,
    its inputs and the activations only when the collector runs."""
    state.failure = state.raised_in = state.grads = state.finite_flags = None
    for held in (state.calls, state.records, state.module_calls, state.producers, state.writers, state.unwritten,
                 state.data_bases, state.exports, state.saved, state.saved_versions, state._by_storage, state.unkeyed,
                 state.param_writes, state.contexts, state.clobbered):
        held.clear()
    if runtime is not None:
        for held in (runtime.applied, runtime.originals, runtime.label_sites, runtime.by_call):
            held.clear()
        # The metadata-only trace made to resolve label sites holds its own output; each label site's op, a view
        # of it, holds it too.
        runtime.reference = runtime.stop_site = None


def release_refused(trace, state, runtime) -> None:
    """Let go of what a trace refused after its forward holds (a ``save=`` entry that matched nothing, an
    intervention site the forward never reached): the refusal's traceback keeps the finished trace, its
    ``state`` and ``runtime`` as a failed forward's does, and the trace holds every activation saved.  Its
    metadata stays, for the message already made."""
    try:
        trace.cleanup()  # first: the trace reads the lists ``state`` holds, which release_failed empties
    except Exception:  # noqa: BLE001 - best effort: the refusal on its way is what the caller must see
        pass
    release_failed(state, runtime)


def remove_handles(handles: list) -> None:
    """Remove every hook handle in ``handles``, emptying it.  An interrupt landing meanwhile is re-raised
    only once every hook is gone (``RemovableHandle.remove`` is idempotent, so a retry is safe)."""
    def remove_all():
        while handles:
            handles[-1].remove()
            handles.pop()

    until_done(remove_all)


# A module's per-hook flags, keyed like its hook dicts by the handle id.
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def remove_module_hook(module, hook) -> None:
    """Remove every registration of ``hook`` (a forward or forward pre-hook) from ``module``, and its flags.
    Idempotent: found by identity, so it needs no handle."""
    for name in ("_forward_pre_hooks", "_forward_hooks"):
        hooks = getattr(module, name)
        for key in [key for key, registered in hooks.items() if registered is hook]:
            hooks.pop(key, None)
            for flags in _HOOK_FLAGS:
                getattr(module, flags, {}).pop(key, None)


class HookHandles:
    """A capture part (``Capture``) owning the module hooks its ``install`` registers with ``hook``: all are
    removed on exit, and at once when installing raises part-way."""

    def __init__(self):
        self._handles = []
        self._hooked = []  # (module, hook), noted before torch registers it

    def install(self) -> None:
        raise NotImplementedError

    def hook(self, module, hook, pre: bool, **options) -> None:
        """Register ``hook`` on ``module`` (a forward pre-hook if ``pre``), to be removed on exit.  Noted before
        it is registered: an interrupt landing inside torch's register call, or before its handle is kept,
        leaves the hook on the module with no handle, and the exit then finds it by identity."""
        self._hooked.append((module, hook))
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        self._handles.append(register(hook, **options))

    def _remove_all(self) -> None:
        remove_handles(self._handles)
        while self._hooked:  # what the handles removed is gone already: this finds only hooks left without one
            remove_module_hook(*self._hooked[-1])
            self._hooked.pop()

    def __enter__(self):
        try:
            self.install()
            return self
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        until_done(self._remove_all)  # an interrupt inside ``remove_handles`` is re-raised once all are gone
        return False


def release_stranded(lock) -> None:
    """Drop the holds this thread still has on the reentrant ``lock``: an interrupt landing on the exit
    line of a ``with lock:`` block leaves it held."""
    while lock._is_owned():
        lock.release()


# Whether torch functions are enabled, disabled for subclasses or disabled outright, per thread.
_get_torch_function_state = torch._C._get_torch_function_state
_set_torch_function_state = torch._C._set_torch_function_state
_torch_functions_on = torch._C._is_torch_function_enabled  # one C call, no state object made
_ON = torch._C._TorchFunctionState.ENABLED
_ALL_DISABLED = torch._C._TorchFunctionState.ALL_DISABLED


def torch_function_state(for_trace: bool = False):
    """This thread's torch-function state, to put back with ``restore_torch_function_state``.  Read by
    every trace: the usual answer, on, costs one C call.  ``for_trace``:
    refuse the state a trace cannot see a call in (inside ``torch._C.DisableTorchFunction()``), where the trace
    would hold no op."""
    if _torch_functions_on():
        return _ON
    state = _get_torch_function_state()
    if for_trace and state == _ALL_DISABLED:
        raise RuntimeError("tl.trace, or a tool that traces, was called with torch function handling disabled "
                           "(inside torch._C.DisableTorchFunction()), which hands capture no torch call: the trace "
                           "would hold no op; call it outside that block")
    return state


def restore_torch_function_state(saved) -> None:
    """Put back the state ``torch_function_state`` returned.  An interrupt landing on the exit line of a
    ``with torch._C.DisableTorchFunction():`` in a hook skips its ``__exit__``, which would leave every
    later tensor subclass and mode in this thread ignored, and every later trace empty."""
    if saved is _ON and _torch_functions_on():
        return
    if _get_torch_function_state() != saved:
        _set_torch_function_state(saved)


def restore_grad_mode(enabled: bool) -> None:
    """Put back this thread's grad mode, read as a call began, once the call raised.  ``torch.no_grad()`` and
    ``torch.set_grad_enabled()`` switch back in Python code: an interrupt landing there (as a trace checks a value
    for NaN, as a tensor is deep-copied, as replay leaves an op's grad mode) would leave gradients off in the
    thread, and every later forward would build no graph."""
    if torch.is_grad_enabled() != enabled:
        torch.set_grad_enabled(enabled)


def until_done(step) -> None:
    """Run ``step`` (idempotent) until it returns; an interrupt that landed meanwhile is re-raised after,
    so teardown always finishes before the user's KeyboardInterrupt propagates."""
    interrupted = None
    while True:
        try:
            step()
            break
        except BaseException as e:  # noqa: BLE001
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted
