"""Gradient capture: a tensor hook per recorded output, delivering d loss / d output to the trace.

With ``tl.trace(..., grads=True)`` the hot path calls ``GradCapture.watch`` for each recorded output
that requires grad.  ``watch`` adds one tensor hook (the mechanism ``retain_grad()`` uses), so that any
later backward through the traced output hands each op's gradient to the trace: d loss / d (that op's
output), accumulated over backwards as ``.grad`` accumulates.  It also notes the sequence number of the
output's backward node, by which a profiler names that node's work (report/backward_profile.py).

The hooks hold only the sink they write into, never the capture or the trace: the autograd graph never
keeps a trace alive, and the trace never keeps the graph alive (it holds the tensors' hook dicts weakly,
by key).  Every hook is removed by ``Trace.cleanup()`` or when the capture is garbage-collected with its
trace, so a later backward through the same graph is unaffected.

With torchlens-accel installed (capture/accel.py), the hooks run compiled, the same steps as the Python
code here, which stays the reference and is tested against it (tests/test_grads_accel.py): where its
``_autograd`` module is built for this torch, a plain tensor's hook is a C++ hook of autograd's own kind
(the kind ``retain_grad()`` adds, or for a leaf one in the tensor's own hook list: no Python call per op
in the backward, ``accel/src/torchlens_accel/_autograd.cpp``); otherwise the hook, the hook adder and the removal
are the C callables of ``_grads.c``.

What autograd keeps for backward is recorded separately, on request (capture/packing.py).
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter, OrderedDict
from functools import partial

import torch

from ..checks import asks_for_grads
from ..errors import first_few, warn_user
from ..record.columns import CALL_FUNC, CALL_MODULE_CALL, Record
from ..record.grads import gradient_holder, output_nodes, outputs_with_own_tensor
from ..record.layouts import storage_use_count
from ..tree import made_in_transform, tensor_leaves
from . import accel
from .teardown import until_done

# ``GradCapture.watch`` takes the steps of ``Tensor.register_hook`` itself: the public call also builds a
# ``RemovableHandle`` per hook, which costs several times what ``retain_grad()`` does.  The trace removes
# its hooks by key instead.
_PLAIN = torch.Tensor  # the tensor type whose hooks are added inline (subclasses dispatch register_hook)
_PARAMETER = torch.nn.Parameter  # added inline too: a parameter takes Tensor.register_hook's own steps
_graph_task_id = torch._C._current_graph_task_id
_sequence_nr = torch._C._autograd._get_sequence_nr

# A hook's key in a tensor's hook dict is ``capture base - record index``: an int (no tuple per hook),
# negative, so never a ``RemovableHandle`` id (those count up from 0), and in a range of its own per capture.
_KEY_SPAN = 1 << 40
_bases = itertools.count(1)
_NO_TASK = object()
TRANSFORMED = ("made inside a torch.func transform (grad, vjp, jacrev, ...): its hook saw only the transform's "
               "own backward (d of the transformed function, not of your loss), and torch refuses retain_grad() "
               "there; read the gradients of the ops outside the transform")


def _held_in_cpp():
    """What ``handles`` holds for a hook placed by the C++ adder (its hook dict: none, so nothing to pop)."""
    return None


class _Sink:
    """What the hooks write into: the gradients and the backwards that delivered them.

    The hooks hold the sink, not the capture: the autograd graph may outlive the trace, and the
    capture's death is what removes the hooks (its finalizer)."""

    __slots__ = ("grads", "order", "backwards", "task", "guarded", "held", "held_for")

    def __init__(self):
        self.grads: dict = {}  # record index -> accumulated gradient (detached; never written in place)
        self.order: list = []  # record indices in the order their first gradient arrived (backward order)
        self.backwards = 0
        self.task = _NO_TASK  # the graph task (one backward) delivering gradients here, until it ends
        self.guarded = frozenset()  # leaves counted only in a backward that reached another record first
        self.held: dict = {}  # guarded leaf -> gradient from a backward run inside ``held_for`` (``_hold``)
        self.held_for = _NO_TASK

    def guard(self, indices) -> None:
        """Count the gradients of the records ``indices`` (leaves) only in a backward that has already
        delivered a gradient here (see ``GradCapture.guard_leaves``)."""
        self.guarded = frozenset(indices)

    def settle(self, task) -> None:
        """The backward ``task`` ended: add the leaf gradients held for it (``_hold``); no backward of the
        trace runs now, until the next delivers."""
        if self.task == task:
            self.task = _NO_TASK
        if self.held_for != task:
            return  # (none held, or held for a backward still running that this one ran inside)
        held, self.held, self.held_for = self.held, {}, _NO_TASK
        for index, grad in held.items():
            kept = self.grads.get(index)
            if kept is None:
                self.grads[index] = grad
                self.order.append(index)
            else:
                self.grads[index] = kept + grad


