"""``tl.trace``: set capture up, run the forward once, tear everything down, finalize.

Nothing outlives the call: the capture mode is popped, module hooks removed and the fast-path shim
uninstalled in ``finally`` blocks (context managers), whether the model returns or raises.
"""

from __future__ import annotations

import functools
import gc
import inspect
import threading
from time import perf_counter_ns

import torch

from ..record.errors import NestedTraceError
from ..record.finalize import finalize, tensor_leaves
from ..record.model_index import ModelIndex
from ..record.trace import Trace
from .compiled import CompiledSubmodules, Suspension, check_compiled_option
from .fastpath import FastPathShim
from .mode import CaptureMode, redispatch_function
from .modules import ModuleCallTracker
from .saving import SavePolicy
from .source import FrameClassifier
from .state import INFERENCE_CAVEAT, INPUT, CaptureState, warn_mutated
from .teardown import ModeOnStack, leftovers

_local = threading.local()


def _trace(model, args=(), kwargs=None, *, save="all", save_device=None, record_finite: bool = False,
          max_saved_bytes: int | None = None, name: str | None = None, deep: bool = False,
          compiled: str = "run", _markers=None) -> Trace:
    """One trace, with the collector already paused and the thread marked as tracing by ``trace``."""
    model = _unwrap(model)
    if not callable(model):
        raise TypeError(f"tl.trace needs an nn.Module or a callable, got {type(model).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of keyword arguments for forward, got {type(kwargs).__name__}")
    check_compiled_option(compiled)
    if deep and redispatch_function is None:
        raise RuntimeError(f"deep=True needs torch.overrides.redispatch_function, which torch {torch.__version__} "
                           "lacks; upgrade torch or trace with deep=False")
    kwargs = dict(kwargs or {})
    args = _as_args(model, args)
    index = ModelIndex(model)  # the one walk over the model's modules, parameters and buffers
    policy = SavePolicy(save, model)
    if save_device is not None:
        save_device = torch.device(save_device)
    started = perf_counter_ns()

    state = CaptureState(save_mode=policy.mode, save_device=save_device, record_finite=record_finite,
                         buffers=index.buffers, max_saved_bytes=max_saved_bytes)
    if policy.mode == 2:
        state.selector = policy.capture_selector(state)
        # A type-only selection cannot pick inputs or buffers unless it names them: do not hold them.
        state.save_sources = bool({"input", "buffer"} & policy.types or policy.module_ids)
    state.markers = _markers  # profiler ranges per op and module call (torchlens.report.kernel_profile)
    _add_inputs(state, model, args, kwargs)
    autocast = _autocast_state()
    frames = FrameClassifier(stop_codes=(_run_forward.__code__,))
    mode = CaptureMode(state, frames, deep=deep)
    shim, installed = FastPathShim(mode), ModeOnStack(mode)
    submodules = CompiledSubmodules(model, compiled, None)
    tracker = ModuleCallTracker(state, model, frames, skip=submodules.eager_modules)
    submodules.suspend = lambda: Suspension(tracker, shim)
    parts = (submodules, shim, tracker, installed)
    try:
        with submodules, shim, tracker, installed:
            output = _run_forward(model, args, kwargs)
    except BaseException as exc:
        _tear_down(parts)  # again: an interrupt on the ``with`` line can skip its exits
        _annotate(exc, state, model, leftovers(mode, parts))
        raise
    finally:
        _tear_down(parts)
    forward_done = perf_counter_ns()
    if inspect.isgenerator(output) or inspect.iscoroutine(output) or inspect.isasyncgen(output):
        # Its body would run later, untraced: refuse rather than return an empty, plausible trace.
        getattr(output, "close", lambda: None)()  # a coroutine never awaited would warn
        raise TypeError(f"{type(model).__name__}'s forward returned a {type(output).__name__}, whose body runs "
                        "only when iterated, after tracing ended; trace a forward that returns its results "
                        "(e.g. wrap it: lambda x: list(model(x)))")

    mutated = state.check_saved_versions()
    model_name = name or type(model).__name__
    timings = {"forward": (forward_done - started) / 1e9}
    result = finalize(state, model, output, model_name, timings, index)
    result._autocast = autocast
    result.caveats = ((INFERENCE_CAVEAT,) if state.versionless else ()) + submodules.caveats()
    policy.apply(result)
    timings["total"] = (perf_counter_ns() - started) / 1e9
    warn_mutated([result._labels[i] for i in mutated])
    if state.budget_exhausted_at is not None:
        import warnings

        warnings.warn(f"max_saved_bytes reached: activations from {result._labels[state.budget_exhausted_at]} "
                      "on were not saved", stacklevel=2)
    return result


