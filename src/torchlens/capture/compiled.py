"""``torch.compile``'d submodules inside a traced model: run them compiled, record each call as one op.

A compiled submodule (an ``OptimizedModule`` held by the model) must compute what it computes untraced,
which means running its compiled code.  Under capture that code would see the capture mode, the module-call
recorder and the fast-path shim, and Dynamo would trace them (and graph-break on them, or
recompile).  So, for the duration of a trace, each compiled submodule's ``forward`` (an instance
attribute ``OptimizedModule`` sets itself) is replaced by a ``CompiledCall``: a torch-function-aware
callable that the capture mode records as one op, named ``compiled``, inside the submodule's own module
call, and that runs the compiled forward with torchlens's hooks and shim out of the way (torch has
already popped the mode while the handler runs it).  Everything is restored in ``__exit__``.

A module compiled in place (``module.compile()``) is not wrapped: torch calls its instance attribute
``_compiled_call_impl`` instead of ``_call_impl``, which would take the call past the module-call
recorder and let Dynamo trace torchlens itself.  For the duration of a trace that attribute is replaced
by an ``InPlaceCompiledCall``, which sends the tracing thread's calls back through ``_call_impl`` (a
recorded module call) whose forward is, for that call, one ``compiled`` op running the compiled code.

With ``compiled="eager"`` the submodule's original module runs eagerly under capture instead, so its
interior is recorded op by op; its outputs may then differ from a compiled run (fused kernels round
differently), and the trace says so.
"""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from itertools import repeat
from operator import contains

import torch

from ..errors import warn_user
from ..record.layouts import version_of
from .restore import ModelState
from .teardown import release_stranded, until_done

EAGER_CAVEAT = ("compiled submodules were traced eagerly (compiled='eager'): their outputs may differ from "
                "the compiled run the untraced model would make")
_MODES = ("run", "eager")
_IN_PLACE = "_compiled_call_impl"  # the instance attribute module.compile() sets


def optimized_module_type():
    """``OptimizedModule``, or None when Dynamo was never imported (then nothing can be compiled)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # importing it would change torch's namespace
    return getattr(eval_frame, "OptimizedModule", None)


def check_compiled_option(compiled: str) -> None:
    if compiled not in _MODES:
        raise ValueError(f"compiled={compiled!r} is not understood: use 'run' (compiled submodules run "
                         "compiled, one op each) or 'eager' (their interior is traced eagerly)")


class CompiledCall:
    """One compiled submodule's forward, as a torch callable the capture mode records as one op.

    One per compiled submodule, shared by every thread tracing a model that holds it: ``threads`` maps
    each tracing thread to how it runs the submodule (a ``RoutedRun``, or ``"eager"``); any
    other caller, and a replay after the trace, gets the compiled forward plainly.  A class, not a
    function: deep capture re-enters Python functions, and this one must stay opaque.
    """

    __name__ = __qualname__ = "compiled"

    def __init__(self, forward, eager):
        self.forward = forward
        self.eager = eager  # the module to call eagerly under compiled="eager"
        self.threads: dict = {}

    def __call__(self, *args, **kwargs):
        how = self.threads.get(threading.get_ident())
        if how is None:
            return self.forward(*args, **kwargs)
        if how == "eager":
            return self.eager(*args, **kwargs)  # its own module call, hooks included, under capture
        if torch._C._is_torch_function_mode_enabled():
            # Hand this call to the mode stack like any torch function: capture records it as one op.
            return torch.overrides.handle_torch_function(self, (), *args, **kwargs)
        with how(self.eager):
            return self.forward(*args, **kwargs)


class RoutedRun:
    """How a tracing thread runs a compiled submodule's code: module calls and the shim suspended, and the tensors
    the module holds as it runs noted under the call's index (``held_by_compiled``).  Replay reads the module's
    tensors where they are then, which must be the same objects: ``torch.func.functional_call`` swaps others in
    for the call alone."""

    __slots__ = ("suspend", "state")

    def __init__(self, suspend, state):
        self.suspend = suspend
        self.state = state

    def __call__(self, module):
        state = self.state
        if state is not None:
            # Capture records the call after it returns, with nothing recorded meanwhile: it gets this index.
            held = state.held_by_compiled
            if held is None:
                held = state.held_by_compiled = {}
            held[len(state.calls)] = tuple(map(weakref.ref, module_tensors(module)))
        return self.suspend()


def module_tensors(module) -> tuple:
    """The parameters and buffers a compiled submodule's code reads, in the module's order."""
    return (*module.parameters(), *module.buffers())


def module_behind(func):
    """The submodule whose compiled code a recorded ``compiled`` op runs, or None for any other call.  That code
    reads the submodule's parameters and buffers where they are when it runs, and may write them (a BatchNorm's
    running statistics in training): none of them is among the op's recorded arguments."""
    return func.eager if isinstance(func, CompiledCall) else None