def _store(sink: _Sink, index: int, grad, _task_id=_graph_task_id) -> None:
    """The tensor hook: add ``grad`` to the gradient kept for record ``index``; never alters it.

    Runs once per op per backward, so the accumulation is written out here rather than called (and the
    task reader is a default argument: a local, not a global lookup)."""
    if grad is None:  # an output this backward did not reach (another output of a multi-output op was used)
        return
    task = _task_id()
    if task != sink.task:
        if index in sink.guarded:
            _hold(sink, index, grad)  # a leaf reached by a backward that reached nothing else here
            return
        sink.task = task
        sink.backwards += 1
        _unshare_when_done(sink)
    if grad.requires_grad:  # a backward with create_graph=True: keep the value, not a graph
        grad = grad.detach()
    grads = sink.grads
    kept = grads.get(index)
    if kept is None:
        # Kept by reference, not copied: autograd accumulates into a gradient buffer in place only while
        # nothing else holds it (it checks the reference count); one it handed on as a view is copied when
        # the backward ends (``_unshare_when_done``).
        grads[index] = grad
        sink.order.append(index)
    else:
        grads[index] = kept + grad


_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


def _hold(sink: _Sink, index: int, grad) -> None:
    """A guarded leaf reached by a backward that reached no other record here.  Between the trace's backwards
    that is the backward of a forward after the trace: dropped.  While one runs (``sink.task``), it is a
    backward run inside it, as a reentrant checkpoint runs one to recompute its region, whose graph may hold
    no record but the leaf (a norm's ``weight.float()``): held, and added when that backward ends."""
    if sink.task is _NO_TASK:
        return
    if sink.held_for != sink.task:  # what is held for a backward that never ended (it raised) is dropped
        sink.held, sink.held_for = {}, sink.task
    if grad.requires_grad:
        grad = grad.detach()
    kept = sink.held.get(index)
    sink.held[index] = grad if kept is None else kept + grad


def _unshare_when_done(sink) -> None:
    """A backward began delivering gradients to ``sink``: once it is over, settle it (``_Sink.settle``) and
    copy each gradient it kept first whose memory another tensor shares.  A view op's backward (``w.t()``,
    ``gamma.view(...)``, ``torch.cat``'s slices) hands on a view of the gradient the trace keeps, and autograd
    stores such a view as a leaf's ``.grad`` without copying it: ``clip_grad_norm_``, ``GradScaler.unscale_``
    or ``zero_()`` on that ``.grad`` would then rewrite the trace's record.  (The C++ store does the same,
    ``_autograd.cpp``.)"""
    try:
        _queue_callback(partial(_when_done, sink, _graph_task_id(), len(sink.order)))
    except RuntimeError:  # no backward is running (a hook called by hand): nothing to wait for
        pass


def _when_done(sink, task, first: int) -> None:
    """The backward ``task`` ended: add what it held, then unshare what it kept from ``sink.order[first]`` on."""
    sink.settle(task)
    _unshare(sink, first)


