"""Ops that return their argument itself, and the names a module's caller keeps for that tensor.

``x.to()`` of the dtype ``x`` has, ``contiguous()`` of a contiguous tensor and dropout in eval mode hand back
the very tensor they were given.  The code after such an op reads it as the op's result; the caller of the
module call it ran in still holds the tensor under the name it passed, and can only get the op's result
from what the call returns.  ``note_pass_through`` notes such an op (called by the capture handlers, the
compiled one included, before the output is bound), ``note_returned_arguments`` each such output of a call
returning several tensors, and ``end_pass_through`` (called by the module-call recorders as each call ends)
binds the tensor back to its earlier producer when the call returned something else.  All three are methods of
``CaptureState``.
"""

from __future__ import annotations

from weakref import ref as weakref

import torch

from ..record.columns import writes_first_argument
from .bindings import is_bound


def note_pass_through(self, t: torch.Tensor, record: int, module_call: int, func) -> None:
    """An op inside module call ``module_call`` returned its argument ``t`` itself, unwritten (``x.to()``
    of the dtype it has, eval-mode dropout, ``contiguous()`` of a contiguous tensor), as record ``record``.

    Called before ``t`` is bound to ``record``.  The code after the op in that call reads ``t`` as the op's
    result, but its caller still holds ``t`` under the name it passed (Llama's residual, read after the
    norm whose ``.to(float32)`` returned it, or the other projections of a LoRA layer reading the input
    whose adapter's dropout returned it), and can only get the op's result by the call returning it.  So
    when the call returns something else, ``t`` is bound back to what it was (``end_pass_through``)."""
    entry = self.producers.get(id(t))
    if entry is None or not is_bound(entry, t):
        return  # no producer to go back to (a tensor from outside the trace): the op is its first
    # By name, on each such op: a process-wide cache of the verdict would keep the function (a model's own, whose
    # closure may hold the model) alive.
    if writes_first_argument(func):
        return  # an in-place call that moves no version counter (resize_, detach_): its result stands
    pending = self.pass_through
    if pending is None:
        self.pass_through = [[module_call, id(t), entry, record]]
    else:
        pending.append([module_call, id(t), entry, record])


def note_returned_arguments(self, out, args: tuple, leaves, first_op: int, module_call: int, func) -> None:
    """A call inside module call ``module_call`` returned several tensors (``leaves``, recorded from ``first_op``
    on), unwritten: each that is one of its arguments itself (``torch.broadcast_tensors`` of a tensor already
    of the broadcast shape, ``torch.atleast_2d(a, b)`` of matrices) is noted as ``note_pass_through`` notes the
    one a single-output call returns.  Called before the outputs are bound."""
    if not isinstance(out, (tuple, list)):
        return  # the leaves of a write (``x[i] = v``, a collective): that argument was written, not handed back
    for k, (_, t) in enumerate(leaves):
        for arg in args:
            if t is arg:
                self.note_pass_through(t, first_op + k, module_call, func)
                break


def end_pass_through(self, index: int, parent: int, returned: tuple) -> None:
    """Module call ``index`` (inside ``parent``, -1 for none) ended returning the records ``returned``:
    each tensor an op in it (or in a call inside it that raised) returned itself goes back to its
    earlier producer, unless this call returned it, when it stays the op's result in ``parent``."""
    pending = self.pass_through
    if len(pending) == 1 and pending[0][0] < index:
        return  # (the common case: one, noted in a call this one is inside)
    producers = self.producers
    keep = []
    for item in pending:
        if item[0] < index:
            keep.append(item)
            continue
        module_call, key, before, record = item
        t = before[0] if type(before[0]) is not weakref else before[0]()
        if t is None:
            continue
        entry = producers.get(key)
        if entry is not None and (entry[1] != record or not is_bound(entry, t)):
            continue  # written or rebound since: that binding stands
        if entry is not None and module_call == index and record in returned:
            if parent >= 0:
                item[0] = parent
                keep.append(item)
            continue  # returned by this call (out of the root forward: for good)
        producers[key] = before  # its caller's name for it: the value it had before the op
    self.pass_through = keep or None
