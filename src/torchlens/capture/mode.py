"""The capture hot path: one ``TorchFunctionMode`` handler per torch call.

Every torch function, Tensor method, operator and factory called by the model's Python code reaches
``CaptureMode.__torch_function__``.  The handler calls the function unchanged and, when the result holds
tensors, appends compact tuples to the session's raw lists.  Everything richer (labels, pass groups,
module records, source text) is derived after the forward by ``record.finalize``.  How a call's
arguments are recorded is ``arguments.py``; its output records, ``outputs.py``; the writes it is
predicted to make or found to have made (copy-on-write), ``writes.py``; where it was called from,
``source.py``.

Torch pops the mode while the handler runs, so torch calls made *inside* a handled function (the body
of ``F.normalize``, say) are not seen: the handled call is one op.  That is the contract documented in
docs/capture_honesty.md.
"""

from __future__ import annotations

import sys
import threading
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

from ..record.columns import BUFFER
from ..record.layouts import shape_of
from ..tree import is_uninitialized
from . import accel
from .arguments import PLAIN_VALUES, TUPLE_VALUES, bound_parent, scan_arguments, scan_linear
from .fastpath import OPERATORS_WHOLE
from .fused_writes import RUNNING_STATS_FLAGS
from .grads import requires_grad_changed
from .outputs import grad_node, made_since, output_leaves, record_output
from .source import CALL_IMPL as _CALL_IMPL
from .source import CALL_IMPL_INNER as _CALL_IMPL_INNER
from .source import DISPATCH as _DISPATCH_FRAME
from .source import BOUNDARY as _BOUNDARY_FRAME
from .source import SKIP as _SKIP_FRAME
from .source import STOP as _STOP_FRAME
from .source import USER as _USER_FRAME
from .source import VERDICTS as _verdicts
from .source import FrameClassifier, called_by_module_call, dispatched_site, outside_torch, user_site
from .state import CaptureState
from .collectives import WRITTEN_ARGUMENT
from .writes import inplace_cache, protect_before_write, written_arguments

Tensor = torch.Tensor
Parameter = torch.nn.Parameter
_DATA_GET = frozenset([Tensor.data.__get__])  # method-wrappers compare equal, not identical

# Calls that never produce a tensor; skipping them early keeps the commonest calls nearly free.
_NOT_OP_METHODS = (
    "size", "dim", "numel", "stride", "item", "tolist", "numpy", "__len__", "__bool__", "__format__",
    "__repr__", "__hash__", "__index__", "__int__", "__float__", "is_contiguous", "is_floating_point",
    "is_complex", "data_ptr", "storage_offset", "element_size", "nelement", "untyped_storage",
    "get_device", "requires_grad_", "retain_grad", "register_hook", "__array__", "__dlpack__",
)
_NOT_OP_PROPERTIES = (
    "shape", "dtype", "device", "requires_grad", "grad_fn", "grad", "is_leaf", "ndim", "is_cuda",
    "_base", "layout", "_version", "is_sparse", "is_quantized", "is_meta",
    # Read by torch's own modules on every call (nn.MultiheadAttention, TransformerEncoderLayer: is_nested).
    "is_nested", "is_cpu", "is_mkldnn", "is_mps", "is_xpu", "is_sparse_csr", "itemsize", "nbytes",
)


def _not_ops() -> frozenset:
    found = [getattr(Tensor, name, None) for name in _NOT_OP_METHODS]
    for name in _NOT_OP_PROPERTIES:
        descriptor = Tensor.__dict__.get(name) or torch._C.TensorBase.__dict__.get(name)
        found.append(getattr(descriptor, "__get__", None))
    return frozenset(f for f in found if f is not None)


