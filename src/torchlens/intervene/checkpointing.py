"""Whether the forward is now inside a ``torch.utils.checkpoint`` region whose backward will run it again.

An intervention that edits a value there would be missing from the recomputation, so the edited forward and
the gradients autograd computes would disagree; ``intervene/runtime.py`` refuses such an edit, naming the
region's kind.
"""

from __future__ import annotations

import sys

import torch


def checkpoint_region():
    """``"non-reentrant"`` or ``"reentrant"`` when the forward is now inside a ``torch.utils.checkpoint``
    region whose backward will recompute it (an edit made here would be missing from the recomputation),
    else None.  Looked at only when an action changes a value, never per op.

    A non-reentrant region is open while its pack hook is the innermost saved-tensors hook (a saved-tensors
    hook the model pushes inside the region hides it: not detected).  A reentrant region
    runs its forward inside ``CheckpointFunction.forward`` (found on the stack), under no_grad; its
    backward happens only when autograd recorded the call, which gave the node its next functions."""
    checkpointing = sys.modules.get("torch.utils.checkpoint")
    if checkpointing is None:
        return None
    # Whatever the grad mode now: the backward recomputes a no_grad block inside the region too, and the ops
    # after it save what it made (torch pushes the pack hook only for a region opened with grad on).
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    code = getattr(hooks[0], "__code__", None) if hooks is not None else None
    if code is not None and any(code is pack for pack in _pack_hook_codes(checkpointing)):
        return "non-reentrant"
    function = getattr(checkpointing, "CheckpointFunction", None)
    code = getattr(getattr(function, "forward", None), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    if frame is not None:
        ctx = frame.f_locals.get("ctx")
        if any(fn is not None for fn, _ in getattr(ctx, "next_functions", ())):
            return "reentrant"
    return None


def _pack_hook_codes(checkpointing) -> tuple:
    """The code of the pack hook a non-reentrant checkpoint region pushes (``_checkpoint_hook``'s)."""
    init = getattr(getattr(checkpointing, "_checkpoint_hook", None), "__init__", None)
    consts = getattr(getattr(init, "__code__", None), "co_consts", ())
    return tuple(c for c in consts if getattr(c, "co_name", None) == "pack_hook")
