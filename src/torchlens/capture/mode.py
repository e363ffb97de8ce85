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
from weakref import ref as weakref

import torch
from torch.overrides import TorchFunctionMode

from .source import FrameClassifier
from .state import CaptureState

Tensor = torch.Tensor
Parameter = torch.nn.Parameter
_setitem = Tensor.__setitem__

# Calls that never produce a tensor; skipping them early keeps the commonest calls nearly free.
_NOT_OP_METHODS = (
    "size", "dim", "numel", "stride", "item", "tolist", "numpy", "__len__", "__bool__", "__format__",
    "__repr__", "__hash__", "__index__", "__int__", "__float__", "is_contiguous", "is_floating_point",
    "is_complex", "data_ptr", "storage_offset", "element_size", "nelement", "untyped_storage",
    "get_device", "requires_grad_", "retain_grad", "register_hook",
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

_INPLACE_DUNDERS = frozenset(
    ["__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
     "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"]
)
_inplace_cache: dict = {}


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

    def __init__(self, state: CaptureState, frames: FrameClassifier):
        super().__init__()
        self.state = state
        self.frames = frames

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func in _NOT_OPS:
            return func(*args, **kwargs)
        st = self.state
        producers = st.producers

        # Scan tensor arguments: parents (by producing op), parameters, and version counters.
        parents = []
        params = None
        versions = []
        skeleton = None
        for pos, a in enumerate(args):
            if isinstance(a, Tensor):
                if skeleton is None:
                    skeleton = list(args)
                skeleton[pos] = None
                versions.append(a)
                if type(a) is Parameter:
                    if params is None:
                        params = []
                    params.append((pos, a))
                    continue
                parents.append((pos, st.producer_of(a)))
            elif type(a) in (list, tuple) and a and isinstance(a[0], Tensor):
                if skeleton is None:
                    skeleton = list(args)
                inner = list(a)
                for j, b in enumerate(a):
                    if isinstance(b, Tensor):
                        inner[j] = None
                        versions.append(b)
                        if type(b) is Parameter:
                            if params is None:
                                params = []
                            params.append(((pos, j), b))
                        else:
                            parents.append(((pos, j), st.producer_of(b)))
                skeleton[pos] = type(a)(inner) if type(a) is tuple else inner
        kw_skeleton = kwargs
        if kwargs:
            for key, a in kwargs.items():
                if isinstance(a, Tensor):
                    if kw_skeleton is kwargs:
                        kw_skeleton = dict(kwargs)
                    kw_skeleton[key] = None
                    versions.append(a)
                    if type(a) is Parameter:
                        if params is None:
                            params = []
                        params.append((key, a))
                    else:
                        parents.append((key, st.producer_of(a)))
        before = [v._version for v in versions]

        # Copy-on-write: a predicted in-place write must not alter an activation saved earlier.
        if st.saved and versions:
            if _predicts_inplace(func) or kwargs.get("inplace"):
                if isinstance(args[0], Tensor):
                    st.protect_saved(args[0])
            elif "out" in kwargs:
                st.protect_saved_all(kwargs["out"])

        module_call = st.module_stack[-1] if st.module_stack else -1
        markers = st.markers
        if markers is not None:
            token = markers.op_enter(len(st.calls))
        t0 = perf_counter_ns()
        try:
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
        else:
            return out

        site, code, line = self.frames.locate(sys._getframe(1))
        call_index = len(st.calls)
        first_op = len(st.records)
        written = None
        for i, v in enumerate(versions):
            if v._version != before[i]:
                if written is None:
                    written = []
                written.append(v)
        st.calls.append(
            (func, tuple(skeleton) if skeleton is not None else args, kw_skeleton, tuple(parents),
             tuple(params) if params else (), module_call, code, line, t0, t1, first_op, len(leaves),
             written is not None, site)
        )
        if written is not None:
            st.note_writes(written, first_op)
        records = st.records
        save_mode = st.save_mode
        for slot, t in leaves:
            index = len(records)
            requires_grad = t.requires_grad
            records.append((call_index, slot, t.shape, t.dtype, t.device, requires_grad,
                            type(t.grad_fn) if requires_grad else None))
            producers[id(t)] = (weakref(t), index, t._version)
            if save_mode and (save_mode == 1 or st.wants(func, module_call)):
                st.save(index, t, requires_grad)
            if st.finite_flags is not None:
                st.record_finite(index, t)
        return out


def _tensor_leaves(out, prefix=()):
    """(slot path, tensor) for each tensor inside a (possibly nested) tuple/list result."""
    leaves = []
    for i, item in enumerate(out):
        if isinstance(item, Tensor):
            leaves.append((prefix + (i,) if prefix else i, item))
        elif isinstance(item, (tuple, list)):
            leaves.extend(_tensor_leaves(item, (prefix + (i,)) if prefix else (i,)))
    return leaves
