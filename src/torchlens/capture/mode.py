"""The capture hot path: one ``TorchFunctionMode`` handler per torch call.

Every torch function, Tensor method, operator and factory called by the model's Python code reaches
``CaptureMode.__torch_function__``.  The handler calls the function unchanged and, when the result holds
tensors, appends compact tuples to the session's raw lists.  Everything richer (labels, pass groups,
module records, source text) is derived after the forward by ``record.finalize``.

Torch pops the mode while the handler runs, so torch calls made *inside* a handled function (the body
of ``F.normalize``, say) are not seen: the handled call is one op.  That is the contract documented in
docs/capture_honesty.md.
"""

from __future__ import annotations

import sys
from time import perf_counter_ns
from types import FunctionType
from weakref import ref as weakref

import torch
import torch.compiler as _compiler
from torch.overrides import TorchFunctionMode

try:  # torch >= 2.10; deep capture re-enters Python-level torch functions through it
    from torch.overrides import redispatch_function
except ImportError:  # pragma: no cover - older torch
    redispatch_function = None

from ..record.layouts import shape_of
from ..tree import split
from .collectives import WRITTEN_ARGUMENT, written_tensors
from .fused_writes import WRITES_RUNNING_STATS, running_stats_written
from .source import USER as _USER_FRAME
from .source import VERDICTS as _verdicts
from .source import FrameClassifier
from .state import CaptureState

Tensor = torch.Tensor
Parameter = torch.nn.Parameter
_setitem = Tensor.__setitem__
_DATA_GET = frozenset([Tensor.data.__get__])  # method-wrappers compare equal, not identical

# Calls that never produce a tensor; skipping them early keeps the commonest calls nearly free.
_NOT_OP_METHODS = (
    "size", "dim", "numel", "stride", "item", "tolist", "numpy", "__len__", "__bool__", "__format__",
    "__repr__", "__hash__", "__index__", "__int__", "__float__", "is_contiguous", "is_floating_point",
    "is_complex", "data_ptr", "storage_offset", "element_size", "nelement", "untyped_storage",
    "get_device", "requires_grad_", "retain_grad", "register_hook", "__array__",
)
_NOT_OP_PROPERTIES = (
    "shape", "dtype", "device", "requires_grad", "grad_fn", "grad", "is_leaf", "ndim", "is_cuda",
    "_base", "layout", "_version", "is_sparse", "is_quantized", "is_meta",
)


def _not_ops() -> frozenset:
    found = [getattr(Tensor, name, None) for name in _NOT_OP_METHODS]
    for name in _NOT_OP_PROPERTIES:
        descriptor = Tensor.__dict__.get(name) or torch._C.TensorBase.__dict__.get(name)
        found.append(getattr(descriptor, "__get__", None))
    return frozenset(f for f in found if f is not None)


# Calls that never produce a tensor; skipping them early keeps the commonest calls nearly free.
_NOT_OPS = _not_ops()
_NUMPY_VIEWS = frozenset([Tensor.numpy, Tensor.__array__])
_grad_enabled = torch.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled

_INPLACE_DUNDERS = frozenset(
    ["__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
     "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"]
)
_inplace_cache: dict = dict.fromkeys(WRITTEN_ARGUMENT, True)  # collectives write their output argument
# Normalisations that may update running statistics in their kernel: truthy, so the hot path asks.
_RUNNING_STATS = "running statistics"
_inplace_cache.update(dict.fromkeys(WRITES_RUNNING_STATS, _RUNNING_STATS))
_CONTAINERS = (list, tuple, dict)  # argument types walked for tensors (named tuples and dict subclasses too)
_Size = torch.Size
_NO_KWARGS: dict = {}  # shared and never mutated: saves a dict per call


def _predicts_inplace(func) -> bool:
    """Whether ``func`` writes its first argument by name (``add_``, ``__iadd__``, ``__setitem__``)."""
    verdict = _inplace_cache.get(func)
    if verdict is None:
        name = getattr(func, "__name__", "")
        verdict = name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))
        _inplace_cache[func] = verdict
    return verdict is True


