"""The parameters as each op read them, for replay (``validate``): a private copy of a parameter as it was when
the op ran (before a later write in the forward, with the ``requires_grad`` flag it had then), or why that value
cannot be had (written by a call capture could not see or predict, changed since the trace, memory freed by FSDP2);
and, for an op whose compiled code reads its module's parameters where they are now, whether they are still the
tensors it read."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..record.layouts import memory_freed
from ..record.model_index import traced_address
from ..record.params import changed_since
from ..record.replay_context import UNSEEN_WRITE
from ..capture.compiled import module_tensors
from ..copies import copy_with_layout
from ..tree import TENSOR_TYPES

COMPILED_SWAPPED = ("its module's parameters or buffers are not the tensors its compiled code read when it ran "
                    "(torch.func.functional_call swapped others in for the call, or they were replaced since the "
                    "trace), so replay cannot read what it read")


def compiled_reads_changed(log, replay, module, call_position: int):
    """Why the parameters of ``module``, which a ``compiled`` op's code reads where they are now rather than from
    its recorded arguments, may no longer be those it read; None when they are."""
    if not _holds_what_it_read(log, module, call_position):
        return COMPILED_SWAPPED
    for param in module.parameters():
        writes = replay.param_writes.get(id(param), ()) if replay is not None else ()
        if any(write_call == UNSEEN_WRITE or write_call >= call_position for write_call, _ in writes):
            return (f"parameter changed by the forward: parameter {_param_name(log, param)}, which its compiled code "
                    "reads where it is now, was written after it ran")
        why = _changed_since_trace(log, replay, param)
        if why is not None:
            return why
    return None


def _holds_what_it_read(log, module, call_position: int) -> bool:
    """Whether ``module`` holds the very tensors its compiled code read at ``call_position`` (capture noted them
    by weak reference: a dead one is no tensor the module holds now).  Unknown reads as no."""
    held = log._held_by_compiled
    refs = held.get(call_position) if held is not None else None
    now = module_tensors(module)
    return refs is not None and len(refs) == len(now) and all(ref() is t for ref, t in zip(refs, now))


def _changed_since_trace(log, replay, param):
    if replay is None or not changed_since(replay, param):
        return None
    layout = replay.param_layouts.get(id(param))
    if layout is not None and layout != (param.shape, param.dtype):  # its data replaced: no version moved
        shape, dtype = layout
        return (f"parameter {_param_name(log, param)} changed since the trace: its forward read a {dtype} tensor of "
                f"shape {tuple(shape)}, it now holds a {param.dtype} one of shape {tuple(param.shape)} (a cast such "
                "as model.half(), or a resize): validate right after tracing")
    return (f"parameter {_param_name(log, param)} changed since the trace (an optimizer step?): "
            "validate right after tracing")


def param_as_it_ran(log, replay, param, call_position: int) -> tuple:
    """``(private copy of the parameter as the call saw it, None)`` or ``(None, why not)``."""
    value = param
    writes = replay.param_writes.get(id(param)) if replay is not None else None
    for write_call, before in writes or ():
        if write_call == UNSEEN_WRITE:
            return None, (f"parameter changed by the forward: parameter {_param_name(log, param)} was written by "
                          "a call capture cannot see (Tensor.set_, as assigning a parametrized tensor makes), so "
                          "its value when this op ran is unknown")
        if write_call >= call_position:  # the first write at or after this call: the value before it
            if before is None:
                return None, (f"parameter changed by the forward: parameter {_param_name(log, param)} was written by "
                              "a call capture could not predict, so its value when this op ran is unknown")
            value = before
            break
    if value is param and memory_freed(param):  # FSDP2's unsharded parameters, freed after each forward
        return None, (f"parameter {_param_name(log, param)}'s memory was freed after the forward (FSDP2 reshards "
                      "after forward; fully_shard(..., reshard_after_forward=False) keeps it), so the value this "
                      "op read is gone")
    why = _changed_since_trace(log, replay, param) if value is param else None
    if why is not None:
        return None, why
    # A parameter's copy is a parameter's kind of tensor even when validating inside torch.inference_mode():
    # some kernels choose their path by it (a CPU GRU given inference-tensor weights rounds differently).
    with torch.inference_mode(value.is_inference()):
        copied = _of_its_class(param, copy_with_layout(value.detach()))
        if copied.is_floating_point() or copied.is_complex():
            flags = replay.param_requires_grad if replay is not None else {}
            copied.requires_grad_(flags.get(id(param), param.requires_grad))  # as in the forward, not now
    return copied, None


def _of_its_class(param, copied):
    """``copied`` as ``param``'s own tensor subclass where copying made it a plain tensor: a parameter class with a
    ``__torch_function__`` of its own (bitsandbytes' quantized weights) computes the ops reading it, and replay must
    run them as the forward did.  Its attributes (a quantization state, a scale) are shared with it, not copied."""
    kind = type(param)
    if type(copied) is kind or kind in TENSOR_TYPES or is_traceable_wrapper_subclass(param):
        return copied
    mirrored = torch.Tensor._make_subclass(kind, copied, copied.requires_grad)
    vars(mirrored).update(vars(param))
    return mirrored


def _param_name(log, param) -> str:
    """The parameter's address in the traced model, else its shape."""
    model = None if log.is_cleaned_up else log.model
    if isinstance(model, torch.nn.Module):
        for name, p in model.named_parameters(remove_duplicate=False):
            if p is param:
                return traced_address(name)  # as the trace names it: no torch.compile wrapper's step
    return f"of shape {tuple(param.shape)}"
