"""Gradient capture: a tensor hook per recorded output, delivering d loss / d output to the trace.

With ``tl.trace(..., grads=True)`` the hot path calls ``GradCapture.watch`` for each recorded output
that requires grad.  ``watch`` adds one tensor hook (the mechanism ``retain_grad()`` uses), so that any
later backward through the traced output hands each op's gradient to the trace: d loss / d (that op's
output), accumulated over backwards as ``.grad`` accumulates.  It also notes the sequence number of the
output's backward node, by which a profiler names that node's work (report/backward_profile.py).

The hooks hold the capture only weakly: the autograd graph never keeps a trace alive, and the trace
never keeps the graph alive (it holds the tensors' hook dicts weakly, by key).  Every hook is
removed by ``Trace.cleanup()`` or when the trace is garbage-collected, so a later backward through the
same graph is unaffected.

What autograd keeps for backward is recorded separately, on request (capture/packing.py).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from functools import partial

import torch

# The steps of Tensor.register_hook, taken inline (see _hook_dict); the public call where they are absent.
_INLINE_HOOKS = hasattr(torch._C.TensorBase, "_backward_hooks") and \
    hasattr(torch._C._FunctionBase, "_register_hook_dict")
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def _store(capture_ref, index: int, grad) -> None:
    """The tensor hook: add ``grad`` to the gradient kept for record ``index``; never alters it."""
    capture = capture_ref()
    if capture is not None and grad is not None:
        capture.add(index, grad)


def _remove_all(handles: dict) -> None:
    for hooks_ref, key in handles.values():
        hooks = hooks_ref()
        if hooks is not None:
            hooks.pop(key, None)
    handles.clear()


def _hook_dict(t: torch.Tensor, grad_fn):
    """The tensor's hook dict, made and attached to its ``grad_fn`` as ``Tensor.register_hook`` does.

    ``register_hook`` takes these same steps and then builds a ``RemovableHandle`` per call, which costs
    several times what ``retain_grad()`` costs; the trace removes its hooks by key instead."""
    hooks = t._backward_hooks
    if hooks is None:
        hooks = t._backward_hooks = OrderedDict()
        if grad_fn is not None:
            grad_fn._register_hook_dict(t)
    return hooks


class GradCapture:
    """The gradients one trace receives and the hooks that deliver them.

    ``selector`` is ``None`` (every op that requires grad) or a ``(func, module_call) -> bool`` test
    decided during the forward (op types and modules of a ``grads=[...]`` selection).
    """

    def __init__(self, selector=None):
        self.selector = selector
        self.sources = True  # inputs are watched (False when a type selection does not name them)
        self.grads: dict = {}  # record index -> accumulated gradient (detached; never written in place)
        self.handles: dict = {}  # record index -> (weakref to the tensor's hook dict, our key in it)
        self._token = object()  # keys are (token, index): never equal to another hook's key
        self.selected: set = set()  # record indices whose gradient the trace keeps
        self.backwards = 0
        self.sequence_numbers: dict = {}  # record index -> sequence number of its backward node
        self.first_sequence_number = None
        self.order: list = []  # record indices in the order their first gradient arrived (backward order)
        self._last_task = None
        self._self_ref = weakref.ref(self)
        self._finalizer = weakref.finalize(self, _remove_all, self.handles)

    # ----- the forward ---------------------------------------------------------------------------
    def watch(self, index: int, t: torch.Tensor, func=None, module_call: int = -1) -> None:
        """Register the gradient hook for record ``index`` (``t`` requires grad)."""
        if self.selector is not None and not self.selector(func, module_call):
            return
        self._hook(index, t)

    def _hook(self, index: int, t: torch.Tensor) -> None:
        hook = partial(_store, self._self_ref, index)
        if type(t) is not torch.Tensor or not _INLINE_HOOKS:  # subclasses dispatch register_hook themselves
            handle = t.register_hook(hook)
            self.handles[index] = (weakref.ref(handle.hooks_dict_ref()), handle.id)
        else:
            key = (self._token, index)
            grad_fn = t.grad_fn
            hooks = _hook_dict(t, grad_fn)
            hooks[key] = hook
            self.handles[index] = (weakref.ref(hooks), key)
            if grad_fn is not None:  # the backward node's id, by which profilers name its work
                self.sequence_numbers[index] = grad_fn._sequence_nr()
        self.selected.add(index)

    def watch_source(self, index: int, t: torch.Tensor) -> None:
        """An input that requires grad: its gradient is d loss / d input."""
        if self.selector is None or self.sources:
            self._hook(index, t)

    # ----- the backward --------------------------------------------------------------------------
    def add(self, index: int, grad: torch.Tensor) -> None:
        if _graph_task_id is not None:
            task = _graph_task_id()
            if task != self._last_task:
                self._last_task = task
                self.backwards += 1
        if grad.requires_grad:  # a backward with create_graph=True: keep the value, not a graph
            grad = grad.detach()
        kept = self.grads.get(index)
        if kept is None:
            # Kept by reference, not copied: autograd accumulates into a gradient buffer in place only
            # while nothing else holds it (it checks the reference count), so holding it is enough.
            self.grads[index] = grad
            self.order.append(index)
        else:
            self.grads[index] = kept + grad

    def keep_only(self, indices) -> None:
        """Remove the hooks of records not in ``indices`` (a selection decided after the forward)."""
        _remove_all({i: self.handles.pop(i) for i in [i for i in self.handles if i not in indices]})
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
    capture.first_sequence_number = _next_sequence_number()
    if policy is not None and policy.mode == 2:  # types and modules: decided during the forward
        capture.selector = policy.capture_selector(state)
        capture.sources = "input" in policy.types or bool(policy.module_ids)
    return capture


def attach_grads(trace, capture) -> None:
    """Give the finished trace its gradient capture, and apply a ``grads=[...]`` selection."""
    if capture is None:
        return
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


def _next_sequence_number():
    """Backward nodes made from here on are numbered above this (None when grad mode is off)."""
    with torch.enable_grad():
        probe = torch.zeros((), requires_grad=True) * 1
    return probe.grad_fn._sequence_nr() if probe.grad_fn is not None else None


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
