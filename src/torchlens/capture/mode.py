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

from ..tree import split
from .collectives import WRITTEN_ARGUMENT, written_tensors
from ..record.layouts import shape_of
from .source import FrameClassifier
from .state import CaptureState, storage_key

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
    return verdict


class CaptureMode(TorchFunctionMode):
    """Records one raw event per tensor-producing torch call into a ``CaptureState``."""

    def __init__(self, state: CaptureState, frames: FrameClassifier, deep: bool = False):
        super().__init__()
        self.state = state
        self.frames = frames
        # Deep capture: torch functions written in Python (F.normalize, F.multi_head_attention_forward)
        # are entered and the torch calls inside them recorded, instead of one op per call.
        self.deep = deep
        self._entered = [None]  # Python-level torch functions currently entered by deep capture

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = _NO_KWARGS
        if func in _NOT_OPS:
            if func in _NUMPY_VIEWS and self.state.saved:
                # NumPy shares the memory and writes through it bump no version counter: what is saved
                # must not change with it.
                self.state.protect_saved(args[0])
            return func(*args, **kwargs)
        if _compiler._is_compiling_flag:
            # Dynamo is tracing this handler symbolically (torch.cond, flex_attention and other
            # higher-order ops compile their bodies even in eager mode): be transparent to it, so the
            # bodies compile as they would untraced.  What then runs eagerly is recorded as usual.
            return func(*args, **kwargs)
        st = self.state
        producers = st.producers

        # Scan tensor arguments: parents (by producing op), parameters, and version counters.
        parents = []
        params = None
        versions = []  # (tensor, version before the call): detects writes, predicted or not
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

        # Copy-on-write: a predicted in-place write must not alter an activation saved earlier.
        if st.saved and versions:
            inplace = _inplace_cache.get(func)
            if inplace is None:
                inplace = _predicts_inplace(func)
            if inplace or kwargs.get("inplace"):
                if args and isinstance(args[0], Tensor):  # in-place fns may take the tensor by keyword
                    st.protect_saved(args[0])
                elif args and type(args[0]) is list:  # collectives writing a list (dist.all_gather)
                    st.protect_saved_all(args[0])
            elif "out" in kwargs:
                st.protect_saved_all(kwargs["out"])

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
                self._entered.append(func)
                try:
                    with self:  # re-enter capture for the torch calls inside this Python-level function
                        out = redispatch_function(func, types, args, kwargs)
                finally:
                    self._entered.pop()
            else:
                out = func(*args, **kwargs)
        except BaseException as exc:
            st.note_failure(func, module_call, exc)
            raise
        finally:
            if markers is not None:
                markers.op_exit(token)
        t1 = perf_counter_ns()

        # Only tensor-producing calls are ops; setitem returns None but writes its receiver.
        if isinstance(out, Tensor):
            leaves = ((None, out),)
        elif func is _setitem:
            leaves = ((None, args[0]),)
        elif isinstance(out, (tuple, list)):
            leaves = _tensor_leaves(out)
            if not leaves:
                return out
        elif func in WRITTEN_ARGUMENT:  # a torch.distributed collective: its output is the tensor it wrote
            leaves = written_tensors(func, args, kwargs)
            if not leaves:
                return out
        else:
            return out
        if deep and all(_made_since(producers, t, records_before) for _, t in leaves):
            return out  # the inner ops produced every output: they are the record

        # The user's frame: one dict lookup in the common case of an op called from user code.
        # Lines are resolved from instruction offsets only when asked for (record/op.py).
        frame = sys._getframe(1)
        code = frame.f_code
        if self.frames.is_user(code):
            line = frame.f_lasti
            site = (code, line)
        else:
            site, code, line = self.frames.locate(frame, func, st.call_frames, module_call)
        call_index = len(st.calls)
        first_op = len(st.records)
        written = None
        for v, before in versions:
            if v._version != before if before is not None else _predicted_write(func, args, kwargs, v):
                if written is None:
                    written = []
                written.append(v)
        if st.save_mode and (_grad_enabled() is not st.grad_enabled or _any_autocast() or st.any_autocast):
            st.note_context(call_index)  # replay (which needs saved values) runs it as it ran
        # Compact for long traces: tuples, and one shared empty dict for the common no-keyword call.
        st.calls.append((func, tuple(skeleton) if skeleton is not None else args,
                         kw_skeleton if kw_skeleton else _NO_KWARGS, tuple(parents), params or (), module_call,
                         code, line, t0, t1, first_op, len(leaves), written is not None, site))
        if written is not None:
            st.note_writes(written, first_op)
        if func in _DATA_GET:  # ``x.data`` shares x's storage but not its version counter
            st.data_bases[id(out)] = (weakref(out), weakref(args[0]))
        records = st.records
        save_mode = st.save_mode
        saved, saved_versions, saved_by_storage = st.saved, st.saved_versions, st.saved_by_storage
        for slot, t in leaves:
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
            producers[id(t)] = (weakref(t), index, version)
            if requires_grad and st.grads is not None:  # tl.trace(..., grads=...): capture/grads.py
                st.grads.watch(index, t, func, module_call)
            if save_mode and (save_mode == 1 or st.wants(func, module_call)):
                if st.plain_save:  # the common case, inlined: keep a reference, note its storage
                    if requires_grad:
                        t = t.detach()
                    saved[index] = t
                    saved_versions[index] = version
                    key = storage_key(t)
                    stored = saved_by_storage.get(key)
                    if stored is None:
                        saved_by_storage[key] = [index]
                    else:
                        stored.append(index)
                else:
                    st.save(index, t, requires_grad)
            if st.finite_flags is not None:
                st.record_finite(index, t)
        if st.intervention is not None:  # intervene/runtime.py: may change what the model gets back
            return st.intervention.at_call(st, call_index, first_op, out, leaves, func, args, kwargs)
        return out


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