# ``t.requires_grad_()`` and ``t.requires_grad = ...``: a leaf made in the forward starts or stops needing a gradient.
_REQUIRES_GRAD_SETTERS = frozenset([Tensor.requires_grad_, torch._C.TensorBase.__dict__["requires_grad"].__set__])
# ``t.data = value``: ``t`` now holds ``value``'s memory, with no write and no version counter moved.
_DATA_SET = frozenset([torch._C.TensorBase.__dict__["data"].__set__])
# Calls that never produce a tensor; skipping them early keeps the commonest calls nearly free.
_NOT_OPS = _not_ops() | _REQUIRES_GRAD_SETTERS | _DATA_SET
# scaled_dot_product_attention picks its kernel from the backends enabled at the call (sdpa_kernel), which
# replay must restore: it takes the general path, where they are noted.
_SDPA = torch._C._nn.scaled_dot_product_attention
# Calls run with module-call recording paused: a higher-order op recorded whole, and a backward run inside
# the traced forward, which runs no op of the forward but may call its modules again (the recomputation of
# torch.utils.checkpoint).
_BACKWARDS = frozenset([Tensor.backward, torch.autograd.backward, torch.autograd.grad])
_UNRECORDED_INSIDE = OPERATORS_WHOLE | _BACKWARDS
# One lookup per call keeps these off the hot path.
_OFF_HOT_PATH = _NOT_OPS | _DATA_GET | {_SDPA} | _UNRECORDED_INSIDE
# Calls that hand a tensor's memory to NumPy (``np.from_dlpack(t)`` calls ``__dlpack__``): a write through the
# array moves no version counter, so what is saved in that memory is copied first.  ``untyped_storage()`` is
# not among them: FSDP2 frees memory through it (``resize_(0)``), which must read as freed, not be copied.
_NUMPY_VIEWS = frozenset([Tensor.numpy, Tensor.__array__, Tensor.__dlpack__])
# ``t.untyped_storage()`` hands out the storage object itself: a tensor put on it (``u.set_(storage, ...)``, a
# call torch hands no ``__torch_function__``) shares ``t``'s bytes but not its version counter.
_STORAGE_GET = Tensor.untyped_storage
_REGISTER_HOOK = Tensor.register_hook
# Not ops that ``_not_an_op`` must see (the compiled handler hands them to Python): NumPy views and storage
# reads, a user's tensor hook, which the gradient capture's hook must run after (GradCapture.run_after_user_hook),
# and the requires_grad setters, after which the record of the tensor set says what it now is, and the data setter.
_NOT_OPS_SEEN = _NUMPY_VIEWS | {_STORAGE_GET, _REGISTER_HOOK} | _REQUIRES_GRAD_SETTERS | _DATA_SET
_grad_enabled = torch.is_grad_enabled
_get_ident = threading.get_ident
_any_autocast = torch._C._is_any_autocast_enabled