def _unshare(sink, first: int) -> None:
    """Copy each gradient kept first at ``sink.order[first:]`` whose storage a tensor outside the trace holds.
    Gradients of this backward may share one storage among themselves (a view op's gradient is a view of
    its output's, and a view keeps its base alive): those owners are counted out, since nothing writes the
    trace's gradients in place."""
    grads = sink.grads
    fresh = [(index, grads.get(index)) for index in sink.order[first:]]
    fresh = [(index, grad, _storage_of(grad)) for index, grad in fresh
             if grad is not None and grad.layout == torch.strided]
    owners = Counter(storage for _, _, storage in fresh if storage is not None)
    ours = {grad._cdata for _, grad, _ in fresh}
    bases = {base._cdata: storage for _, grad, storage in fresh
             if storage is not None and (base := grad._base) is not None and base._cdata not in ours}
    owners.update(bases.values())
    for index, grad, storage in fresh:
        # Its owners when no other tensor holds it: those counted, and the storage object Python keeps for it.
        if storage is not None and storage_use_count(storage) > owners[storage] + 1:
            grads[index] = grad.clone()


def _storage_of(t: torch.Tensor):
    """The address of ``t``'s storage, or None for a tensor without storage of its own (a batched gradient)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


class LeafHooks(OrderedDict):
    """The hook dict the capture put on a leaf that had none (an input that requires grad, a parameter an op
    returned as it is).  torch runs a Python hook on a leaf for as long as it holds a hook dict, however empty, at
    every later backward: ``release`` takes the dict off again once the capture's last hook has left it."""

    def __init__(self, leaf: torch.Tensor):
        super().__init__()
        self.leaf = weakref.ref(leaf)

    def release(self) -> None:
        leaf = self.leaf()
        if not self and leaf is not None and leaf._backward_hooks is self:
            leaf._backward_hooks = None


def _python_add_hook(handles: dict, numbers: dict, keys: dict, base: int, make_hook):
    """The Python ``add_hook(index, t)``: a tensor hook ``make_hook(index)``, which writes into the sink."""
    ref = weakref.ref

    def add_hook(index: int, t: torch.Tensor, func=None, module_call: int = -1) -> None:
        if type(t) is not _PLAIN and type(t) is not _PARAMETER:  # subclasses dispatch register_hook themselves
            hook = make_hook(index)
            handle = t.register_hook(hook)
            handles[index] = handle.hooks_dict_ref
            keys[index] = handle.id
            if t.grad_fn is not None:
                numbers[index] = t.grad_fn._sequence_nr()
            return
        grad_fn = t.grad_fn
        hooks = t._backward_hooks  # Tensor.register_hook's own steps, without a handle object per call
        # A dict already on a tensor that has a backward node may be registered on an older node: torch keeps
        # it across the in-place ops that only change a tensor's shape (unsqueeze_, t_, transpose_,
        # as_strided_), where a hook added to it would get the gradient of the value before the op.  So a
        # tensor with a node gets a dict on its current node (hooks already registered keep firing).
        if hooks is None or grad_fn is not None:
            hooks = t._backward_hooks = OrderedDict() if grad_fn is not None else LeafHooks(t)
            if grad_fn is not None:
                grad_fn._register_hook_dict(t)
        hooks[base - index] = make_hook(index)
        handles[index] = ref(hooks)
        if grad_fn is not None:  # the backward node's id, by which profilers name its work
            numbers[index] = grad_fn._sequence_nr()
    return add_hook


def _cpp_fallback(sink, handles: dict, numbers: dict, keys: dict, base: int):
    """The C++ ``HookAdder``'s fallback (parameters, tensor subclasses, tensors that need no grad): Python hooks
    writing into the C++ store."""
    return _python_add_hook(handles, numbers, keys, base, sink.hook)


def _remove_all(handles: dict, keys: dict, base: int) -> None:
    """Remove the hook of every record in ``handles`` (its key: ``keys[index]`` where a subclass's
    ``register_hook`` chose it, else ``base - index``), and forget them, taking a leaf's dict off with the
    last of them (``LeafHooks``).  Takes no capture: the finalizer calls it after the capture's death."""
    for index, hooks_ref in handles.items():
        hooks = hooks_ref()
        if hooks is not None:
            hooks.pop(keys.get(index, base - index), None)
            if type(hooks) is LeafHooks:
                hooks.release()
    handles.clear()


def _remove_all_when_freed(handles: dict, keys: dict, base: int) -> None:
    """``_remove_all`` as the finalizer runs it, to the end: an interrupt landing in it (the trace dropped as a
    signal arrives) would leave the rest of the hooks on their tensors, and Python ignores what a finalizer
    raises, so no teardown would run after it."""
    until_done(partial(_remove_all, handles, keys, base))


