"""Tensors a call reads that capture never saw made: made before the forward, on another thread, or by code that
never reaches ``__torch_function__``.  Each read is counted (``Trace.unattributed``) and the tensor kept by weak
reference, so that finalize can name a module attribute holding it.

``torch.vmap`` makes its batched tensors that way, below ``__torch_function__``: the first call reading one runs
on one example's shape while its kernel runs on the whole batch, and so do the ops reading that call's outputs.
The call's position is noted (``per_example_calls``); ``record.columns.per_example_ops`` derives the ops.
The functions taking ``self`` are methods of ``CaptureState``.
"""

from __future__ import annotations

from weakref import ref as weakref

import torch

from ..tree import made_in_transform


def note_outside(self, t: torch.Tensor) -> int:
    """Count a read of ``t``, a tensor from outside the trace, and keep it by weak reference: its parent, -1."""
    self.unattributed += 1
    if made_in_transform(t) and holds_one_example(t):
        if self.per_example_calls is None:
            self.per_example_calls = set()
        self.per_example_calls.add(len(self.calls))  # the call being scanned: it is appended after its arguments
    if self.outside is None:
        self.outside = {}
    known = self.outside.get(id(t))
    if known is None or known() is not t:
        self.outside[id(t)] = weakref(t)
    return -1


def holds_one_example(t: torch.Tensor) -> bool:
    """Whether ``t`` is, or wraps, ``torch.vmap``'s batched tensor: its shape is one example's, where the kernels
    run on the whole batch (a ``torch.func.grad`` wrapper alone keeps the real shape)."""
    functorch = torch._C._functorch
    while made_in_transform(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False