_NO_KWARGS: dict = {}  # shared and never mutated: saves a dict per call
_getframe = sys._getframe
# The hot path's inline scan: the second argument types it handles, and the skeletons it shares.
_PLAIN_SECOND = frozenset([Tensor, int, float, bool])
_BLANK_ONE, _BLANK_TWO = (None,), (None, None)


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
        self.thread = _get_ident()  # the tracing thread: the only one whose calls are recorded (see the handler)
        self._entered = [None]  # Python-level torch functions currently entered by deep capture
        # The features set on the state before the mode is made; with all off, every op takes the hot path.
        # Label sites keep it too: their calls are recorded there, then handed to ``at_call`` (``state.site_calls``).
        self.plain = not deep and state.markers is None and state.plain_save
        compiled = accel.compiled("_capture") if self.plain else None
        if compiled is not None:
            # The compiled hot path records the same; torch finds it through the class's slot (below).
            if _slot is None:
                _install_slot(compiled)
            setattr(self, _HANDLER_KEY, _compiled_handler(compiled, self))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _compiler._is_compiling_flag:  # first: Dynamo reads no further (it cannot hold torch.cond in a set)
            return self._call_with_features(func, types, args, kwargs or _NO_KWARGS)
        if _get_ident() != self.thread:
            # Torch hands a thread its forker's torch state, this mode included, when TorchScript's fork runs a
            # task on its inter-op pool: a Python function that task calls (a torch.jit.ignore'd one) reaches
            # the mode there, while the tracing thread runs other modules.  Capture records its own thread's
            # calls only (the module stack, the order, the state are that thread's), so the call runs untraced
            # and its result enters the trace as a tensor of unknown origin, as any other thread's work does.
            return func(*args, **(kwargs or _NO_KWARGS))
        if func in _OFF_HOT_PATH:
            if func in _NOT_OPS:
                return _not_an_op(self.state, func, args, kwargs)
            if func in _DATA_GET and is_uninitialized(args[0]):  # a lazy module reading it to materialize it
                return func(*args)  # no value yet, nothing to record
            return self._call_with_features(func, types, args, kwargs or _NO_KWARGS)  # x.data, cond, backward
        if not self.plain:
            return self._call_with_features(func, types, args, kwargs or _NO_KWARGS)
        st = self.state
        # A label site's call is recorded here as any other, then handed to the interventions (``at_call``).
        at_site = st.site_calls is not None and len(st.calls) in st.site_calls
        n = len(args)
        inline = 0 < n < 3 and type(args[0]) is Tensor and (n == 1 or type(args[1]) in _PLAIN_SECOND)
        if not inline and n > 2 and type(args[0]) is Tensor:  # x.view(b, t, h, d), x.transpose(1, 2)
            inline = True
            for value in args[1:]:
                if type(value) not in PLAIN_VALUES:
                    inline = False
                    break
        if inline and kwargs:
            for value in kwargs.values():
                if type(value) not in PLAIN_VALUES:
                    inline = False
                    break
        if inline:
            # The commonest calls, scanned inline: a plain tensor first, then one more tensor or plain
            # values (numbers, dtypes, slices), and plain keyword values if any (torch.sin(x), x * 2,
            # a @ b, x.view(b, t, h, d), F.relu(x, inplace=False)).  Parameters, containers, tensors
            # passed by keyword and tensor subclasses take the general scan.
            kwargs = kw_skeleton = kwargs or _NO_KWARGS
            params = None
            a = args[0]
            try:
                version = a._version
            except RuntimeError:  # an inference tensor: no version counter
                version = st.version(a)
            entry = st.producers.get(id(a))
            if entry is not None and entry[2] == version and version is not None and (entry[0] is a or entry[0]() is a):
                parents = ((0, entry[1]),)
            else:
                parents = ((0, st.producer_of(a)),)
            versions = ((a, version),)
            if n == 1:
                skeleton = _BLANK_ONE
            elif type(args[1]) is Tensor:  # two tensors (only two arguments are scanned inline then)
                skeleton = _BLANK_TWO
                parent, second = bound_parent(st, args[1])
                parents += ((1, parent),)
                versions += (second,)
            else:
                skeleton = (None, args[1]) if n == 2 else (None, *args[1:])
        elif 1 < n < 4 and type(args[0]) is Tensor and type(args[1]) is Parameter and not kwargs \
                and (n == 2 or args[2] is None or type(args[2]) is Parameter):
            # F.linear(x, weight, bias) in nn.Linear, the commonest call with parameters: as the general
            # scan records it, without its loop.
            kwargs = kw_skeleton = _NO_KWARGS
            skeleton, parents, params, versions = scan_linear(st, args)
        else:
            if kwargs is None:
                kwargs = _NO_KWARGS
            skeleton, kw_skeleton, parents, params, versions = scan_arguments(st, args, kwargs)
        if st.saved and versions and (inplace_cache.get(func) is not False
                                      or (kwargs and ("out" in kwargs or kwargs.get("inplace")))):
            protect_before_write(st, func, args, kwargs)  # a write predicted by name or by keyword
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
            leaves = output_leaves(func, out, args, kwargs)
            if not leaves:
                if st.recent_alias_reads:  # no op: a read through an alias its scan noted is no op's
                    st.forget_unrecorded_reads()
                return out

        # The user's frame: one dict lookup in the common case of an op called from user code.
        # Lines are resolved from instruction offsets only when asked for (record/op.py).
        frame = _getframe(1)
        code = frame.f_code
        verdict = _verdicts.get(id(code))
        if verdict == _USER_FRAME:
            line = frame.f_lasti
            site = user_site(frame, code, line)
        elif verdict == _SKIP_FRAME and module_call >= 0 and type(func) is not FunctionType \
                and called_by_module_call(frame.f_back):
            # A builtin called straight from a torch module's forward (F.linear in nn.Linear): the site is
            # that line, the user line the module call's (what ``locate`` finds, without its walk; a
            # Python-level function's own frame is never its site there, so those take the walk).
            site = (code, frame.f_lasti)
            code, line = st.call_frames[module_call]
        else:  # a Python-level torch function (F.relu), torch's own code elsewhere, or a new frame
            locate = self.frames.locate
            if verdict == _DISPATCH_FRAME:
                site, code, line = dispatched_site(frame, func, st.call_frames, module_call, locate)
            else:
                site, code, line = locate(frame, func, st.call_frames, module_call)
        calls = st.calls
        call_index = len(calls)
        records = st.records
        first_op = len(records)
        written = None
        for v, before in versions:
            if before is None or v._version != before:  # a write (or an inference tensor): which ones
                written = written_arguments(func, args, kwargs, versions, out)
                break
        else:
            if leaves is not None and func in WRITTEN_ARGUMENT:  # a collective's write moves no version
                written = written_arguments(func, args, kwargs, versions, out)
        if st.save_mode and (_grad_enabled() is not st.grad_enabled or _any_autocast() or st.any_autocast):
            st.note_context(call_index)  # replay (which needs saved values) runs it as it ran
        # Compact for long traces: tuples, and one shared empty dict for the common no-keyword call.
        calls.append((func, skeleton, kw_skeleton or _NO_KWARGS, parents, params or (), module_call, code, line,
                      t0, t1, first_op, 1 if leaves is None else len(leaves), written is not None, site))
        if written is not None:
            st.note_writes(written, first_op)
        if leaves is not None:
            if written is None and module_call >= 0:
                st.note_returned_arguments(out, args, leaves, first_op, module_call, func)
            for slot, t in leaves:
                record_output(st, call_index, slot, t, func, module_call)
            if at_site:
                return st.intervention.at_call(st, call_index, first_op, out, leaves, func, args, kwargs)
            return out

        # One tensor out, the common case, inlined.
        if n and out is args[0] and written is None and module_call >= 0:
            st.note_pass_through(out, first_op, module_call, func)
        requires_grad = out.requires_grad
        try:  # (a subclass, such as a jagged nested tensor, has its shape read by shape_of)
            shape = out.shape if type(out) is Tensor else shape_of(out)
        except RuntimeError:  # a nested tensor has no single shape
            shape = shape_of(out)
        grad_fn, node_type = grad_node(out) if requires_grad else (None, None)  # kept to the watch below
        records.append((call_index, None, shape, out.dtype, out.device, requires_grad, node_type))
        try:
            version = out._version
        except RuntimeError:  # made under torch.inference_mode(): no version counter
            version = st.version(out)
        if node_type is not None and st.grads is not None:  # tl.trace(..., grads=...): capture/grads.py
            st.grads.watch(first_op, out, func, module_call)
        if st.finite_flags is not None:  # tl.trace(..., record_finite=True)
            st.record_finite(first_op, out)
        save_mode = st.save_mode
        if save_mode and (save_mode == 1 or st.wants(func, module_call)):
            # Kept by reference; its storage is keyed only when a write may need it (CaptureState.save).
            st.saved[first_op] = out.detach() if requires_grad else out
            st.saved_versions[first_op] = version
            if save_mode == 1:
                # Every op saved holds its output's memory until the trace ends, so the binding holds the
                # output itself: no weak reference to make and to clear when it dies (CaptureState.producers).
                # A selection's (mode 2) may be let go before then (written unseen, so dropped): its binding must
                # not hold it then.
                st.producers[id(out)] = (out, first_op, version)
                if at_site:
                    return st.intervention.at_call(st, call_index, first_op, out, ((None, out),), func, args, kwargs)
                return out
        st.producers[id(out)] = (weakref(out), first_op, version)
        if at_site:
            return st.intervention.at_call(st, call_index, first_op, out, ((None, out),), func, args, kwargs)
        return out

    def _call_with_features(self, func, types, args, kwargs):
        """The general path: deep capture, profiler markers, gradient capture, interventions,
        device moves and a saving budget, and calls Dynamo is compiling."""
        if _compiler._is_compiling_flag:
            # Dynamo is tracing this handler symbolically (torch.cond, flex_attention and other
            # higher-order ops compile their bodies even in eager mode): be transparent to it, so the
            # bodies compile as they would untraced.  What then runs eagerly is recorded as usual.
            return func(*args, **kwargs)
        st = self.state
        skeleton, kw_skeleton, parents, params, versions = scan_arguments(st, args, kwargs)
        if st.saved and versions:
            protect_before_write(st, func, args, kwargs)
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
            elif func in _UNRECORDED_INSIDE and st.suspend is not None:
                with st.suspend():  # the module calls and the shim out of its way, as for a compiled region
                    out = func(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
        except BaseException as exc:
            st.note_failure(func, module_call, exc)
            raise
        finally:
            if markers is not None:
                markers.op_exit(token)
        t1 = perf_counter_ns()

        leaves = ((None, out),) if isinstance(out, Tensor) else output_leaves(func, out, args, kwargs)
        if not leaves:
            if st.recent_alias_reads:  # no op: a read through an alias its scan noted is no op's
                st.forget_unrecorded_reads()
            return out
        if deep and all(made_since(st.producers, t, records_before) for _, t in leaves):
            return out  # the inner ops produced every output: they are the record

        frame = sys._getframe(2)  # the caller of __torch_function__
        if func in OPERATORS_WHOLE:
            frame = outside_torch(frame)  # torch.cond's caller, not the graph Dynamo made of the call
        code = frame.f_code
        if self.frames.is_user(code):
            line = frame.f_lasti
            site = user_site(frame, code, line)
        else:
            site, code, line = self.frames.locate(frame, func, st.call_frames, module_call)
        call_index = len(st.calls)
        first_op = len(st.records)
        written = written_arguments(func, args, kwargs, versions, out)
        if st.save_mode and (_grad_enabled() is not st.grad_enabled or _any_autocast() or st.any_autocast):
            st.note_context(call_index)
        if func is _SDPA and st.save_mode:
            st.note_attention_backends(call_index)
        st.calls.append((func, skeleton, kw_skeleton or _NO_KWARGS, parents, params or (), module_call, code, line,
                         t0, t1, first_op, len(leaves),
                         written is not None, site))
        if written is not None:
            st.note_writes(written, first_op)
        if func in _DATA_GET:  # ``x.data`` shares x's storage but not its version counter
            st.data_bases[id(out)] = (weakref(out), weakref(args[0]))
        if len(leaves) == 1 and args and leaves[0][1] is args[0] and written is None and module_call >= 0:
            st.note_pass_through(args[0], first_op, module_call, func)
        elif len(leaves) > 1 and written is None and module_call >= 0:
            st.note_returned_arguments(out, args, leaves, first_op, module_call, func)
        for slot, t in leaves:
            record_output(st, call_index, slot, t, func, module_call)
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


# The compiled accelerator, once first used: each plain mode holds its compiled handler under this key, and
# the class's ``__torch_function__`` becomes a slot (a data descriptor) that answers a mode's lookup with
# that handler, and with the Python method for a mode without one, or while Dynamo compiles (it traces a
# mode's handler and can trace only Python: torch.cond's bodies, flex_attention).  A process that never
# uses the accelerator (TORCHLENS_ACCEL=0) keeps the plain Python method on the class.
_HANDLER_KEY = "_compiled_torch_function"
_slot = None
_slot_lock = threading.Lock()


def _install_slot(compiled) -> None:
    global _slot
    with _slot_lock:
        if _slot is None:
            _slot = compiled.HandlerSlot(method=CaptureMode.__dict__["__torch_function__"],
                                         compiler_dict=vars(_compiler), key=_HANDLER_KEY)
            CaptureMode.__torch_function__ = _slot


def _compiled_handler(compiled, mode):
    """The compiled ``__torch_function__`` of a plain capture (accel/src/torchlens_accel/_capture.c).  It
    holds the mode weakly (the mode holds it), and hands calls it does not cover to
    ``CaptureMode.__torch_function__`` whole."""
    template = _templates.get(compiled)
    if template is None:
        template = _templates[compiled] = _handler_template(compiled)
    return template.bind(mode, mode.state, mode.frames.locate)


_templates: dict = {}  # compiled module -> its Handler template


def _compiled_reads():
    """What torchlens-accel's ``_reads`` (built against torch) gives the handler: ``_is_any_autocast_enabled``
    without the list of device types torch's binding builds per call, and the capsule of its tensor reads
    (fast_reads.h); torch's own function and None where that module is not built for this torch."""
    reads = accel.compiled("_reads")
    return (reads.any_autocast, reads.fast_reads) if reads is not None else (_any_autocast, None)


def _handler_template(compiled):
    """A handler for no capture, holding every object the C needs (it imports nothing): what each trace's
    handler shares, made once per process."""
    any_autocast, fast_reads = _compiled_reads()
    return compiled.Handler(
        mode=None, method=CaptureMode.__torch_function__, state=None, off_hot_path=_OFF_HOT_PATH,
        not_ops=_NOT_OPS, numpy_views=_NOT_OPS_SEEN,
        compiler_dict=vars(_compiler), tensor_type=Tensor, parameter_type=Parameter, function_type=FunctionType,
        plain_values=PLAIN_VALUES, tuple_values=TUPLE_VALUES, inplace_cache=inplace_cache,
        running_stats=RUNNING_STATS_FLAGS, buffer_kind=BUFFER, no_kwargs=_NO_KWARGS, protect=protect_before_write,
        output_leaves=output_leaves,
        record_output=record_output, written_arguments=written_arguments, shape_of=shape_of,
        verdicts=_verdicts, locate=None, dispatched_site=dispatched_site, call_impl=_CALL_IMPL,
        call_impl_inner=_CALL_IMPL_INNER, grad_enabled=_grad_enabled, any_autocast=any_autocast,
        getters=_GETTER_DESCRIPTORS, user=_USER_FRAME, skip=_SKIP_FRAME, dispatch=_DISPATCH_FRAME, stop=_STOP_FRAME,
        boundary=_BOUNDARY_FRAME, fast_reads=fast_reads)


_GETTERS = ("_version", "shape", "dtype", "device", "requires_grad", "grad_fn")  # the C's GETTER order


def _resolved(cls, name: str):
    """What ``cls``'s instances find first for attribute ``name`` in the class hierarchy."""
    for owner in cls.__mro__:
        if name in owner.__dict__:
            return owner.__dict__[name]
    return None


def _tensor_getters():
    """The data descriptors that exact tensors and Parameters resolve the attributes the hot path reads to
    (the compiled handler calls them directly), or None where a torch build resolves them otherwise."""
    getters = tuple(_resolved(Tensor, name) for name in _GETTERS)
    same = all(_resolved(Parameter, name) is g for name, g in zip(_GETTERS, getters))
    data = all(hasattr(type(g), "__get__") and hasattr(type(g), "__set__") for g in getters)
    return getters if same and data else None


_GETTER_DESCRIPTORS = _tensor_getters()


def _not_an_op(st, func, args, kwargs):
    """A call that never produces a tensor (``x.shape``, ``x.size()``): run it unrecorded."""
    if func in _NOT_OPS_SEEN:
        if func is _REGISTER_HOOK:
            return _user_hook(st, args, kwargs)
        if func in _REQUIRES_GRAD_SETTERS:
            result = func(*args, **(kwargs or _NO_KWARGS))
            requires_grad_changed(st, args[0])
            return result
        if func in _DATA_SET:
            return _set_data(st, func, args, kwargs)
        if func is _STORAGE_GET:
            st.note_export(args[0], whole_storage=True)
            return func(*args, **(kwargs or _NO_KWARGS))
        if st.saved:
            # NumPy shares the memory and writes through it bump no version counter: what is saved
            # must not change with it.
            st.protect_saved(args[0])
        # A tensor made from what it hands out (torch.from_dlpack(t), torch.from_numpy(t.numpy())) shares the
        # bytes, not the version counter: its writes are noted as writes through t.data.
        st.note_export(args[0])
    return func(*args, **(kwargs or _NO_KWARGS))


def _set_data(st, func, args, kwargs):
    """``t.data = value`` in the forward (BinaryNet's ``input.data = Binarize(input.data)``): ``t`` keeps its
    identity and takes ``value``'s memory, moving no version counter.  What was saved in ``t``'s memory is
    copied first (an activation saved by reference is ``t`` itself), and a later read of ``t`` names the
    record whose value ``value`` is, not the op that made ``t``'s old value."""
    if st.saved:
        st.protect_saved(args[0], between_calls=True)
    result = func(*args, **(kwargs or _NO_KWARGS))
    st.data_replaced(args[0], args[1])
    return result


def _user_hook(st, args, kwargs):
    """``t.register_hook(hook)`` in the forward: registered, then, when ``t`` is a record's current value
    with a gradient hook, that hook is moved behind the user's (what it keeps is what ``retain_grad()``
    would: the gradient after the user's hooks)."""
    handle = _REGISTER_HOOK(*args, **(kwargs or _NO_KWARGS))
    t = args[0] if args else None
    if st.grads is not None and isinstance(t, Tensor):
        index = st.record_holding(t)
        if index is not None:
            st.grads.run_after_user_hook(index, t)
    return handle