class GradCapture:
    """The gradients one trace receives and the hooks that deliver them.

    ``selector`` is ``None`` (every op that requires grad) or a ``(func, module_call) -> bool`` test
    decided during the forward (op types and modules of a ``grads=[...]`` selection).
    """

    policy = None  # a grads=[...] selection (capture/saving.py SavePolicy), set by grad_capture

    def __init__(self, selector=None, sources: bool = True, first_sequence_number=None):
        self.selector = selector
        self.sources = sources  # inputs are watched (False when a type selection does not name them)
        # The compiled hooks (torchlens-accel), decided per capture: ``accel.use`` applies to later traces.
        self._cpp = cpp = accel.compiled("_autograd")
        if cpp is not None:  # (the common case first: set-up is a fixed cost of every trace)
            self._native = None
            self._sink = cpp.Sink()
        else:
            self._native = accel.compiled("_grads")
            self._sink = _Sink() if self._native is None else self._native.Sink(_graph_task_id, _unshare_when_done)
        self.handles: dict = {}  # record index -> weakref to the hook dict holding its hook
        self._base = -_KEY_SPAN * next(_bases)
        self._keys: dict = {}  # record index -> key, where a subclass's register_hook chose it
        self.selected: set = set()  # record indices whose gradient the trace keeps (set after the forward)
        self.sequence_numbers: dict = {}  # record index -> sequence number of its backward node
        self.first_sequence_number = first_sequence_number
        self.hidden: frozenset = frozenset()  # records whose gradients came from a torch.func transform
        # Not ``__del__``: the collector clears the weakrefs in ``handles`` with the trace's other garbage
        # before finalizers run; the finalizer's own reference keeps them out of that garbage.  (The
        # compiled adders remove the hooks themselves when they die, with the capture: see _grads.c.)
        if self._native is None and self._cpp is None:
            weakref.finalize(self, _remove_all_when_freed, self.handles, self._keys, self._base)
        self.add_hook = self._hook_adder()
        if selector is None:
            self.watch = self.add_hook

    @property
    def grads(self) -> dict:
        grads = self._sink.grads
        if self.hidden:
            return {i: g for i, g in grads.items() if i not in self.hidden}
        return grads

    @property
    def order(self) -> list:
        order = self._sink.order
        return [i for i in order if i not in self.hidden] if self.hidden else order

    @order.setter
    def order(self, indices) -> None:
        self._sink.order = list(indices)

    @property
    def backwards(self) -> int:
        return self._sink.backwards

    @property
    def incomplete(self) -> frozenset:
        """Records whose gradient was dropped: torch removed their hook, then a backward ran (the C++
        path's leaves, ``_autograd.cpp``; the other sinks' hooks are never removed by torch)."""
        return getattr(self._sink, "incomplete", frozenset())

    @backwards.setter
    def backwards(self, n: int) -> None:
        self._sink.backwards = n

    # ----- the forward ---------------------------------------------------------------------------
    def watch(self, index: int, t: torch.Tensor, func=None, module_call: int = -1) -> None:
        """Add the gradient hook for record ``index`` (``t`` requires grad), if the selection wants it."""
        selector = self.selector  # a grads=[...] selection of op types or modules
        if selector is not None and not (selector(func, module_call) if func is not None else self.sources):
            return  # (func is None for the model's inputs)
        self.add_hook(index, t)

    def _hook_adder(self):
        """``add_hook(index, t)``, run once per op: what it reads are closure cells, not attributes.

        Without a selection it is also ``watch`` itself (an instance attribute), one call less per op.  On
        the compiled paths it is a ``HookAdder`` taking plain tensors itself and every other call to the
        Python ``add_hook`` (which the C++ adder makes only when first needed: set-up is a fixed cost of
        every trace).  (No reference to the capture: its death is what removes the hooks.)"""
        sink, handles, numbers, keys, base = self._sink, self.handles, self.sequence_numbers, self._keys, self._base
        if self._cpp is not None:
            return self._cpp.HookAdder(sink, handles, numbers, keys, base, _held_in_cpp, _PLAIN, _cpp_fallback,
                                       _remove_all)
        native = self._native
        make_hook = partial(partial, _store, sink) if native is None else partial(native.Hook, sink)
        add_hook = _python_add_hook(handles, numbers, keys, base, make_hook)
        if native is not None:  # the same steps in C for plain tensors; add_hook takes every other call
            return native.HookAdder(sink, handles, numbers, keys, base, _PLAIN, OrderedDict, LeafHooks, add_hook)
        return add_hook

    def rewatch(self, index: int, t: torch.Tensor, calls: list, record) -> None:
        """An intervention replaced record ``index`` (the tuple ``record``): its gradient is now that of ``t``,
        the value downstream ops saw (the hook moves from the op's own output to it).  A value that needed
        no gradient replaced by one that does (a steering vector being learnt on a frozen model) is watched
        as the op would have been had it made that value."""
        watched = self._unwatch(index)
        if not t.requires_grad:
            return
        if watched:
            self.add_hook(index, t)  # already selected when first watched
        else:
            self.watch(index, t, *made_by(calls, Record._make(record)))

    def _unwatch(self, index: int) -> bool:
        """Remove record ``index``'s hook; whether it had one."""
        handle = self.handles.pop(index, None)
        if handle is None:
            return False
        _remove_all({index: handle}, self._keys, self._base)
        if self._cpp is not None:
            self.add_hook.remove((index,))
        self._keys.pop(index, None)
        return True

    def follow_new_node(self, index: int, t: torch.Tensor, grad_fn, func, module_call: int) -> None:
        """``Function.apply`` gave record ``index``'s tensor ``t`` a new backward node ``grad_fn`` after
        the record was made (inside ``Function.forward``, under ``no_grad``, or as a view ``_wrap_outputs``
        made): the hook goes to that node, the only one a backward runs for ``t``.

        A hook dict already on ``t`` (the pure-Python path's, or the user's) was registered on the old
        node; torch does not move it, so it is registered on the new one here, or a hook the user adds
        to ``t`` later would land in a dict no backward reads."""
        number = grad_fn._sequence_nr()
        if self.sequence_numbers.get(index) == number:
            return  # already followed (a Function returning another Function's output unchanged)
        self._unwatch(index)
        if t._backward_hooks is not None:
            grad_fn._register_hook_dict(t)
        self.watch(index, t, func, module_call)
        self.sequence_numbers[index] = number

    def run_after_user_hook(self, index: int, t: torch.Tensor) -> None:
        """The user registered a hook on record ``index``'s tensor ``t`` during the forward: move the
        trace's hook behind it, so that the gradient kept is the one the user's hooks hand on, as
        ``retain_grad()``'s (which torch runs after every tensor hook) would be.  A leaf's C++ hook is gone
        already (torch empties a leaf's hook list when its first hook dict is set): it is placed again,
        after the dict."""
        if index not in self.handles:
            return
        self._unwatch(index)
        self.add_hook(index, t)  # appended: after the user's hook dict on the node, or in that dict

    def watch_source(self, index: int, t: torch.Tensor) -> None:
        """An input that requires grad: its gradient is d loss / d input."""
        self.watch(index, t, None, -1)

    # ----- after the forward ---------------------------------------------------------------------
    def keep_only(self, indices) -> None:
        """Remove the hooks of records not in ``indices`` (a selection decided after the forward)."""
        dropped = [i for i in self.handles if i not in indices]
        _remove_all({i: self.handles.pop(i) for i in dropped}, self._keys, self._base)
        if self._cpp is not None:
            self.add_hook.remove(dropped)
        self.selected.intersection_update(indices)

    def hide_transformed(self) -> frozenset:
        """Hide, and stop watching, the records whose gradient arrived during the forward from inside a
        torch.func transform (``grad``, ``vjp``, ``jacrev``): their hooks were registered on the transform's
        wrapped tensors, so what they received is the transform's own inner backward, functorch-wrapped,
        never d loss / d output.  The backwards that delivered only those are not counted.  Returns them."""
        received = self._sink.grads  # what arrived during the forward: usually nothing
        hidden = frozenset(i for i, g in received.items() if made_in_transform(g))
        if not hidden:
            return hidden
        for index in hidden:
            self._unwatch(index)
        if hidden == set(received):
            self.backwards = 0
        self.hidden = hidden
        return hidden

    def guard_leaves(self, trace) -> None:
        """Count a leaf's gradient only in a backward that reached another of this trace's records first.

        A leaf (an input that requires grad, a parameter an op returns as it is: ``w.flatten(1)`` of a 2-D
        weight) belongs to every graph built from it, so a backward of a forward run after the trace reaches
        its hook too.  With every op watched (``grads=True``), a backward through the traced ops reaches an
        op that read the leaf before the leaf itself (autograd accumulates into a leaf once all its
        consumers are done), so a leaf reached first belongs to another forward, or to a backward run inside
        one of the trace's, as a reentrant checkpoint runs one, which is held until that ends (``_hold``).
        Not guarded: the leaves the forward returned (their gradient may come straight from the loss), and
        every leaf when a selection watches only some ops or no op has a backward node."""
        numbers, handles = self.sequence_numbers, self.handles
        if self.selector is not None or self.policy is not None or not numbers or len(handles) <= len(numbers):
            return  # a hook without a sequence number is a leaf's: usually there is none
        returned = _returned(trace)
        leaves = [i for i in handles if i not in numbers and i not in returned]
        if leaves:
            self._sink.guard(leaves)

    def remove_hooks(self) -> None:
        if self._cpp is not None:
            self.add_hook.remove()
        if self._native is None:
            _remove_all(self.handles, self._keys, self._base)
        else:
            self._native.remove_hooks(self.handles, self._keys, self._base)

    def release_grads(self) -> None:
        """Let go of every gradient kept (``Trace.cleanup``); the order and the count of backwards stay."""
        clear = getattr(self._sink, "clear", None)  # the C++ store's; the other sinks' grads are a dict
        if clear is not None:
            clear()
        else:
            self._sink.grads.clear()