class CaptureMode(TorchFunctionMode):
    """Records one raw event per tensor-producing torch call into a ``CaptureState``.

    ``__torch_function__`` is the hot path: the common call (tensor arguments, tensor outputs, every
    optional feature off) runs top to bottom through it.  Everything else leaves it through a named
    cold path: calls that are not ops, deep capture and the optional features (``_call_with_features``),
    container arguments, predicted in-place writes, failures, writes found after the call, and results
    that are not one tensor.
    """

    def __init__(self, state: CaptureState, frames: FrameClassifier, deep: bool = False):
        super().__init__()
        self.state = state
        self.frames = frames
        # Deep capture: torch functions written in Python (F.normalize, F.multi_head_attention_forward)
        # are entered and the torch calls inside them recorded, instead of one op per call.
        self.deep = deep
        self._entered = [None]  # Python-level torch functions currently entered by deep capture
        # The features set on the state before the mode is made; with all off, every op takes the hot path.
        self.plain = not deep and state.markers is None and state.intervention is None \
            and state.finite_flags is None and state.plain_save

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _NOT_OPS:
            return _not_an_op(self.state, func, args, kwargs)
        if not self.plain or _compiler._is_compiling_flag:
            return self._call_with_features(func, types, args, kwargs or _NO_KWARGS)
        st = self.state
        if kwargs is None:
            kwargs = _NO_KWARGS
        skeleton, kw_skeleton, parents, params, versions = _scan_arguments(st, args, kwargs)
        if st.saved and versions and (_inplace_cache.get(func) is not False or kwargs):
            _protect_before_write(st, func, args, kwargs)
        module_call = st.module_stack[-1] if st.module_stack else -1
        t0 = perf_counter_ns()
        try:
            out = func(*args, **kwargs)
        except BaseException as exc:
            st.note_failure(func, module_call, exc)
            raise
        t1 = perf_counter_ns()
        if isinstance(out, Tensor):
            leaves = None  # one tensor out: recorded below without building a leaf list
        else:
            leaves = _output_leaves(func, out, args, kwargs)
            if not leaves:
                return out

        # The user's frame: one dict lookup in the common case of an op called from user code.
        # Lines are resolved from instruction offsets only when asked for (record/op.py).
        frame = sys._getframe(1)
        code = frame.f_code
        if _verdicts.get(id(code)) == _USER_FRAME:
            line = frame.f_lasti
            site = (code, line)
        else:  # torch's own code, or a frame not classified yet
            site, code, line = self.frames.locate(frame, func, st.call_frames, module_call)
        calls = st.calls
        call_index = len(calls)
        records = st.records
        first_op = len(records)
        written = None
        for v, before in versions:
            if before is None or v._version != before:  # a write (or an inference tensor): which ones
                written = _written_arguments(func, args, kwargs, versions)
                break
        if st.save_mode and (_grad_enabled() is not st.grad_enabled or _any_autocast() or st.any_autocast):
            st.note_context(call_index)  # replay (which needs saved values) runs it as it ran
        # Compact for long traces: tuples, and one shared empty dict for the common no-keyword call.
        calls.append((func, tuple(skeleton) if skeleton is not None else args, kw_skeleton or _NO_KWARGS,
                      tuple(parents), params or (), module_call, code, line, t0, t1, first_op,
                      1 if leaves is None else len(leaves), written is not None, site))
        if written is not None:
            st.note_writes(written, first_op)
        if func in _DATA_GET:  # ``x.data`` shares x's storage but not its version counter
            st.data_bases[id(out)] = (weakref(out), weakref(args[0]))
        if leaves is not None:
            for slot, t in leaves:
                _record_output(st, call_index, slot, t, func, module_call)
            return out

        # One tensor out, the common case, inlined.
        requires_grad = out.requires_grad
        try:
            shape = out.shape
        except RuntimeError:  # a nested tensor has no single shape
            shape = shape_of(out)
        records.append((call_index, None, shape, out.dtype, out.device, requires_grad,
                        type(out.grad_fn) if requires_grad else None))
        try:
            version = out._version
        except RuntimeError:  # made under torch.inference_mode(): no version counter
            version = st.version(out)
        st.producers[id(out)] = (weakref(out), first_op, version)
        if requires_grad and st.grads is not None:  # tl.trace(..., grads=...): capture/grads.py
            st.grads.watch(first_op, out, func, module_call)
        save_mode = st.save_mode
        if save_mode and (save_mode == 1 or st.wants(func, module_call)):
            # Kept by reference; its storage is keyed only when a write may need it (CaptureState.save).
            st.saved[first_op] = out.detach() if requires_grad else out
            st.saved_versions[first_op] = version
            st.unkeyed.append(first_op)
        return out

    def _call_with_features(self, func, types, args, kwargs):
        """The general path: deep capture, profiler markers, gradient capture, interventions, finite
        flags, device moves and a saving budget, and calls Dynamo is compiling."""
        if _compiler._is_compiling_flag:
            # Dynamo is tracing this handler symbolically (torch.cond, flex_attention and other
            # higher-order ops compile their bodies even in eager mode): be transparent to it, so the
            # bodies compile as they would untraced.  What then runs eagerly is recorded as usual.
            return func(*args, **kwargs)
        st = self.state
        skeleton, kw_skeleton, parents, params, versions = _scan_arguments(st, args, kwargs)
        if st.saved and versions:
            _protect_before_write(st, func, args, kwargs)
        module_call = st.module_stack[-1] if st.module_stack else -1
        # A Python-level function re-dispatching to itself (Tensor.unflatten -> super().unflatten) is
        # called plainly the second time.
        deep = self.deep and type(func) is FunctionType and self._entered[-1] is not func
        markers = None if deep else st.markers  # in deep mode the inner calls carry the markers
        if markers is not None:
            token = markers.op_enter(len(st.calls))
        records_before = len(st.records)
        t0 = perf_counter_ns()
        try:
            if deep:
                out = self._enter_python_function(func, types, args, kwargs)
            else:
                out = func(*args, **kwargs)
        except BaseException as exc:
            st.note_failure(func, module_call, exc)
            raise
        finally:
            if markers is not None:
                markers.op_exit(token)
        t1 = perf_counter_ns()

        leaves = ((None, out),) if isinstance(out, Tensor) else _output_leaves(func, out, args, kwargs)
        if not leaves:
            return out
        if deep and all(_made_since(st.producers, t, records_before) for _, t in leaves):
            return out  # the inner ops produced every output: they are the record

        frame = sys._getframe(2)  # the caller of __torch_function__
        code = frame.f_code
        if self.frames.is_user(code):
            line = frame.f_lasti
            site = (code, line)
        else:
            site, code, line = self.frames.locate(frame, func, st.call_frames, module_call)
        call_index = len(st.calls)
        first_op = len(st.records)
        written = _written_arguments(func, args, kwargs, versions)
        if st.save_mode and (_grad_enabled() is not st.grad_enabled or _any_autocast() or st.any_autocast):
            st.note_context(call_index)
        st.calls.append((func, tuple(skeleton) if skeleton is not None else args, kw_skeleton or _NO_KWARGS,
                         tuple(parents), params or (), module_call, code, line, t0, t1, first_op, len(leaves),
                         written is not None, site))
        if written is not None:
            st.note_writes(written, first_op)
        if func in _DATA_GET:
            st.data_bases[id(out)] = (weakref(out), weakref(args[0]))
        for slot, t in leaves:
            _record_output(st, call_index, slot, t, func, module_call)
        if st.intervention is not None:  # intervene/runtime.py: may change what the model gets back
            return st.intervention.at_call(st, call_index, first_op, out, leaves, func, args, kwargs)
        return out

    def _enter_python_function(self, func, types, args, kwargs):
        """Deep capture: run a Python-level torch function with capture re-entered for the calls inside."""
        self._entered.append(func)
        try:
            with self:
                return redispatch_function(func, types, args, kwargs)
        finally:
            self._entered.pop()


