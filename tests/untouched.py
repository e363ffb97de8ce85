"""What tracing must leave exactly as it found it, as a comparable snapshot.

``snapshot(model, tensors)`` records the torch-function mode stack depth and whether torch functions are
enabled, the global module hook
dictionaries, the identity of ``torch.overrides.has_torch_function``, of the ``handle_torch_function`` torch's
Python-level functions call, and of every public attribute of
the torch namespaces capture could patch, and, per module and per tensor, its attribute dictionary and
hook dictionaries.  Two snapshots compare equal exactly when nothing was installed or left behind.
"""

from __future__ import annotations

import torch
import torch.functional
import torch.nn.functional as F
import torch.nn.modules.module as module_globals
import torch.overrides

ORIGINAL = torch.overrides.has_torch_function
HANDLE = torch.overrides.handle_torch_function  # looked up as a global of the modules below at every call
_CALLERS = {"torch.nn.functional": F, "torch.functional": torch.functional, "torch._tensor": torch._tensor}
CALL_IMPL = torch.nn.Module._call_impl
CALL_IMPL_CODE = CALL_IMPL.__code__  # a trace swaps the function's code while it runs (capture/call_impl.py)
_NAMESPACES = {"torch": torch, "torch.Tensor": torch.Tensor, "torch.nn.functional": F,
               "torch.overrides": torch.overrides, "torch.nn.Module": torch.nn.Module}


def _global_hook_dicts() -> dict:
    return {name: tuple(getattr(module_globals, name).keys()) for name in sorted(dir(module_globals))
            if name.startswith("_global_") and isinstance(getattr(module_globals, name), dict)}


def _namespace_ids() -> dict:
    return {f"{label}.{name}": id(value) for label, space in _NAMESPACES.items()
            for name, value in list(vars(space).items())}


def _handle_is_torchs_own() -> bool:
    return all(vars(m).get("handle_torch_function") is HANDLE for m in _CALLERS.values())


def _module_state(module: torch.nn.Module) -> tuple:
    attrs = tuple(sorted(vars(module)))
    hooks = tuple((name, len(value)) for name, value in sorted(vars(module).items())
                  if "hook" in name and isinstance(value, dict))
    return attrs, hooks


def _tensor_state(t: torch.Tensor) -> tuple:
    """A tensor's own attributes and the hooks on it.  ``None`` and an emptied dict differ on purpose: a
    trace that leaves an empty hook dict behind has still changed the tensor."""
    hook_counts = tuple(None if hooks is None else len(hooks)
                        for hooks in (t._backward_hooks, t._post_accumulate_grad_hooks))
    return tuple(sorted(getattr(t, "__dict__", {}))), hook_counts


def snapshot(model=None, tensors=()) -> dict:
    state = {
        "mode stack depth": torch._C._len_torch_function_stack(),
        "has_torch_function is torch's own": torch.overrides.has_torch_function is ORIGINAL,
        "handle_torch_function is torch's own": _handle_is_torchs_own(),
        "global module hooks": _global_hook_dicts(),
        "torch namespaces": _namespace_ids(),
        "nn.Module._call_impl's code is torch's own": CALL_IMPL.__code__ is CALL_IMPL_CODE,
        "torch functions enabled": torch._C._is_torch_function_enabled(),
    }
    if isinstance(model, torch.nn.Module):
        for name, m in model.named_modules(remove_duplicate=False):
            state[f"module {name or 'root'}"] = _module_state(m)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            state[f"tensor {name}"] = _tensor_state(t)
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            state[f"tensor argument {i}"] = _tensor_state(t)
    return state


def assert_untouched(before: dict, after: dict) -> None:
    changed = [key for key in before.keys() | after.keys() if before.get(key) != after.get(key)]
    assert not changed, f"tracing left state behind: {sorted(changed)}"


def _hop_compiles_are_torchs_own() -> bool:
    """Torch's ``_hop_compile_and_call``, through which torch.cond and its kin compile their bodies: a trace
    in a process without Dynamo stands in for it until the first such compile (capture/compiled.py)."""
    import sys

    utils = sys.modules.get("torch._higher_order_ops.utils")
    entry = getattr(utils, "_hop_compile_and_call", None)
    return entry is None or entry.__module__ == "torch._higher_order_ops.utils"


def _compile_callbacks_of_torchlens() -> list:
    """Dynamo's compile start and end callbacks that a trace registered (``DynamoCompiles``)."""
    import sys

    handler = getattr(sys.modules.get("torch._dynamo.callback"), "callback_handler", None)
    callbacks = [*handler.start_callbacks, *handler.end_callbacks] if handler is not None else []
    return [c for c in callbacks if getattr(c, "__module__", "").startswith("torchlens")]


def _dynamo_entry_hook_is_torchs_own() -> bool:
    """Torch's ``set_eval_frame_isolate_recompiles_id``, which Dynamo's entry to a compiled function calls as it
    starts and finishes the function: a trace stands in for it (capture/compiled_functions.py)."""
    import sys

    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    hook = getattr(eval_frame, "set_eval_frame_isolate_recompiles_id", None)
    return hook is None or hook is torch._C._dynamo.eval_frame.set_eval_frame_isolate_recompiles_id


def assert_clean_process() -> None:
    """The parts of a snapshot that do not depend on a model: nothing installed at all."""
    assert torch._C._len_torch_function_stack() == 0, "a torch function mode is still on the stack"
    assert torch._C._is_torch_function_enabled(), "torch functions are left disabled in this thread"
    assert torch.overrides.has_torch_function is ORIGINAL, "has_torch_function is patched"
    assert _handle_is_torchs_own(), "handle_torch_function is replaced in a torch module"
    assert vars(torch.nn.Module)["_call_impl"] is CALL_IMPL, "nn.Module._call_impl is replaced"
    assert CALL_IMPL.__code__ is CALL_IMPL_CODE, "nn.Module._call_impl runs other code"
    leftover = {k: v for k, v in _global_hook_dicts().items() if v}
    assert not leftover, f"global module hooks left installed: {leftover}"
    assert _hop_compiles_are_torchs_own(), "torch._higher_order_ops.utils._hop_compile_and_call is replaced"
    assert not _compile_callbacks_of_torchlens(), "Dynamo compile callbacks are left registered"
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "saved-tensor hooks are left pushed"
    assert _dynamo_entry_hook_is_torchs_own(), "torch._dynamo.eval_frame.set_eval_frame_isolate_recompiles_id " \
        "is replaced"
