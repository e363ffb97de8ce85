"""Gradient capture: a tensor hook per recorded output, and what autograd packs for backward.

With ``tl.trace(..., grads=True)`` the hot path calls ``GradCapture.watch`` for each recorded output
that requires grad.  ``watch`` registers one tensor hook (what ``retain_grad()`` does, through the public
``register_hook``), so that any later backward through the traced output hands each op's gradient to
the trace: d loss / d (that op's output), accumulated over backwards as ``.grad`` accumulates.

The hooks hold the capture only weakly: the autograd graph never keeps a trace alive, and the trace
never keeps the graph alive (it holds the handles, which hold the hook dicts weakly).  Every hook is
removed by ``Trace.cleanup()`` or when the trace is garbage-collected, so a later backward through the
same graph is unaffected.

During the forward, ``torch.autograd.graph.saved_tensors_hooks`` tells which tensors autograd packs for
backward and which call packed them.  The pack hook keeps a detached alias (no copy, no reference cycle
through the output's ``grad_fn``) and the version it had, so that unpacking still refuses a tensor
modified in place after it was saved, as autograd does without hooks.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch

from .state import storage_key

_no_torch_function = torch._C.DisableTorchFunction
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def _store(capture_ref, index: int, grad) -> None:
    """The tensor hook: add ``grad`` to the gradient kept for record ``index``; never alters it."""
    capture = capture_ref()
    if capture is not None and grad is not None:
        capture.add(index, grad)


def _pack(capture_ref, t: torch.Tensor):
    """The pack hook.  Autograd keeps it with every saved tensor, so it holds the capture weakly; and it
    runs inside custom Functions' forward too, where the capture mode is active: what it calls is
    bookkeeping, never ops of the model."""
    capture = capture_ref()
    with _no_torch_function():
        if capture is not None:
            capture.note_packed(t)
        return t.detach(), t._version


def _unpack(packed):
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
            f"{version} instead (checked by the torchlens grads=True trace, as autograd checks it)")
    return t


def _remove_all(handles: dict) -> None:
    for handle in handles.values():
        handle.remove()
    handles.clear()


class GradCapture:
    """The gradients one trace receives, the hooks that deliver them, and the packed-for-backward log.

    ``selector`` is ``None`` (every op that requires grad) or a ``(func, module_call) -> bool`` test
    decided during the forward (op types and modules of a ``grads=[...]`` selection).
    """

    def __init__(self, selector=None):
        self.selector = selector
        self.sources = True  # inputs are watched (False when a type selection does not name them)
        self.grads: dict = {}  # record index -> accumulated gradient (a private, detached tensor)
        self.handles: dict = {}  # record index -> RemovableHandle
        self.selected: set = set()  # record indices whose gradient the trace keeps
        self.backwards = 0
        self.order: list = []  # record indices in the order their first gradient arrived (backward order)
        self._last_task = None
        self._self_ref = weakref.ref(self)
        self._finalizer = weakref.finalize(self, _remove_all, self.handles)
        # Packed for backward: call index -> {storage key: storage bytes}.
        self.packed: dict = {}
        self.calls = None  # the capture state's calls list, whose length is the call being run
        self.pack_note = None  # why packing was not observed, when it was not

    # ----- the forward ---------------------------------------------------------------------------
    def watch(self, index: int, t: torch.Tensor, func=None, module_call: int = -1) -> None:
        """Register the gradient hook for record ``index`` (``t`` requires grad)."""
        if self.selector is not None and not self.selector(func, module_call):
            return
        self.handles[index] = t.register_hook(partial(_store, self._self_ref, index))
        self.selected.add(index)

    def watch_source(self, index: int, t: torch.Tensor) -> None:
        """An input that requires grad: its gradient is d loss / d input."""
        if self.selector is None or self.sources:
            self.handles[index] = t.register_hook(partial(_store, self._self_ref, index))
            self.selected.add(index)

    def note_packed(self, t: torch.Tensor) -> None:
        calls = self.calls
        if calls is not None:
            sizes = self.packed.get(len(calls))
            if sizes is None:
                sizes = self.packed[len(calls)] = {}
            try:
                sizes[storage_key(t)] = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # storage-less layouts: their own size
                sizes[-id(t)] = t.numel() * t.element_size()

    def saved_tensors_context(self):
        """``saved_tensors_hooks`` for the forward, or a null context when packing cannot be observed."""
        import contextlib

        autograd = torch._C._autograd
        enabled = getattr(autograd, "_saved_tensors_hooks_is_enabled", lambda: True)()
        top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
        if not enabled:
            self.pack_note = "saved-tensor hooks are disabled here, so packing was not observed"
        elif top is not None and top(False) is not None:
            self.pack_note = ("the caller's own saved_tensors_hooks were active: torchlens left them in "
                              "charge and did not observe packing")
        if self.pack_note is not None:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(partial(_pack, self._self_ref), _unpack)

    # ----- the backward --------------------------------------------------------------------------
    def add(self, index: int, grad: torch.Tensor) -> None:
        if _graph_task_id is not None:
            task = _graph_task_id()
            if task != self._last_task:
                self._last_task = task
                self.backwards += 1
        kept = self.grads.get(index)
        with torch.no_grad():
            if kept is None:
                # A copy, as retain_grad() keeps: autograd may reuse the buffer it passed in.
                self.grads[index] = grad.detach().clone()
                self.order.append(index)
            else:
                self.grads[index] = kept + grad.detach()

    def keep_only(self, indices) -> None:
        """Remove the hooks of records not in ``indices`` (a selection decided after the forward)."""
        for index in [i for i in self.handles if i not in indices]:
            self.handles.pop(index).remove()
        self.selected.intersection_update(indices)

    def remove_hooks(self) -> None:
        _remove_all(self.handles)


# ----- set-up and hand-over, called by capture/session.py ---------------------------------------
def grad_capture(grads, model, state):
    """The ``GradCapture`` for ``tl.trace(..., grads=...)``, or None when gradients are off."""
    if grads is None or grads is False or (isinstance(grads, str) and grads in ("none", "")):
        return None
    from .saving import SavePolicy

    policy = None
    if not (grads is True or grads == "all"):
        if isinstance(grads, str):
            grads = [grads]
        policy = SavePolicy(grads, model)
    capture = GradCapture()
    capture.policy = policy
    if policy is not None and policy.mode == 2:  # types and modules: decided during the forward
        capture.selector = policy.capture_selector(state)
        capture.sources = "input" in policy.types or bool(policy.module_ids)
    capture.calls = state.calls
    return capture


def packing_observed(capture):
    """The context the forward runs in: saved-tensor hooks when gradients are captured."""
    import contextlib

    return capture.saved_tensors_context() if capture is not None else contextlib.nullcontext()


def attach_grads(trace, capture) -> None:
    """Give the finished trace its gradient capture, and apply a ``grads=[...]`` selection."""
    if capture is None:
        return
    capture.calls = None  # the forward is over: nothing more is packed
    trace._gradcap = capture
    policy = capture.policy
    if policy is None:
        return
    try:
        _check_selectors(trace, policy)
    except KeyError:
        capture.remove_hooks()  # the trace is not returned: nothing it registered may stay
        raise
    if policy.filters_after:
        capture.keep_only({i for i in capture.selected if policy.keep(trace, trace.ops[i])})


def _check_selectors(trace, policy) -> None:
    """Unknown labels and op types in ``grads=[...]`` raise, naming the closest labels."""
    import difflib

    for label in policy.labels:
        trace[label]  # raises KeyError with the closest labels
    known_types = set(trace._types)
    for wanted in policy.types:
        if wanted not in known_types:
            names = sorted(known_types | set(trace._labels))
            close = difflib.get_close_matches(wanted, names, n=5, cutoff=0.5)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise KeyError(f"grads= selector {wanted!r} names no op type, label or module in this trace{hint}")
