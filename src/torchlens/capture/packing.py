"""What autograd keeps for backward, op by op: ``tl.trace(..., saved_for_backward=True)``.

During the forward, ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd packs into
a backward node, while the torch call that packs it runs; the call index is the length of the capture
state's call list at that moment.  Per call the log keeps ``{storage: bytes}`` (never the tensors), so
that totals count each distinct storage once however many ops keep it (an activation that two ops save,
a weight every pass of a loop saves).

The pack hook returns a detached alias of the tensor (no copy, and no reference cycle through an
output's own ``grad_fn``) with the version it had, and unpacking refuses a tensor modified in place after
it was saved, exactly as autograd refuses it without hooks.  It is opt-in: a Python call per saved tensor
costs a few microseconds, more than the gradient hooks themselves.  When the caller already has
saved-tensor hooks active (``save_on_cpu``, offloading), torchlens leaves them in charge and says that
packing was not observed.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from functools import partial

import torch

from ..errors import add_note
from ..record.layouts import storage_key
from .teardown import until_done

_no_torch_function = torch._C.DisableTorchFunction


def _pack(log_ref, t: torch.Tensor):
    """The pack hook.  Autograd keeps it with every saved tensor, so it holds the log weakly; it runs
    inside custom Functions' forward too, where the capture mode is active: what it calls is
    bookkeeping, never ops of the model."""
    log = log_ref()
    with _no_torch_function():
        if log is not None:
            log.note(t)
        return t.detach(), t._version


def _unpack(packed):
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
            f"{version} instead (checked by the torchlens saved_for_backward=True trace, as autograd checks it)")
    return t


class PackLog:
    """``packed[call index] = {storage key: storage bytes}`` for the tensors autograd saved in that call."""

    def __init__(self, calls: list):
        self.packed: dict = {}
        self.calls = calls  # the capture state's call list while the forward runs; None after it
        # The tracing thread.  Torch hands the hooks, with the rest of its state, to the thread TorchScript's fork
        # runs a task on: what that thread's ops keep is no call's of this trace, which records none of them.
        self.thread = threading.get_ident()
        self.note_text = None  # why packing was not observed, when it was not
        # The call an intervention's action is run for (after that call was listed), while it runs: what
        # the action makes autograd keep is kept at its site, not by the call after it.
        self.action_at = None
        self.function_from = None  # while a custom autograd Function runs: the calls listed before it

    def within_function(self, apply, cls, args, kwargs):
        """``apply(cls, *args, **kwargs)`` of a custom autograd Function.  torch packs what the Function keeps
        as ``apply`` returns, once the ops of its forward are listed: those tensors are kept by the last of
        them, the op holding the Function's output, not by the call after it.  (A Function run inside a
        call, as a custom op's autograd is, lists no op of its own: what it keeps is that call's.)"""
        outer = self.function_from
        self.function_from = len(self.calls) if self.calls is not None else None
        try:
            return apply(cls, *args, **kwargs)
        finally:
            self.function_from = outer

    def note(self, t: torch.Tensor) -> None:
        calls = self.calls
        if calls is None or threading.get_ident() != self.thread:
            return
        call = len(calls) if self.action_at is None else self.action_at
        if self.action_at is None and self.function_from is not None and call > self.function_from:
            call -= 1  # a custom Function's, packed after its forward's ops (``within_function``)
        sizes = self.packed.get(call)
        if sizes is None:
            sizes = self.packed[call] = {}
        try:
            sizes[storage_key(t)] = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # storage-less layouts: their own size
            sizes[-id(t)] = t.numel() * t.element_size()

    def hooks(self):
        """``(pack, unpack)``, the saved-tensor hooks for the forward, or None when packing cannot be observed."""
        autograd = torch._C._autograd
        enabled = getattr(autograd, "_saved_tensors_hooks_is_enabled", lambda: True)()
        if not enabled:
            self.note_text = "saved-tensor hooks are disabled here, so packing was not observed"
        elif autograd._top_saved_tensors_default_hooks(False) is not None:
            self.note_text = ("the caller's own saved_tensors_hooks were active: torchlens left them in charge "
                              "and did not observe packing")
        return None if self.note_text is not None else (partial(_pack, weakref.ref(self)), _unpack)


class SavedTensorHooks:
    """A capture part (``Capture``): ``log``'s saved-tensor hooks pushed for the forward, popped on exit.  Not
    torch's ``saved_tensors_hooks`` block, which pops them in Python: an interrupt landing there left the trace's
    pack hook as the thread's default for good (every later op saving a tensor for backward called it, and every
    later ``saved_for_backward=True`` trace took it for the caller's own)."""

    def __init__(self, log: PackLog):
        self.log = log
        self.pushed_hooks = None  # the hooks, from just before they are pushed until they are popped

    def __enter__(self):
        hooks = self.log.hooks()
        if hooks is not None:
            self.pushed_hooks = hooks  # first: an interrupt before the push costs the exit one look at the top
            torch._C._autograd._push_saved_tensors_default_hooks(*hooks)
        return self

    def __exit__(self, *exc):
        until_done(self._pop)
        return False

    def _pop(self) -> None:
        """Idempotent: pops the hooks only while they are the thread's top ones."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if self.pushed_hooks is not None and top is not None and top[0] is self.pushed_hooks[0]:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        self.pushed_hooks = None


@contextlib.contextmanager
def refusal_noted():
    """Around the forward of ``saved_for_backward=True``: a note on an error raised by code that refuses
    saved-tensor hooks (torch.func's ``grad``, ``vjp``, ``jacrev`` and ``hessian``: "don't yet support saved tensor
    hooks"), which runs untraced: the hooks are the trace's own (``SavedTensorHooks``), and only this option
    installs them."""
    try:
        yield
    except RuntimeError as exc:
        if "saved tensor" in str(exc):
            add_note(exc, "torchlens: saved_for_backward=True runs the forward under saved-tensor hooks "
                          "(torch.autograd.graph.saved_tensors_hooks), which this forward's code refuses ("
                          "torch.func's grad, vjp, jacrev and hessian do), though it runs without them: trace it "
                          "without saved_for_backward=True")
        raise
