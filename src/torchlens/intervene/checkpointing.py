"""Whether the forward is now inside a ``torch.utils.checkpoint`` region whose backward will run it again.

An intervention that edits a value there would be missing from the recomputation, so the edited forward and
the gradients autograd computes would disagree; ``intervene/runtime.py`` refuses such an edit, naming the
region's kind.
"""

from __future__ import annotations

import inspect
import sys
from types import GeneratorType

import torch


def checkpoint_region():
    """``"non-reentrant"`` or ``"reentrant"`` when the forward is now inside a ``torch.utils.checkpoint``
    region whose backward will recompute it (an edit made here would be missing from the recomputation),
    else None.  Looked at only when an action changes a value, never per op.

    A non-reentrant region is open while its pack hook is the innermost saved-tensors hook, or, under a
    saved-tensors hook the model pushed inside it, while a frame on the stack holds the region's generator
    suspended inside its hook (torch exposes only the innermost hook).  A reentrant region
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
    frame = sys._getframe(1)
    if _holds_open_region(checkpointing, frame):
        return "non-reentrant"
    function = getattr(checkpointing, "CheckpointFunction", None)
    code = getattr(getattr(function, "forward", None), "__code__", None)
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


def _holds_open_region(checkpointing, frame) -> bool:
    """Whether a frame from ``frame`` up holds a non-reentrant region's generator (``checkpoint`` runs the
    region's function between its two ``next(gen)``) suspended inside the region's saved-tensors hook."""
    code = getattr(getattr(checkpointing, "_checkpoint_without_reentrant_generator", None), "__code__", None)
    opener = getattr(inspect.unwrap(getattr(checkpointing, "checkpoint", None)), "__code__", None)
    if code is None or opener is None:
        return False
    # Only checkpoint's own frames are read: reading another frame's locals (f_locals) attaches them to
    # that frame, which can tie a failed trace's frames into a reference cycle.
    while frame is not None:
        value = frame.f_locals.get("gen") if frame.f_code is opener else None
        if type(value) is GeneratorType and value.gi_code is code and _inside_hook(value):
            return True
        frame = frame.f_back
    return False


def _inside_hook(generator) -> bool:
    """Whether the region's generator yielded from inside its hook: it yields before pushing one when grad
    was off as the region opened (nothing is then recomputed), and is done after the region's forward."""
    state = generator.gi_frame.f_locals if generator.gi_frame is not None and generator.gi_suspended else {}
    region = state.get("new_frame")
    return "forward_context_suppressed_exc" in state and not getattr(region, "forward_completed", True)
