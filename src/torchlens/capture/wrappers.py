"""The wrappers ``tl.trace`` looks through: ``torch.compile``'s (of a module or a function), ``DataParallel`` and
``DistributedDataParallel``.  Each runs the eager module it wraps, which is what a trace records and names
modules from; TorchScript, which runs where capture cannot see, is refused instead.
"""

from __future__ import annotations

import torch

from ..errors import warn_user

PARALLEL = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
# The same classes, to look for in a class's MRO: DDP is an ABC (Joinable), whose isinstance runs Python code.
PARALLEL_CLASSES = frozenset(PARALLEL)
_SCRIPTED = (torch.jit.ScriptModule, torch.jit.ScriptFunction)


# A torch.compile'd model given to tl.trace runs as the eager model it wraps: capture cannot see inside compiled
# code.  Said, since a training loop that traces some of its compiled steps computes those steps differently.
COMPILED_ROOT_CAVEAT = ("the model is torch.compile'd: the trace ran the eager model it wraps (capture cannot see "
                        "inside compiled code), so its outputs, and the gradients of a backward through them, may "
                        "differ in their low bits from those of the compiled model's own untraced run")


def is_compile_wrapper(model) -> bool:
    """Whether ``model`` is what ``torch.compile`` returns for a module or a function, which ``unwrap`` unwraps."""
    is_module = isinstance(model, torch.nn.Module)
    if is_module and type(model._modules) is not dict:
        return False  # a TorchScript module (its own mapping): no wrapper, and refused by unwrap
    return _compiled_module(model, is_module) is not None or _compiled_function(model, is_module) is not None


# A module's missing attribute raises through nn.Module.__getattr__, which formats a message: torch.compile's
# attributes are looked up where they live instead.
def _compiled_module(model, is_module: bool):
    """The module a torch.compile'd module (an ``OptimizedModule``) wraps, or None."""
    inner = model._modules.get("_orig_mod") if is_module else getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def _compiled_function(model, is_module: bool):
    """The callable a torch.compile'd function wraps, or None."""
    return vars(model).get("_torchdynamo_orig_callable") if is_module else \
        getattr(model, "_torchdynamo_orig_callable", None)


def unwrap(model):
    is_module = isinstance(model, torch.nn.Module)
    # A scripted module keeps its submodules in TorchScript's own mapping, a plain one in a dict: the exact
    # check (slow: TorchScript's classes have their own metaclasses) runs only when that one does not settle it.
    if (not is_module or type(model._modules) is not dict) and isinstance(model, _SCRIPTED):
        raise TypeError(f"tl.trace got a TorchScript {type(model).__name__} (made by torch.jit.script or "
                        "torch.jit.trace): it runs in TorchScript's interpreter, where capture sees none of its ops; "
                        "trace the eager module or function it was made from")
    inner = _compiled_module(model, is_module)
    if inner is not None:
        _refuse_wrapper_hooks(model, "torch.compile wrapper", "_orig_mod")
        model = inner
        is_module = True
    orig = _compiled_function(model, is_module)
    if orig is not None:
        model = orig
    if isinstance(model, PARALLEL):
        _refuse_wrapper_hooks(model, type(model).__name__, "module")
        model = model.module
    return model


def warn_unreduced_grads(ddp) -> None:
    """A backward through a traced DDP forward all-reduces nothing: DDP's forward, which readies its reducer for
    the backward, does not run in a trace.  Say so, since the parameters' ``.grad`` then differ between ranks."""
    if ddp.require_backward_grad_sync:  # else inside ddp.no_sync(): local gradients are what was asked for
        warn_user("tl.trace(DDP(model), grads=...) traces the wrapped model without DDP's forward, so DDP does not "
                  "all-reduce the gradients of a backward through this trace: each parameter's .grad (and "
                  "log.params' grad) receives this rank's own gradient, not the average over the ranks (op "
                  "gradients are this rank's, as under DDP). Clear them (model.zero_grad()) before an optimizer "
                  "step, or step after a backward through an untraced DDP forward")


_WRAPPER_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _refuse_wrapper_hooks(wrapper, kind: str, inner: str) -> None:
    """A wrapper traced as the module it wraps must have no hooks of its own: they would not run, and the
    trace (and ``tl.validate``, which unwraps both of its runs) would show another output than the model's."""
    hooks = [name.strip("_").replace("_hooks", " hooks").replace("_", " ") for name in _WRAPPER_HOOKS
             if getattr(wrapper, name, None)]
    if hooks:
        raise TypeError(f"tl.trace runs a {kind} as the module it wraps (.{inner}), but the wrapper itself has "
                        f"{' and '.join(hooks)}, which would then not run and the traced output would not be the "
                        f"model's; register them on .{inner} instead, or trace .{inner} and apply them yourself")