class KeptForReplay:
    """A compiled submodule's state while replay runs its compiled op again.  ``restore`` puts back every value
    that run wrote, with the version counter it had: a trace holds buffers by reference (a running mean read
    after the call), and a moved counter would make them read as written since the trace.  It returns whether
    the run wrote any."""

    def __init__(self, module):
        self.state = ModelState(module)
        self.versions = [(t, version_of(t)) for t in module_tensors(module)]

    def restore(self) -> bool:
        wrote = self.state.tensors_changed()
        self.state.restore()
        moved = [(t, v) for t, v in self.versions if v is not None and version_of(t) != v]
        if moved:  # the values are those the counters counted to: nothing was written, as far as a trace can tell
            torch._C._autograd._unsafe_set_version_counter(tuple(t for t, _ in moved), tuple(v for _, v in moved))
        return wrote


class InPlaceCompiledCall:
    """The ``_compiled_call_impl`` of a module compiled in place, for the duration of a trace.

    For a tracing thread the call goes through the class's ``_call_impl`` (so it is a module call, with
    the module's own hooks run once, eagerly), whose forward is for that call a ``CompiledCall`` of the
    compiled ``_call_impl``: one ``compiled`` op that runs the compiled code.  Any other caller gets the
    compiled callable plainly.  With compiled="eager" the module runs eagerly, its interior recorded."""

    def __init__(self, compiled, module):
        self.compiled = compiled
        self.module = module
        self.op = CompiledCall(self._run_compiled, module)  # its threads are those of this call
        self.threads = self.op.threads
        self._own: dict = {}  # thread -> the module's own ``forward`` entry while its call is routed

    def __call__(self, *args, **kwargs):
        module = self.module
        tid = threading.get_ident()
        how = self.threads.get(tid)
        if how is None:
            return self.compiled(*args, **kwargs)
        if how == "eager":
            return type(module)._call_impl(module, *args, **kwargs)
        held = vars(module)
        self._own[tid] = held.get("forward", _ABSENT)
        held["forward"] = self.op  # read once, as the call starts, by torch's _call_impl
        try:
            return type(module)._call_impl(module, *args, **kwargs)
        finally:
            self._give_forward_back(tid)

    def _run_compiled(self, *args, **kwargs):
        # The compiled _call_impl reads ``forward`` again: it must find the module's own.
        self._give_forward_back(threading.get_ident())
        return self.compiled(*args, **kwargs)

    def _give_forward_back(self, tid) -> None:
        own = self._own.pop(tid, None)
        if own is _ABSENT:
            vars(self.module).pop("forward", None)
        elif own is not None:
            vars(self.module)["forward"] = own


_ABSENT = object()


def compiled_in_place(modules) -> list:
    """Those of ``modules`` compiled in place (``module.compile()``), which a trace must route."""
    # Read per trace once Dynamo is imported (``compile()`` sets an instance attribute, which no structure
    # check sees): first by C-level passes over the modules' ``__dict__``s, each module's first reference
    # when every module has just two (its ``__dict__`` and its class), as plain modules do.
    owners = gc.get_referents(*modules)
    try:
        if len(owners) == 2 * len(modules) and not any(map(contains, owners[0::2], repeat(_IN_PLACE))):
            return []
    except TypeError:  # a reference that is no mapping: another layout, looked at module by module
        pass
    return [m for m in modules if vars(m).get(_IN_PLACE) is not None]


def _check_routable(module, mode: str) -> None:
    """Under compiled="run" the compiled code runs inside the module's own ``_call_impl`` call, so the
    hooks it compiled would run twice: refuse, with what to do instead."""
    from torch.nn.modules import module as nn_module

    hooked = (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
              or module._backward_pre_hooks or nn_module._global_forward_hooks
              or nn_module._global_forward_pre_hooks or nn_module._global_backward_hooks
              or nn_module._global_backward_pre_hooks)
    if mode == "run" and hooked:
        raise RuntimeError(f"{type(module).__name__} was compiled in place (module.compile()) and module hooks are "
                           "registered, which its compiled code would run a second time under capture; trace "
                           "with compiled='eager', or compile it as torch.compile(module) instead")