# ----- set-up and hand-over, called by capture/session.py ---------------------------------------
# grads=True on a forward none of whose tensors required grad: every op's .grad would say so one by one, and a
# backward through log.output fails in autograd ("does not require grad"); said once, when the trace is made.
NOTHING_REQUIRES_GRAD = ("grads=True, but no tensor of this forward requires grad, so no backward can give any op "
                         "a gradient: it ran under torch.no_grad() or torch.inference_mode() (an evaluation "
                         "function decorated with one), or nothing it read requires grad (frozen parameters, "
                         "inputs without requires_grad); trace outside them, or drop grads=")
# Where the model's quantized modules hold packed weights, which are no tensors and take no gradient.
PACKED_TAKE_NO_GRAD = (". This model's quantized modules compute with packed weights ({}), not parameters: no "
                       "gradient reaches them, nor through them the ops before; trace the float model for gradients")
# The same inside a torch.func transform (vmap): its wrapped tensors require no grad as autograd sees them.
TRANSFORM_REQUIRES_NO_GRAD = ("grads=True, but this trace ran inside a torch.func transform (vmap, ...), whose "
                              "wrapped tensors do not require grad as autograd sees them, so no backward can give "
                              "any op a gradient; trace outside the transform, or use the gradients it computes")


def grad_capture(grads, model, state):
    """The ``GradCapture`` for ``tl.trace(..., grads=...)``, or None when gradients are off."""
    if grads is True:  # the common case, first: set-up is a fixed cost of every trace
        return GradCapture(None, True, _next_sequence_number())
    if not asks_for_grads(grads):
        return None
    first = _next_sequence_number()
    if grads == "all":
        capture = GradCapture()
    else:
        from .saving import SavePolicy

        policy = SavePolicy(grads, model, option="grads")
        if policy.mode == 2:  # types and modules: decided during the forward
            capture = GradCapture(policy.capture_selector(state), "input" in policy.types or bool(policy.module_ids))
        else:
            capture = GradCapture()
        capture.policy = policy
    capture.first_sequence_number = first
    return capture


