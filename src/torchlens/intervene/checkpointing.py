"""Whether the forward is now inside a ``torch.utils.checkpoint`` region whose backward will run it again.

An intervention that edits a value there would be missing from the recomputation, so the edited forward and
the gradients autograd computes would disagree; ``intervene/runtime.py`` refuses such an edit, naming the
region's kind.
"""

from __future__ import annotations

import inspect
import sys
from types import GeneratorType
from typing import NamedTuple

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
    codes = _codes_of(checkpointing)
    # Whatever the grad mode now: the backward recomputes a no_grad block inside the region too, and the ops
    # after it save what it made (torch pushes the pack hook only for a region opened with grad on).
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    code = getattr(hooks[0], "__code__", None) if hooks is not None else None
    if code is not None and code in codes.pack_hooks:
        return "non-reentrant"
    # One walk up the stack: any frame holding an open non-reentrant region decides; else the innermost
    # reentrant region's frame does.
    opener, reentrant_forward = codes.opener, codes.reentrant_forward
    reentrant, frame = None, sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code is opener:
            # Only checkpoint's own frames are read: reading another frame's locals (f_locals) attaches them
            # to that frame, which can tie a failed trace's frames into a reference cycle.
            value = frame.f_locals.get("gen")
            if type(value) is GeneratorType and value.gi_code is codes.generator and _inside_hook(value):
                return "non-reentrant"
        elif code is reentrant_forward and reentrant is None:
            reentrant = frame
        frame = frame.f_back
    if reentrant is not None:
        ctx = reentrant.f_locals.get("ctx")
        if any(fn is not None for fn, _ in getattr(ctx, "next_functions", ())):
            return "reentrant"
    return None


class _Codes(NamedTuple):
    """The code objects of ``torch.utils.checkpoint`` that mark a region on the stack (None where this torch
    lacks one: nothing on the stack is then that code)."""

    checkpoint: object  # the ``checkpoint`` function these were read from: read again when it is replaced
    pack_hooks: tuple  # the pack hook a non-reentrant region pushes (``_checkpoint_hook``'s)
    opener: object  # ``checkpoint``'s own code, whose frame holds a non-reentrant region's generator
    generator: object  # ``_checkpoint_without_reentrant_generator``'s
    reentrant_forward: object  # ``CheckpointFunction.forward``'s


_codes: list = [None]  # the last _Codes read


def _codes_of(checkpointing) -> _Codes:
    """``checkpointing``'s marking codes, read once (unwrapping ``checkpoint`` costs microseconds per edit)."""
    current = getattr(checkpointing, "checkpoint", None)
    codes = _codes[0]
    if codes is None or codes.checkpoint is not current:
        init = getattr(getattr(checkpointing, "_checkpoint_hook", None), "__init__", None)
        consts = getattr(getattr(init, "__code__", None), "co_consts", ())
        generator = getattr(checkpointing, "_checkpoint_without_reentrant_generator", None)
        opener = getattr(inspect.unwrap(current), "__code__", None) if current is not None else None
        forward = getattr(getattr(checkpointing, "CheckpointFunction", None), "forward", None)
        codes = _codes[0] = _Codes(
            current, tuple(c for c in consts if getattr(c, "co_name", None) == "pack_hook"),
            opener if getattr(generator, "__code__", None) is not None else None,
            getattr(generator, "__code__", None), getattr(forward, "__code__", None))
    return codes


def _inside_hook(generator) -> bool:
    """Whether the region's generator yielded from inside its hook: it yields before pushing one when grad
    was off as the region opened (nothing is then recomputed), and is done after the region's forward."""
    state = generator.gi_frame.f_locals if generator.gi_frame is not None and generator.gi_suspended else {}
    region = state.get("new_frame")
    return "forward_context_suppressed_exc" in state and not getattr(region, "forward_completed", True)