def _not_an_op(st, func, args, kwargs):
    """A call that never produces a tensor (``x.shape``, ``x.size()``): run it unrecorded."""
    if func in _NUMPY_VIEWS and st.saved:
        # NumPy shares the memory and writes through it bump no version counter: what is saved
        # must not change with it.
        st.protect_saved(args[0])
    return func(*args, **(kwargs or _NO_KWARGS))


def _scan_arguments(st, args, kwargs):
    """Parents (by producing op), parameters and version counters of a call's tensor arguments.

    Returns ``(skeleton, kw_skeleton, parents, params, versions)``: the arguments as recorded (tensors
    blanked; None or the keywords themselves when nothing was blanked), ``(position, record index)``
    pairs, ``(position, Parameter)`` pairs or None, and ``(tensor, version before the call)`` pairs, by
    which writes are detected after it, predicted or not.
    """
    producers = st.producers
    parents = []
    params = None
    versions = []
    skeleton = None
    for pos, a in enumerate(args):
        if isinstance(a, Tensor):
            if skeleton is None:
                skeleton = list(args)
            skeleton[pos] = None
            try:
                version = a._version
            except RuntimeError:  # an inference tensor: no version counter
                version = st.version(a)
            versions.append((a, version))
            if type(a) is Parameter:
                if params is None:
                    params = []
                params.append((pos, a))
                continue
            entry = producers.get(id(a))
            if entry is not None and entry[2] == version and entry[0]() is a:
                parents.append((pos, entry[1]))
            else:
                parents.append((pos, st.producer_of(a)))
        elif isinstance(a, _CONTAINERS) and type(a) is not _Size:  # walked when it may hold a tensor
            inner, found = _scan_container(st, a, pos, parents, versions)
            if found:
                params = (params or []) + found
            if inner is not a:
                if skeleton is None:
                    skeleton = list(args)
                skeleton[pos] = inner
    kw_skeleton = kwargs
    if kwargs:
        kw_skeleton, params = _scan_keywords(st, kwargs, parents, params, versions)
    return skeleton, kw_skeleton, parents, params, versions


