"""Custom autograd Functions under a trace with gradients: where their outputs' gradients arrive.

``Function.apply`` runs ``forward`` under ``no_grad`` (its ops are recorded there, needing no gradient)
and only then gives each output the Function's backward node; an output that is one of the inputs is
first made a view of it (``_wrap_outputs``), recorded with that view's node.  No op follows that the
capture sees, so while a trace with gradients runs, ``Function.apply`` is wrapped to report its outputs
(``FunctionOutputs``), and each output that is a record's tensor has its record and gradient hook moved
to the Function's node.  torch.utils.checkpoint's reentrant regions and nn.Module's full backward hooks
are such Functions.  With ``saved_for_backward=True`` the wrapper also tells the pack log when a Function
runs, since torch packs what it keeps only as ``apply`` returns (capture/packing.py).  In a profiled trace
(``kernel_profile``) it tells the profiler markers which op made the output each Function's node differentiates,
the op a backward-only profile of a trace with gradients charges that node's backward to.
"""

from __future__ import annotations

import threading
import warnings

import torch

from ..record.columns import Record
from .grads import made_by
from .teardown import release_stranded, until_done

# ``Function.apply`` reaches torch's C ``apply`` through ``super().apply``, looked up from the class above it
# at each call: the wrapper goes on that class, so it also sees the calls of an ``apply`` bound before the
# trace (``square = Square.apply``, a common idiom), which a wrapper replacing ``Function.apply`` would miss.
# Where torch's ``Function.apply`` does not call ``super().apply``, ``Function.apply`` itself is wrapped.
_Function = torch.autograd.Function
_ABOVE = _Function.__mro__[1]


def _calls_super_apply(apply) -> bool:
    # Since torch 2.14 ``Function.apply`` is torch's C ``apply`` itself: no Python code, no ``super`` call.
    code = getattr(getattr(apply, "__func__", None), "__code__", None)
    return code is not None and "super" in code.co_names


def _unbound(apply):
    """What to call as ``apply(cls, *args)``: a classmethod's function, or torch's C ``apply`` descriptor,
    which takes the class as its first argument."""
    return getattr(apply, "__func__", apply)


_HOST = _ABOVE if _calls_super_apply(_Function.apply) and "apply" not in vars(_ABOVE) else _Function
# Where ``Function.apply`` is torch's C ``apply`` (torch 2.14 on), an ``apply`` bound before the trace is C
# bound to its class: nothing of it reaches the wrapper, and its outputs' records would say they need no
# gradient.  Said once, at the first trace with gradients, as this torch is outside the verified range.
BOUND_APPLY_UNSEEN = None if _calls_super_apply(_Function.apply) else (
    f"torch {torch.__version__} (newer than this torchlens supports: torch<2.14) runs autograd.Function.apply "
    "in C: a Function's apply bound before the trace (square = Square.apply) runs unseen, and the records of "
    "its outputs say they need no gradient; call Square.apply(...) itself, or use torch<2.14")
_ORIGINAL_APPLY = vars(_HOST).get("apply")  # None: the host inherits torch's C ``apply``
_receivers: dict = {}  # thread id -> what runs that thread's Function.apply calls while it traces
_receivers_lock = threading.RLock()  # reentrant: a hold stranded by an interrupt on a ``with`` exit line is dropped


if _ORIGINAL_APPLY is None:
    def _torch_apply(cls, *args, **kwargs):
        return super(_HOST, cls).apply(*args, **kwargs)
else:
    _torch_apply = _unbound(_ORIGINAL_APPLY)


def _apply(cls, *args, **kwargs):
    receiver = _receivers.get(threading.get_ident())
    if receiver is None:
        return _torch_apply(cls, *args, **kwargs)
    return receiver(cls, args, kwargs)  # runs the apply, and sees it


_apply.__name__ = _apply.__qualname__ = "apply"
_WRAPPED_APPLY = classmethod(_apply)