def trace(model, args=(), kwargs=None, *, save="all", save_device=None, record_finite: bool = False,
          max_saved_bytes: int | None = None, name: str | None = None, deep: bool = False,
          compiled: str = "run", _markers=None) -> Trace:
    """Run ``model(*args, **kwargs)`` once and return the ``Trace`` of every torch op it called.

    Args:
        model: an ``nn.Module`` or any callable.  DataParallel/DDP wrappers and ``torch.compile``
            results are unwrapped to the eager module underneath.
        args: one tensor, or a tuple/list of positional arguments (tensors, containers, anything).
        kwargs: keyword arguments for forward.
        save: which activations to keep: ``"all"``, ``"none"``, a list of labels / module addresses /
            op types, or a predicate ``f(op) -> bool``.  Activations are kept by reference and copied
            only when an in-place op is about to overwrite them.
        save_device: move saved activations to this device as they are captured.
        record_finite: record a (has_nan, has_inf) flag per op even for unsaved ops.
        max_saved_bytes: stop saving (with a warning naming the first unsaved op) past this budget.
        name: a display name for the trace (defaults to the model's class name).
        deep: also record the torch calls made inside torch functions written in Python
            (``F.normalize``, ``F.interpolate``, ``F.multi_head_attention_forward``), which are
            otherwise one op each.
        compiled: how ``torch.compile``'d submodules run: ``"run"`` (compiled, exactly as untraced, each
            call one ``compiled`` op) or ``"eager"`` (their interior traced op by op; outputs may then
            differ from the compiled run, and ``Trace.caveats`` says so).
    """
    if getattr(_local, "active", False):
        raise NestedTraceError("tl.trace was called inside a forward that is already being traced; "
                               "trace the outer model once instead")
    collecting = gc.isenabled()
    try:
        try:
            _local.active = True
            gc.disable()  # a trace allocates many small records: no collector passes over them meanwhile
            return _trace(model, args, kwargs, save=save, save_device=save_device, record_finite=record_finite,
                          max_saved_bytes=max_saved_bytes, name=name, deep=deep, compiled=compiled,
                          _markers=_markers)
        finally:
            _local.active = False
            if collecting:
                gc.enable()
    finally:
        # Once more: an interrupt landing on a line of the block above can cut it short.
        _local.active = False
        if collecting and not gc.isenabled():
            gc.enable()


def _tear_down(parts) -> None:
    """Exit every capture context, innermost first (each exit is idempotent and finishes even when
    interrupted)."""
    interrupted = None
    for part in reversed(parts):
        try:
            part.__exit__(None, None, None)
        except BaseException as e:  # noqa: BLE001
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted


def _run_forward(model, args, kwargs):
    # Its code object marks the boundary of user code for source lookup: keep it a plain call.
    return model(*args, **kwargs)


def _unwrap(model):
    inner = getattr(model, "_orig_mod", None)  # torch.compile'd module
    if isinstance(inner, torch.nn.Module):
        model = inner
    orig = getattr(model, "_torchdynamo_orig_callable", None)  # torch.compile'd function
    if orig is not None:
        model = orig
    parallel = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    if isinstance(model, parallel):
        model = model.module
    return model


def _forward_signature(model):
    if isinstance(model, torch.nn.Module):
        forward = model.forward
        func = getattr(forward, "__func__", None)
        if func is not None and getattr(forward, "__self__", None) is model:
            return _bound_signature(func)  # cached per forward function, first parameter (self) dropped
        target = forward
    else:
        target = model
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=256)
def _bound_signature(func):
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def _as_args(model, args) -> tuple:
    if isinstance(args, tuple):
        return args
    if isinstance(args, list):
        # A list is the positional arguments, unless forward takes exactly one positional parameter.
        sig = _forward_signature(model)
        if sig is not None:
            positional = [p for p in sig.parameters.values()
                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if len(positional) == 1 and len(args) != 1:
                return (args,)
        return tuple(args)
    return (args,)


def _autocast_state() -> dict:
    """Autocast in effect around the forward (``{device type: dtype}``), so that replay reproduces it."""
    return {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)}


def _add_inputs(state, model, args, kwargs) -> None:
    sig = _forward_signature(model)
    names = None
    if sig is not None:
        try:
            bound = sig.bind(*args, **kwargs)
            names = list(bound.arguments.items())
        except TypeError:
            names = None
    if names is None:
        names = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
    for name, value in names:
        for path, t in tensor_leaves(value, f"input.{name}", []):
            if id(t) not in state.producers:  # the same tensor passed twice is one input
                state.add_source(t, INPUT, path)


def _annotate(exc: BaseException, state, model, left=()) -> None:
    if not hasattr(exc, "add_note"):  # Python 3.10
        return
    torn_down = ("capture was torn down, nothing is left installed" if not left else
                 "capture could not remove " + ", ".join(left) + "; restart the process before tracing again")
    if state.failure is not None and state.failure[2] is exc:
        from ..labels.naming import func_name_of

        func, module_call, _ = state.failure
        exc.add_note(f"torchlens: raised by torch call {func_name_of(func)!r} (op #{len(state.records) + 1}) "
                     f"in {_where(state, module_call, model)}; {torn_down}")
    else:
        module_call = state.module_stack[-1] if state.module_stack else -1
        if state.raised_in is not None and state.raised_in[0] is exc:
            module_call = state.raised_in[1]
        where = _where(state, module_call, model)
        if module_call < 0 and state.module_calls:  # e.g. raised by a forward hook, after the call ended
            where += f" (the last module call before it: {_where(state, len(state.module_calls) - 1, model)})"
        exc.add_note(f"torchlens: raised in {where} after {len(state.records)} captured tensors; {torn_down}")


def _where(state, index: int, model) -> str:
    if index < 0:
        return "the root forward"
    module = state.module_calls[index][0]
    call_number = sum(1 for c in state.module_calls[: index + 1] if c[0] is module)
    address = type(module).__name__
    if isinstance(model, torch.nn.Module):
        address = next((n for n, m in model.named_modules() if m is module), address).replace("._orig_mod", "")
    return f"module call {address}:{call_number}"