def _scan_keywords(st, kwargs, parents, params, versions):
    """``_scan_arguments`` for keyword arguments: returns the keywords as recorded and the parameters."""
    kw_skeleton = kwargs
    for key, a in kwargs.items():
        if isinstance(a, Tensor):
            if kw_skeleton is kwargs:
                kw_skeleton = dict(kwargs)
            kw_skeleton[key] = None
            try:
                versions.append((a, a._version))
            except RuntimeError:  # an inference tensor: no version counter
                versions.append((a, st.version(a)))
            if type(a) is Parameter:
                if params is None:
                    params = []
                params.append((key, a))
            else:
                parents.append((key, st.producer_of(a)))
        elif isinstance(a, _CONTAINERS):
            inner, found = _scan_container(st, a, key, parents, versions)
            if found:
                params = (params or []) + found
            if inner is not a:
                if kw_skeleton is kwargs:
                    kw_skeleton = dict(kwargs)
                kw_skeleton[key] = inner
    return kw_skeleton, params


def _protect_before_write(st, func, args, kwargs) -> None:
    """Copy-on-write: a predicted in-place write must not alter an activation saved earlier."""
    inplace = _inplace_cache.get(func)
    if inplace is None:
        inplace = _predicts_inplace(func)
    elif inplace is _RUNNING_STATS:
        for t in running_stats_written(func, args, kwargs):
            st.protect_saved(t)
        return
    if inplace or kwargs.get("inplace"):
        if args and isinstance(args[0], Tensor):  # in-place fns may take the tensor by keyword
            st.protect_saved(args[0])
        elif args and type(args[0]) is list:  # collectives writing a list (dist.all_gather)
            st.protect_saved_all(args[0])
    elif "out" in kwargs:
        st.protect_saved_all(kwargs["out"])


