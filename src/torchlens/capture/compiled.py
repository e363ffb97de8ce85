"""``torch.compile``'d submodules inside a traced model: run them compiled, record each call as one op.

A compiled submodule (an ``OptimizedModule`` held by the model) must compute what it computes untraced,
which means running its compiled code.  Under capture that code would see the capture mode, the global
module hooks and the fast-path shim, and Dynamo would trace them (and graph-break on them, or
recompile).  So, for the duration of a trace, each compiled submodule's ``forward`` (an instance
attribute ``OptimizedModule`` sets itself) is replaced by a ``CompiledCall``: a torch-function-aware
callable that the capture mode records as one op, named ``compiled``, inside the submodule's own module
call, and that runs the compiled forward with torchlens's hooks and shim out of the way (torch has
already popped the mode while the handler runs it).  Everything is restored in ``__exit__``.

With ``compiled="eager"`` the submodule's original module runs eagerly under capture instead, so its
interior is recorded op by op; its outputs may then differ from a compiled run (fused kernels round
differently), and the trace says so.
"""

from __future__ import annotations

import sys
import threading
import warnings

import torch

EAGER_CAVEAT = ("compiled submodules were traced eagerly (compiled='eager'): their outputs may differ from "
                "the compiled run the untraced model would make")
_MODES = ("run", "eager")


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
    each tracing thread to how it runs the submodule (a ``Suspension`` factory, or ``"eager"``); any
    other caller, and a replay after the trace, gets the compiled forward plainly.  A class, not a
    function: deep capture re-enters Python functions, and this one must stay opaque.
    """

    __name__ = __qualname__ = "compiled"

    def __init__(self, forward, module):
        self.forward = forward
        self.eager = module._orig_mod
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
        with how():
            return self.forward(*args, **kwargs)


_lock = threading.RLock()  # reentrant: a hold stranded by an interrupt on a ``with`` exit line is dropped
_installed: dict = {}  # id(OptimizedModule) -> (module, its own forward, CompiledCall); in use while
# the CompiledCall's ``threads`` is not empty


class Suspension:
    """Context manager: take the module hooks and the fast-path shim out of Dynamo's sight, then back."""

    def __init__(self, tracker, shim):
        self.tracker = tracker
        self.shim = shim

    def __enter__(self):
        self.tracker.pause()
        self.shim.pause()
        return self

    def __exit__(self, *exc):
        try:
            self.shim.resume()
        finally:
            self.tracker.resume()
        return False


class CompiledSubmodules:
    """Context manager: route each compiled submodule's forward through a ``CompiledCall`` for this
    thread, and restore the module's own forward when the last trace using it ends."""

    def __init__(self, model, mode: str, suspend, modules=None):
        self.model = model
        self.modules = modules  # the model's module objects when already listed (the cached index)
        self.mode = mode
        self.suspend = suspend
        self.swapped: list = []  # ids of the OptimizedModules this trace routes
        self.eager_modules: set = set()  # ids of OptimizedModules the module tracker must not record

    def __enter__(self):
        optimized = optimized_module_type()
        try:
            if optimized is not None and isinstance(self.model, torch.nn.Module):
                modules = self.modules if self.modules is not None else self.model.modules()
                for module in modules:
                    if type(module) is optimized and "forward" in vars(module):
                        self._route(module)
            return self
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _route(self, module) -> None:
        tid = threading.get_ident()
        self.swapped.append(id(module))  # first: whatever happens next, __exit__ will undo it
        with _lock:
            entry = _installed.get(id(module))
            if entry is None:
                call = CompiledCall(vars(module)["forward"], module)
                entry = _installed[id(module)] = (module, call.forward, call)
                vars(module)["forward"] = call
            entry[2].threads[tid] = "eager" if self.mode == "eager" else self.suspend
        if self.mode == "eager":
            self.eager_modules.add(id(module))

    def __exit__(self, *exc):
        # Retried until done, so that an interrupt cannot strand a routed forward; re-raised after.
        interrupted = None
        while self.swapped:
            try:
                while _lock._is_owned():  # stranded by an interrupt on a ``with _lock:`` exit line
                    _lock.release()
                self._unroute(self.swapped[-1])
            except BaseException as e:  # noqa: BLE001
                interrupted = interrupted or e
        while _lock._is_owned():
            _lock.release()
        if interrupted is not None:
            raise interrupted
        return False

    def _unroute(self, key: int) -> None:
        from .mode import _inplace_cache

        with _lock:  # every step is idempotent: a retry after an interrupt repeats them harmlessly
            entry = _installed.get(key)
            if entry is not None:
                module, forward, call = entry
                call.threads.pop(threading.get_ident(), None)
                _inplace_cache.pop(call, None)  # the process-wide cache must not keep the model alive
                if not call.threads:  # the last trace using it: the module gets its own forward back
                    vars(module)["forward"] = forward
                    _installed.pop(key, None)
            self.swapped.pop()

    def caveats(self) -> tuple:
        if self.eager_modules:
            warnings.warn(EAGER_CAVEAT, stacklevel=4)
            return (EAGER_CAVEAT,)
        return ()