class FunctionOutputs:
    """Capture part (capture/teardown.py): while entered, this thread's ``Function.apply`` calls go to
    ``receiver(cls, args, kwargs)``, which runs them.  ``Function.apply`` is wrapped while any thread's trace
    needs it, and torch's is back once none does."""

    def __init__(self, receiver, grads: bool):
        self.receiver = receiver
        self.grads = grads
        self.installed = False
        self.thread = threading.get_ident()  # the tracing thread (a forked child releases it from its own)

    def __enter__(self):
        if BOUND_APPLY_UNSEEN is not None and self.grads:
            warnings.warn(BOUND_APPLY_UNSEEN, RuntimeWarning, stacklevel=2)
        try:
            with _receivers_lock:
                _receivers[self.thread] = self.receiver
                self.installed = True
                if vars(_HOST).get("apply") is not _WRAPPED_APPLY:
                    _HOST.apply = _WRAPPED_APPLY
            return self
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        until_done(self.release)
        return False

    def release(self) -> None:
        release_stranded(_receivers_lock)
        if not self.installed:
            return
        with _receivers_lock:
            if _receivers.get(self.thread) is self.receiver:
                del _receivers[self.thread]
            if not _receivers and vars(_HOST).get("apply") is _WRAPPED_APPLY:
                if _ORIGINAL_APPLY is None:
                    del _HOST.apply
                else:
                    _HOST.apply = _ORIGINAL_APPLY
            self.installed = False


def function_outputs(state, capture, packing) -> FunctionOutputs:
    """The ``FunctionOutputs`` part of a trace with gradients (``capture``), noting what backward keeps
    (``packing``) or driving profiler markers (``state.markers``): each output of a ``Function.apply`` that is
    a record's tensor has its record and hook moved to the Function's backward node, what torch packs for the
    Function is kept by its output op, and the markers learn which op's output the node differentiates."""
    receive = None if capture is None else _output_receiver(state, capture)
    note = None if state.markers is None else _node_noter(state, state.markers, dirty=capture is None)

    def run(cls, args, kwargs):
        out = _torch_apply(cls, *args, **kwargs) if packing is None else packing.within_function(
            _torch_apply, cls, args, kwargs)
        if receive is not None:
            receive(out, args)
        if note is not None:
            note(out, args)
        return out

    return FunctionOutputs(run, grads=capture is not None)


def _tensors_out(out) -> tuple:
    """The tensors ``apply`` returned, in order (a Function may return a tuple holding other values)."""
    found = (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (tuple, list)) else ()
    return tuple(t for t in found if isinstance(t, torch.Tensor))


def _node_noter(state, markers, dirty: bool):
    """``note(out, args)``: for each output of a ``Function.apply`` that a record holds and that has a backward
    node, tells ``markers`` the call that made the record.  The profiler numbers the node inside ``apply``, outside
    every op's range, so without this the join could charge its backward to no op.  ``dirty`` (no gradient
    capture, which does it otherwise): an argument handed back, marked dirty, has its version move noted first,
    or no record would hold it any more."""
    records = state.records

    def note(out, args) -> None:
        for t in _tensors_out(out):
            if dirty and any(t is a for a in args):
                state.note_version_bump(t)
            grad_fn = t.grad_fn
            index = None if grad_fn is None else state.record_holding(t)
            if index is not None:
                markers.function_node(grad_fn._sequence_nr(), Record._make(records[index]).call)

    return note


def _output_receiver(state, capture):
    records, calls = state.records, state.calls

    def receive(out, args) -> None:
        for t in _tensors_out(out):
            if any(t is a for a in args):
                # torch hands an argument back as itself only when the forward marked it dirty, and then
                # moves its version counter once more, after the forward's in-place op was recorded.
                state.note_version_bump(t)
            if not t.requires_grad:
                continue  # not differentiable (mark_non_differentiable, an integer result)
            index = state.record_holding(t)
            if index is None:
                continue  # made where the capture did not see it, or written since: no record holds this value
            grad_fn = t.grad_fn
            if grad_fn is None:
                continue
            record = Record._make(records[index])
            # It requires grad now, through this node.
            records[index] = tuple(record._replace(requires_grad=True, grad_fn_class=type(grad_fn)))
            capture.follow_new_node(index, t, grad_fn, *made_by(calls, record))

    return receive