def attach_grads(trace, capture, own_outputs: bool = False, packed_weights: tuple = ()) -> None:
    """Give the finished trace its gradient capture, and apply a ``grads=[...]`` selection.  ``own_outputs``:
    an output node may show a tensor of its own (the forward read tensors no op made, or returned one
    written through a view): ``_watch_own_outputs`` looks.  ``packed_weights``: the quantized modules' packed
    weights the model holds, named where no tensor required grad."""
    if capture is None:
        return
    trace._gradcap = capture
    hidden = capture.hide_transformed()
    if hidden:
        trace._unsaved_grads = {**trace._unsaved_grads, **dict.fromkeys(hidden, TRANSFORMED)}
    if own_outputs:
        _watch_own_outputs(trace, capture)
    capture.selected = set(capture.handles)
    policy = capture.policy
    if policy is None:
        if not capture.handles:  # grads=True hooks every output that requires grad: there was none
            in_transform = torch._C._functorch.peek_interpreter_stack() is not None
            warn_user(TRANSFORM_REQUIRES_NO_GRAD if in_transform else
                      NOTHING_REQUIRES_GRAD + (PACKED_TAKE_NO_GRAD.format(first_few(packed_weights))
                                               if packed_weights else ""))
        capture.guard_leaves(trace)
        return
    try:
        policy.check_matched(trace, option="grads")
    except KeyError:
        capture.remove_hooks()  # the trace is not returned: nothing it registered may stay
        raise
    if policy.filters_after:
        kept = {i for i in capture.selected if policy.keep(trace, trace.ops[i])}
        # An output node shows its producer's gradient (record/grads.py ``gradient_holder``): selecting it keeps that.
        kept.update(gradient_holder(trace, i) for i in output_nodes(trace) if policy.keep(trace, trace.ops[i]))
        capture.keep_only(kept)