_lock = threading.RLock()  # reentrant: a hold stranded by an interrupt on a ``with`` exit line is dropped
_installed: dict = {}  # id(OptimizedModule) -> (module, its own forward, CompiledCall); in use while
# the CompiledCall's ``threads`` is not empty


class Suspension:
    """Context manager: take the module-call recorder and the fast-path shim out of Dynamo's sight, then back.
    One entered inside another (Dynamo compiling a compiled region) leaves both to the outer one."""

    def __init__(self, tracker, shim):
        self.tracker = tracker
        self.shim = shim
        self.paused = False

    def __enter__(self):
        self.paused = self.tracker.recording
        if self.paused:
            self.tracker.pause()
            self.shim.pause()
        return self

    def __exit__(self, *exc):
        if not self.paused:
            return False
        try:
            self.shim.resume()
        finally:
            self.tracker.resume()
        return False


class DynamoCompiles:
    """Context manager: while Dynamo compiles on the tracing thread, module calls and the shim are suspended
    as around a compiled region.  ``torch.cond``, ``while_loop``, ``map`` and ``scan`` compile their bodies
    even in eager mode, before capture sees the call; Dynamo inlines the ``_call_impl`` of a module with hooks
    called in a body, which while a trace records is capture's relay, whose slot it cannot trace.  Torch's
    compile callbacks say when a compile starts and ends.  They exist once Dynamo is imported; until then
    the one entry through which those ops compile (``_hop_compile_and_call``) registers them first."""

    def __init__(self, state):
        self.state = state
        self.thread = threading.get_ident()
        self.handler = None
        self.active = None  # the Suspension entered for the compile in progress

    def __enter__(self):
        # acquire/release rather than ``with``: half the cost; a hold an interrupt strands between them is
        # dropped by ``_release`` (as one stranded on a ``with`` exit line would be).
        _lock.acquire()
        try:
            _live[self.thread] = self  # first: whatever happens next, __exit__ takes it out
            handler = _callback_handler()
            if handler is not None:
                self.register(handler)
            else:
                _route_hop_compiles()
        finally:
            _lock.release()
        return self

    @property
    def registered(self) -> bool:
        """Whether anything of this trace's is still in place: its compile callbacks, or its stand-in for
        torch's ``_hop_compile_and_call`` (for the note on an exception, which must be true)."""
        return self.handler is not None or _live.get(self.thread) is self

    def register(self, handler) -> None:
        self.handler = handler  # first: whatever happens next, __exit__ removes what was registered
        handler.register_start_callback(self._started)
        handler.register_end_callback(self._ended)

    def _started(self, _args) -> None:
        suspend = self.state.suspend
        if suspend is not None and self.active is None and threading.get_ident() == self.thread:
            active = suspend()
            active.__enter__()
            self.active = active

    def _ended(self, _args) -> None:
        active, self.active = self.active, None
        if active is not None:
            active.__exit__(None, None, None)

    def __exit__(self, *exc):
        try:
            self._release()
        except BaseException:  # interrupted: finish (until_done), then let the interrupt through
            until_done(self._release)
            raise
        return False

    def _release(self) -> None:
        release_stranded(_lock)
        _lock.acquire()
        try:
            if _live.get(self.thread) is self:
                del _live[self.thread]
            if not _live:
                _unroute_hop_compiles()
        finally:
            _lock.release()
        handler = self.handler
        if handler is not None:
            for callbacks, callback in ((handler.start_callbacks, self._started), (handler.end_callbacks, self._ended)):
                if callback in callbacks:
                    callbacks.remove(callback)
            self.handler = None
        if self.active is not None:  # a compile was in progress: its suspension ends with the trace
            self._ended(None)


_live: dict = {}  # thread id -> its trace's DynamoCompiles
_HOP_UTILS = "torch._higher_order_ops.utils"
_ENTRY = "_hop_compile_and_call"
_routed: list = []  # [torch's _hop_compile_and_call] while ours stands in for it


