"""Torch functions written in Python reach the capture mode without torch's Python dispatcher.

``F.relu``, ``F.batch_norm``, ``F.layer_norm``, ``F.dropout``, ``F.embedding``, ``Tensor.split`` and the
other torch functions written in Python call ``handle_torch_function`` whenever a mode is active.
torch's own (``torch.overrides``) collects the overloaded arguments' types, then lifts the mode off the
stack through a context manager (a generator per call) and calls the mode: about 270 bytecodes per
call, more than capture's own record of the op.  While a trace runs, the modules that call it find
``handle_torch_function`` below instead (``fastpath.FastPathShim`` puts it in place and takes it away).
When the calling thread's capture mode is the only mode on the stack and every relevant argument is a
plain tensor, a Parameter or None, it does what torch's own does in a few lines: the same types, the
mode lifted off the stack while it runs and put back whatever happens (no generator, so nothing an
interrupt could leave suspended), the same call.  Any other call goes to torch's own, unchanged.
With the compiled hot path in use, ``handle_torch_function_compiled`` is put in place instead: a frame
like this one (the call sites capture reads off the frames stay the ones torch's own gives: a frame
suspended on a call into C reports another instruction offset than one suspended on a call into Python)
whose work is done by torchlens-accel's ``_dispatch`` (``accel/src/torchlens_accel/_dispatch.c``).
"""

from __future__ import annotations

import threading

import torch
import torch.overrides

from . import accel

TORCH_OWN = torch.overrides.handle_torch_function
_NAME = "handle_torch_function"  # the global each caller module looks up
_depth = torch._C._len_torch_function_stack
_at = torch._C._get_function_stack_at
_pop = torch._C._pop_torch_function_stack
_push = torch._C._push_on_torch_function_stack
_mode_enabled = torch._C._is_torch_function_mode_enabled
_TENSOR = (torch.Tensor,)  # the types torch passes when a plain tensor is among the relevant arguments
# Relevant arguments torch leaves out of the types: None, and Parameter, which disables __torch_function__.
_PARAMETER_SILENT = torch.nn.Parameter.__torch_function__ is torch._C._disabled_torch_function_impl
_SILENT = frozenset([type(None)] + ([torch.nn.Parameter] if _PARAMETER_SILENT else []))


class _Capturing(threading.local):
    mode = None  # the calling thread's capture mode while its trace runs (set by fastpath.FastPathShim)


capturing = _Capturing()


def handle_torch_function(public_api, relevant_args, *args, **kwargs):
    """``torch.overrides.handle_torch_function``, with the common call of a trace answered directly."""
    mode = capturing.mode
    if mode is not None and type(relevant_args) is tuple and _depth() == 1 and _at(0) is mode and _mode_enabled():
        types = ()
        for arg in relevant_args:
            kind = type(arg)
            if kind is torch.Tensor:
                types = _TENSOR
            elif kind not in _SILENT:
                break  # a subclass or another value: torch's own decides
        else:
            _pop()
            try:
                result = mode.__torch_function__(public_api, types, args, kwargs)
            finally:
                _push(mode)
            if result is not NotImplemented:
                return result
            return _overloads(public_api, types, args, kwargs)
    return TORCH_OWN(public_api, relevant_args, *args, **kwargs)


def _overloads(public_api, types, args, kwargs):
    """What torch's own does after a mode answered NotImplemented (the capture mode never does): the
    plain tensor's ``__torch_function__``, else a TypeError."""
    if types:
        result = torch.Tensor.__torch_function__(public_api, types, args, kwargs)
        if result is not NotImplemented:
            return result
    raise TypeError(f"no implementation found for '{public_api.__module__}.{public_api.__name__}' on types "
                    f"that implement __torch_function__: {list(types)}")


def _callers() -> tuple:
    """The namespaces of the torch modules a forward reaches torch's ``handle_torch_function`` through
    (their functions look it up as a global of their own module at every call)."""
    import torch.functional
    import torch.nn.functional

    return torch.nn.functional.__dict__, torch.functional.__dict__, torch._tensor.__dict__


CALLERS = _callers()  # a tuple of dicts


def handle_torch_function_compiled(public_api, relevant_args, *args, **kwargs):
    """``handle_torch_function`` with its body compiled (``_answer``: torchlens-accel's ``Dispatcher``)."""
    return _answer(public_api, relevant_args, args, kwargs)


_answer = None  # the compiled body in use (made by ``_compiled_body``)
_answer_of = None  # the compiled module it was made from
_OURS = (handle_torch_function, handle_torch_function_compiled)  # what install may have put in place
_TORCH_OWN = (TORCH_OWN,)


def _compiled_body(module) -> None:
    """Make the compiled body from ``module`` (torchlens-accel's ``_dispatch``), once per module."""
    global _answer, _answer_of
    _answer = module.Dispatcher(capturing, TORCH_OWN, torch.Tensor, torch.nn.Parameter if _PARAMETER_SILENT else None,
                                _TENSOR, _depth, _at, _pop, _push, _mode_enabled, _overloads)
    _answer_of = module


def _swap(namespaces, name: str, expected: tuple, replacement) -> None:
    """In each of ``namespaces`` whose ``name`` holds one of ``expected``, put ``replacement``; one that holds
    something else (another library's) is left as it is.  torchlens-accel's ``_dispatch.swap`` does the same
    in one call."""
    for namespace in namespaces:
        if namespace.get(name) in expected:
            namespace[name] = replacement


def install() -> None:
    """Put capture's ``handle_torch_function`` in place of torch's own where the callers hold torch's own:
    the compiled one when the compiled hot path is in use."""
    module = accel.compiled("_dispatch")
    if module is None:
        _swap(CALLERS, _NAME, _TORCH_OWN, handle_torch_function)
        return
    if module is not _answer_of:
        _compiled_body(module)
    module.swap(CALLERS, _NAME, _TORCH_OWN, handle_torch_function_compiled)


def uninstall() -> None:
    """Put torch's own back wherever ``install`` replaced it, with either replacement (idempotent)."""
    swap = _answer_of.swap if _answer_of is not None else _swap  # the compiled one once loaded: one call
    swap(CALLERS, _NAME, _OURS, TORCH_OWN)


def installed() -> bool:
    return any(namespace.get(_NAME) in _OURS for namespace in CALLERS)