def _output_leaves(func, out, args, kwargs):
    """``(slot, tensor)`` for each tensor a call produced when its result is not one tensor, or None
    when it produced none (only tensor-producing calls are ops)."""
    if func is _setitem:  # returns None but writes its receiver
        return ((None, args[0]),)
    if isinstance(out, (tuple, list)):
        return _tensor_leaves(out)
    if func in WRITTEN_ARGUMENT:  # a torch.distributed collective: its output is the tensor it wrote
        return written_tensors(func, args, kwargs)
    return None


def _written_arguments(func, args, kwargs, versions):
    """The tensor arguments the call wrote (version counter moved, or by name for inference tensors),
    or None."""
    written = None
    for v, before in versions:
        if v._version != before if before is not None else _predicted_write(func, args, kwargs, v):
            if written is None:
                written = []
            written.append(v)
    return written


def _record_output(st, call_index: int, slot, t, func, module_call: int) -> None:
    """The record of one output tensor, with every feature that may observe it."""
    records = st.records
    index = len(records)
    requires_grad = t.requires_grad
    try:
        shape = t.shape
    except RuntimeError:  # a nested tensor has no single shape
        shape = shape_of(t)
    records.append((call_index, slot, shape, t.dtype, t.device, requires_grad,
                    type(t.grad_fn) if requires_grad else None))
    try:
        version = t._version
    except RuntimeError:  # made under torch.inference_mode(): no version counter
        version = st.version(t)
    st.producers[id(t)] = (weakref(t), index, version)
    if requires_grad and st.grads is not None:  # tl.trace(..., grads=...): capture/grads.py
        st.grads.watch(index, t, func, module_call)
    save_mode = st.save_mode
    if save_mode and (save_mode == 1 or st.wants(func, module_call)):
        st.save(index, t, requires_grad)
    if st.finite_flags is not None:
        st.record_finite(index, t)


def _scan_container(st, value, key, parents, versions):
    """Tensors at any depth inside a container argument (``torch.cat([a, b])``, ``x[..., idx]``,
    ``cat(tensors=[a, b])``), at positions ``(key, *path)``; returns the argument as recorded (a copy
    with its tensors blanked, so a list the model mutates later cannot rewrite the record) and the
    parameters found, if any."""
    leaves, inner = split(value, (key,))  # a flat tuple without tensors comes back as it is
    found = None
    for path, t in leaves:
        try:
            versions.append((t, t._version))
        except RuntimeError:  # an inference tensor: no version counter
            versions.append((t, st.version(t)))
        if type(t) is Parameter:
            if found is None:
                found = []
            found.append((path, t))
        else:
            parents.append((path, st.producer_of(t)))
    return inner, found


def _predicted_write(func, args, kwargs, t) -> bool:
    """Whether ``func`` writes ``t`` by name: how writes to inference tensors (no version counter) are known."""
    if args and args[0] is t and (_predicts_inplace(func) or kwargs.get("inplace")):
        return True
    out = kwargs.get("out")
    return out is t or (isinstance(out, (tuple, list)) and any(o is t for o in out))


def _made_since(producers, t, first_record: int) -> bool:
    entry = producers.get(id(t))
    return entry is not None and entry[1] >= first_record and entry[0]() is t


def _tensor_leaves(out, prefix=()):
    """(slot path, tensor) for each tensor inside a (possibly nested) tuple/list result."""
    leaves = []
    for i, item in enumerate(out):
        if isinstance(item, Tensor):
            leaves.append((prefix + (i,) if prefix else i, item))
        elif isinstance(item, (tuple, list)):
            leaves.extend(_tensor_leaves(item, (prefix + (i,)) if prefix else (i,)))
    return leaves