def _callback_handler():
    """Torch's compile callback handler, or None while Dynamo is not imported (importing it costs a second)."""
    return getattr(sys.modules.get("torch._dynamo.callback"), "callback_handler", None)


def _route_hop_compiles() -> None:
    utils = sys.modules.get(_HOP_UTILS)
    original = getattr(utils, _ENTRY, None)
    if original is not None and not _routed:
        _routed.append(original)
        setattr(utils, _ENTRY, _hop_compile_and_call)


def _unroute_hop_compiles() -> None:
    if _routed:
        # Put torch's back before forgetting it: an interrupt landing between the two leaves it listed, and the
        # retry (``until_done``) puts it back again.  Forgotten first, it would stay ours for good.
        setattr(sys.modules[_HOP_UTILS], _ENTRY, _routed[-1])
        _routed.pop()


def _hop_compile_and_call(fn, args, kwargs=None):
    """Torch's, after registering every tracing thread's compile callbacks (importing Dynamo, as torch's does),
    and putting torch's back: from now on each trace registers its own as it starts."""
    import torch._dynamo.callback  # noqa: F401  (torch's own imports Dynamo first thing too)

    with _lock:
        original = _routed[0] if _routed else getattr(sys.modules[_HOP_UTILS], _ENTRY)
        handler = _callback_handler()
        for live in _live.values():
            if live.handler is None:
                live.register(handler)
        _unroute_hop_compiles()
    return original(fn, args, kwargs)


class CompiledSubmodules:
    """Context manager: route each compiled submodule's forward through a ``CompiledCall`` for this
    thread, and restore the module's own forward when the last trace using it ends."""

    def __init__(self, model, mode: str, suspend, modules=None, in_place=()):
        self.model = model
        self.modules = modules  # the model's module objects when already listed (the cached index)
        self.in_place = in_place  # modules compiled in place (``compiled_in_place``)
        self.mode = mode
        self.suspend = suspend
        self.state = None  # the trace's CaptureState, where routed runs note what their modules hold
        self.swapped: list = []  # ids of the OptimizedModules this trace routes
        self.eager_modules: set = set()  # ids of OptimizedModules the module tracker must not record
        self.thread = threading.get_ident()  # the tracing thread (a forked child releases it from its own)

    def __enter__(self):
        optimized = optimized_module_type()
        try:
            if optimized is not None and isinstance(self.model, torch.nn.Module):
                modules = self.modules if self.modules is not None else self.model.modules()
                for module in modules:
                    if type(module) is optimized and "forward" in vars(module):
                        self._route(module)
            for module in self.in_place:
                _check_routable(module, self.mode)
                self._route(module, "_compiled_call_impl", InPlaceCompiledCall)
            return self
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _route(self, module, slot: str = "forward", router=None) -> None:
        tid = self.thread
        self.swapped.append(id(module))  # first: whatever happens next, __exit__ will undo it
        with _lock:
            entry = _installed.get(id(module))
            if entry is None:
                own = vars(module)[slot]
                call = router(own, module) if router is not None else CompiledCall(own, module._orig_mod)
                entry = _installed[id(module)] = (module, own, call, slot)
                vars(module)[slot] = call
            entry[2].threads[tid] = "eager" if self.mode == "eager" else RoutedRun(self.suspend, self.state)
        if self.mode == "eager" and router is None:
            self.eager_modules.add(id(module))
        elif self.mode == "eager":
            self.compiled_eagerly = True

    def __exit__(self, *exc):
        until_done(self._unroute_all)  # an interrupt cannot strand a routed forward; re-raised after
        return False

    def _unroute_all(self) -> None:
        release_stranded(_lock)
        while self.swapped:
            self._unroute(self.swapped[-1])

    def _unroute(self, key: int) -> None:
        with _lock:  # every step is idempotent: a retry after an interrupt repeats them harmlessly
            entry = _installed.get(key)
            if entry is not None:
                module, own, call, slot = entry
                call.threads.pop(self.thread, None)
                if not call.threads:  # the last trace using it: the module gets its own forward back
                    vars(module)[slot] = own
                    _installed.pop(key, None)
            self.swapped.pop()

    compiled_eagerly = False  # a module compiled in place ran eagerly (compiled="eager")

    def caveats(self) -> tuple:
        if self.eager_modules or self.compiled_eagerly:
            warn_user(EAGER_CAVEAT)
            return (EAGER_CAVEAT,)
        return ()