def made_by(calls: list, record) -> tuple:
    """``(func, module call)`` of the call that made ``record``; ``(None, -1)`` for a source (an input)."""
    call = calls[record.call] if 0 <= record.call < len(calls) else None
    return (call[CALL_FUNC], call[CALL_MODULE_CALL]) if call is not None else (None, -1)


def requires_grad_changed(state, t) -> None:
    """``t.requires_grad_()`` or ``t.requires_grad = flag`` ran in the forward: ``t`` is a leaf (torch
    allows no other), so the record whose value it still is now says what ``t`` needs, and with
    gradients on, a leaf that now requires grad gets the hook of that record (``zeros(n).requires_grad_()``,
    an input made differentiable inside the forward)."""
    index = state.record_holding(t) if isinstance(t, torch.Tensor) else None
    if index is None:
        return  # made where the capture did not see it, or written since
    record = Record._make(state.records[index])
    flag = t.requires_grad
    if record.requires_grad == flag:
        return
    state.records[index] = tuple(record._replace(requires_grad=flag))
    capture = state.grads
    if capture is None:
        return
    if flag:
        capture.watch(index, t, *made_by(state.calls, record))
    else:
        capture._unwatch(index)


def _returned(trace) -> set:
    """The records the forward returned: its output nodes and the records whose tensors they show.  Read
    from the raw record while the trace has it (the columns are derived on first read, not for this)."""
    raw = trace._raw
    if raw is not None and raw.records is not None and raw.outputs is not None:  # (each let go once derived)
        first = len(raw.records)  # the output nodes follow the records
        return {*range(first, first + len(raw.outputs)), *(producer for _, producer, _ in raw.outputs)}
    outputs = output_nodes(trace)
    return {*outputs, *(gradient_holder(trace, i) for i in outputs)}


def _watch_own_outputs(trace, capture) -> None:
    """An output node showing a tensor of its own (a parameter returned as it is, a tensor last written
    through a view) shows no producer's gradient: it gets a hook of its own, under its own index."""
    own = set(outputs_with_own_tensor(trace))
    for index, (_, t) in zip(output_nodes(trace), tensor_leaves(trace.output, attrs=True)):
        if index in own and t.requires_grad:
            capture.watch_source(index, t)


def _next_sequence_number():
    """Backward nodes made from here on are numbered above this (this thread's counter, less one)."""
    return _sequence_nr() - 1
