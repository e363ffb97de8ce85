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

    A class, not a function: deep capture re-enters Python functions, and this one must stay opaque.
    """

    __name__ = __qualname__ = "compiled"

    def __init__(self, forward, owner: int, suspend):
        self.forward = forward
        self.owner = owner
        self.suspend = suspend  # a context manager factory, or None once the trace has ended

    def __call__(self, *args, **kwargs):
        if torch._C._is_torch_function_mode_enabled() and threading.get_ident() == self.owner:
            # Hand this call to the mode stack like any torch function: capture records it as one op.
            return torch.overrides.handle_torch_function(self, (), *args, **kwargs)
        if self.suspend is None or threading.get_ident() != self.owner:
            return self.forward(*args, **kwargs)  # replay after the trace, or another thread
        with self.suspend():
            return self.forward(*args, **kwargs)


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
    """Context manager: swap each compiled submodule's forward for the trace, and restore it."""

    def __init__(self, model, mode: str, suspend):
        self.model = model
        self.mode = mode
        self.suspend = suspend
        self.swapped: list = []  # (module, original forward)
        self.calls: list = []
        self.eager_modules: set = set()  # ids of OptimizedModules the module tracker must not record

    def __enter__(self):
        optimized = optimized_module_type()
        try:
            if optimized is not None and isinstance(self.model, torch.nn.Module):
                for module in self.model.modules():
                    if type(module) is optimized and "forward" in vars(module):
                        self._swap(module)
            return self
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _swap(self, module) -> None:
        original = vars(module)["forward"]
        if self.mode == "eager":
            replacement = module._orig_mod  # its own module call, hooks included, under capture
            self.eager_modules.add(id(module))
        else:
            replacement = CompiledCall(original, threading.get_ident(), self.suspend)
            self.calls.append(replacement)
        self.swapped.append((module, original))
        vars(module)["forward"] = replacement

    def __exit__(self, *exc):
        # Restoring is idempotent: retried until done, so an interrupt cannot strand a swapped forward.
        interrupted = None
        while self.swapped:
            try:
                module, original = self.swapped[-1]
                vars(module)["forward"] = original
                self.swapped.pop()
            except BaseException as e:  # noqa: BLE001
                interrupted = interrupted or e
        from .mode import _inplace_cache

        for call in self.calls:
            call.suspend = None  # a replay later runs the compiled forward plainly
            _inplace_cache.pop(call, None)  # a per-trace callable: the process-wide cache must not hold it
        if interrupted is not None:
            raise interrupted
        return False

    def caveats(self) -> tuple:
        if self.eager_modules:
            warnings.warn(EAGER_CAVEAT, stacklevel=4)
            return (EAGER_CAVEAT,)
        return ()
