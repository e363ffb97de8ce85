"""Module call tracking: a stack of module call indices kept by one function around each module call.

While a trace runs, ``nn.Module._call_impl`` is replaced (``capture/call_impl.py``) so that every module
call of the tracing thread goes through ``record_call`` below, which records the call, runs torch's own
``_call_impl`` unchanged inside it, and pops the call in ``finally``.  A call made by another thread
goes straight to torch's.  Direct ``module.forward(...)`` calls do not go through ``_call_impl`` and so
are not module calls, exactly as for ``torch.utils.module_tracker.ModuleTracker``.

What a module call holds is what its caller sees.  The module's own hooks run inside the call:
- its inputs are the tensors the caller passed (before the module's forward pre-hooks replace any);
- its outputs are the tensors the caller receives (after the module's forward hooks replace any);
- ops run by the module's own hooks (and by global hooks) belong to that module call, and the call's
  start and end times include them.
"""

from __future__ import annotations

import sys
import threading
from time import perf_counter_ns
from types import CodeType

import torch
import torch.compiler as _compiler

from ..errors import first_few, warn_user
from ..tree import TENSOR_TYPES, tensor_leaves
from . import accel
from .arguments import TUPLE_VALUES
from .call_impl import Replacement, held_by, note_other_thread, owners_overriding, unsupported_overrides
from .teardown import until_done
from .source import _BOUNDARY, _CALL_IMPL, _SKIP, _STOP, _USER
from .state import CaptureState

_WRAPPED_CALL = torch.nn.Module._wrapped_call_impl.__code__
# ``_call_impl``'s nested ``inner``: a module with hooks of its own runs its forward from there.
_INNER = next((c for c in _CALL_IMPL.co_consts if isinstance(c, CodeType) and c.co_name == "inner"), None)


def _tensors_in(value, attrs: bool = False) -> list:
    """Every tensor inside a module call's arguments or output, found by the package's one walker (so
    a module call sees exactly the tensors the trace does, at any depth).  ``attrs``: plain objects'
    attributes too, as for a call's result (a module may return its state as an object)."""
    return [t for _, t in tensor_leaves(value, attrs=attrs)]


class ModuleCallTracker:
    """Context manager that records module calls into ``state.module_calls``."""

    __slots__ = ("state", "root", "frames", "progress", "skip", "module_types", "_replacement", "_outside",
                 "_bound")

    def __init__(self, state: CaptureState, root, frames=None, skip=(), module_types=(), progress=None):
        self.state = state
        self.root = root
        self.frames = frames  # a FrameClassifier: each call's user frame is found once, here
        self.progress = progress  # a progress bar advanced once per module call (torchlens.progress), or None
        self.skip = skip  # ids of modules whose calls are not module calls (see capture/compiled.py)
        self.module_types = module_types  # the model's module classes: which replace _call_impl themselves
        self._replacement = None
        self._outside = [None, None]
        self._bound = []  # the Recorders bound to this trace: unbound on exit

    @property
    def replaced(self) -> bool:
        """Whether this trace still holds ``_call_impl`` replaced (it must not, once exited)."""
        return bool(self._replacement is not None and self._replacement.held) or held_by(threading.get_ident())

    def __enter__(self):
        try:
            owners = owners_overriding(self.module_types)
            unsupported = unsupported_overrides(owners) if owners else ()  # owners: rare
            if unsupported:
                names = ", ".join(o.__qualname__ for o in unsupported)
                warn_user(f"the _call_impl of {names} is not a function: calls of their modules are not "
                          "recorded as module calls (their ops are attributed to the enclosing call)")
                owners = [o for o in owners if o not in unsupported]
            self.state.called_elsewhere = elsewhere = set()  # filled by other threads' calls (note_other_thread)
            replacement = self._replacement = Replacement(self._recorder_for, owners, elsewhere)
            replacement.acquire()  # Replacement.__enter__ without its own try: the except below undoes it
            return self  # inside the try: an interrupt landing here must not strand the replacement
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _recorder_for(self, impl, relays):
        """The recorder around one ``_call_impl`` (torch's, or a class's own), called through the frames of
        ``relays`` (the code of the relay and of the dispatcher: capture/call_impl.py): this thread's kept
        ``Recorders`` around ``impl``, bound to this trace."""
        recorders = _kept_recorders(impl, relays, self.frames)
        self._bound.append(recorders)  # first: whatever happens next, __exit__ unbinds it
        self._outside = recorders.outside  # the last one's, let go of first on exit (all are, by unbind)
        return recorders.bind(self.state, {id(self.root), *self.skip} if self.skip else {id(self.root)},
                              self.progress)

    @property
    def recording(self) -> bool:
        """Whether this thread's module calls are recorded now (not paused, not torn down)."""
        return self._replacement is not None and self._replacement.recording()

    def resume(self) -> None:
        """Record this thread's module calls again, after ``pause``."""
        if self._replacement is not None:
            self._replacement.resume()

    def pause(self) -> None:
        """Stop recording while a compiled region runs, and take the replacement out of Dynamo's sight."""
        if self._replacement is not None:
            self._replacement.pause()

    def __exit__(self, *exc):
        self._outside[:] = None, None  # first: one statement, nothing to strand
        try:
            self._release()
        except BaseException:  # interrupted: finish (until_done), then let the interrupt through
            until_done(self._release)
            raise
        return False

    def _release(self) -> None:
        if self._replacement is not None:
            self._replacement.release_all()
            self._replacement.make_recorder = None  # this tracker's method: no cycle keeps the trace alive
        bound = self._bound
        while bound:  # the trace's records are freed by reference counting, not held until the next trace
            bound[-1].unbind()
            bound.pop()


def other_threads_caveat(trace, called: set, index) -> tuple:
    """The caveat of a trace whose model's modules (``called``: their ids) were called on other threads while it
    ran (each expert of a mixture handed to a ThreadPoolExecutor), or none.  Their addresses are kept on the trace
    (``_ran_elsewhere``), so that a selection naming one says it ran on another thread, not that it never ran."""
    if not called:
        return ()
    trace._ran_elsewhere = tuple(a or "self" for a, m in index.modules_and_aliases().items() if id(m) in called)
    addresses = [a or "self" for a, m in index.modules.items() if id(m) in called]
    if not addresses:
        return ()
    text = (f"modules ran on another thread while the trace ran ({first_few(addresses)}): a trace records the calls "
            "and ops of its own thread only, so their calls and ops are not recorded, and what they returned enters "
            "the trace, where this forward read it, as tensors of unknown origin (Trace.unattributed); make those "
            "calls on the thread that calls tl.trace to record them")
    warn_user(text)
    return (text,)


_kept = threading.local()  # per thread: the Recorders of its last trace around torch's _call_impl


def _kept_recorders(impl, relays, frames) -> Recorders:
    """This thread's ``Recorders`` around ``impl``: the ones its last trace used when they fit and are not
    bound (a capture nested in a running one gets its own), else new ones, kept for the next trace when
    ``impl`` runs torch's own ``_call_impl`` (a class's own is not kept: it would hold the class's function
    past the trace)."""
    recorders = getattr(_kept, "recorders", None)
    if recorders is not None and recorders.impl is impl and recorders.relays is relays \
            and recorders.frames is frames and recorders.state is None:
        return recorders
    recorders = Recorders(impl, relays, frames)
    if getattr(impl, "__code__", None) is _CALL_IMPL:
        _kept.recorders = recorders
    return recorders


class _Everything:
    """The modules skipped while unbound: all of them (a call that still reaches the recorder goes to torch)."""

    def __contains__(self, module_id) -> bool:
        return True


_UNBOUND = (None, None, None, None, None, _Everything(), None, None, False)


class Recorders:
    """One thread's recorders around one ``_call_impl``: the Python ``record_call`` and, built on first
    use, the compiled one (accel/src/torchlens_accel/_module_calls.c).  They are built once per thread and
    bound to each trace's state as it starts (``bind``) and unbound as it ends (``unbind``), so that a
    trace builds no closures and no compiled recorder, and no trace's records are held in between."""

    __slots__ = ("impl", "relays", "frames", "owner", "outside", "state", "_python", "_shared", "_rebind", "_compiled")

    def __init__(self, impl, relays, frames):
        self.impl, self.relays, self.frames = impl, relays, frames
        self.owner = threading.get_ident()
        # Torch code run as an unrecorded module's forward (the root nn.Sequential's) calls every child
        # from the same frame: walk once per such frame.  (It is on the stack, so alive, meanwhile.)  The
        # frame leads back to the trace driver's: the tracker lets go of it on exit.
        self.outside = [None, None]  # [that frame, its answer]
        self.state = None  # the CaptureState of the trace bound now
        self._python, *self._shared, self._rebind = _python_recorder(impl, relays, frames, self.outside, self.owner)
        self._compiled = None

    def bind(self, st: CaptureState, skip: set, progress):
        """Record into the trace of ``st`` from now on, but for the calls of the modules whose ids are in
        ``skip``; returns the recorder to put in place."""
        markers = st.markers
        extras = markers is not None or progress is not None  # one check per call when neither is on
        calls, stack, call_frames, producers = st.module_calls, st.module_stack, st.call_frames, st.producers
        self.state = st
        self._rebind(st, calls, stack, call_frames, producers, skip, markers, progress, extras)
        compiled = None if extras else accel.compiled("_capture")
        if compiled is None:
            return self._python
        recorder = self._compiled
        if recorder is not None:
            recorder.bind(st, skip, stack, calls, call_frames, producers)
            return recorder
        python, (verdicts, bound_all, bound_output, call_frame) = self._python, self._shared
        # The compiled record_call records the common call the same way, and hands every other call to the
        # Python one whole.  Positional, in the order of its keyword names (impl, fallback, state, owner, skip,
        # stack, calls, call_frames, producers, verdicts, bound_all, outside, call_frame, dispatcher_code,
        # wrapped_call, call_impl, inner, tensor_type, parameter_type, user, skip_verdict, stop, boundary,
        # tuple_values, bound_output, compiler_dict, fast_reads, note_other).
        # ``dispatcher_code``: the relays' codes.
        reads = accel.compiled("_reads")  # (tensors' versions read off the TensorImpl; None where not built)
        recorder = self._compiled = compiled.ModuleRecorder(
            self.impl, python, st, self.owner, skip, stack, calls, call_frames, producers, verdicts, bound_all,
            self.outside, call_frame, self.relays, _WRAPPED_CALL, _CALL_IMPL, _INNER,
            torch.Tensor, torch.nn.Parameter, _USER, _SKIP, _STOP, _BOUNDARY, TUPLE_VALUES, bound_output,
            vars(_compiler), reads.fast_reads if reads is not None else None, note_other_thread)
        return recorder

    def unbind(self) -> None:
        """Hold no trace's lists nor frames: a call that still reaches a recorder goes straight to torch's code."""
        self.outside[:] = None, None
        self.state = None
        self._rebind(*_UNBOUND)
        if self._compiled is not None:
            self._compiled.bind()


def _python_recorder(impl, relays, frames, outside: list, owner: int):
    """``record_call(module, *args, **kwargs)`` around ``impl`` for the thread ``owner``, with what the
    compiled one shares with it and the function that binds them to a trace: ``(record_call, verdicts,
    bound_all, bound_output, call_frame, rebind)``.  Unbound, every call goes straight to ``impl``."""
    getframe, clock, get_ident = sys._getframe, perf_counter_ns, threading.get_ident
    verdicts = frames._verdicts if frames is not None else {}
    dispatcher_code, relay_code = relays
    st, calls, stack, call_frames, producers, skip, markers, progress, extras = _UNBOUND

    def rebind(*binding):
        """Record into another trace (its state and lists, skipped module ids, markers, progress bar, and
        whether either is on): the closures' own variables, so a call reads them as before."""
        nonlocal st, calls, stack, call_frames, producers, skip, markers, progress, extras
        st, calls, stack, call_frames, producers, skip, markers, progress, extras = binding

    def bound(t):  # st.value_record, its common case inlined
        entry = producers.get(id(t))
        if entry is None or not (entry[0] is t or entry[0]() is t):
            return -1
        return entry[1] if st.last_write <= entry[1] else st.value_record(t)  # else maybe written since

    def bound_all(value, attrs=False):
        if type(value) is tuple or type(value) is list:  # the common case, as the compiled recorder reads it
            found = []
            for item in value:  # plain tensors and the plain values of a flat tuple, where the walker finds none
                kind = type(item)
                if kind in TENSOR_TYPES:
                    found.append(bound(item))
                elif kind not in TUPLE_VALUES:
                    break  # a nested or other value: the walker decides
            else:
                return tuple(found)
        return tuple(bound(t) for t in _tensors_in(value, attrs))

    def bound_output(value):
        """``bound_all`` of a call's result, plain objects' attributes included."""
        return bound_all(value, True)

    def call_frame(wrapped, parent):
        """The user frame that made the call, by a walk from above the call (the uncommon cases)."""
        if frames is None:
            return None, None
        return frames.module_call_frame(wrapped, call_frames, parent)

    def _run_root(module, args, kwargs):
        """The trace's call of its root module: not recorded, but marked as running, so that the root's calls
        of itself inside it (recursion) are recorded as module calls (``self:2``, ``self:3``, ...)."""
        running = st  # the trace this call began in: a forked child tears capture down inside it
        running.root_running = True
        try:
            return impl(module, *args, **kwargs)
        finally:
            running.root_running = False

    # Runs once per module call inside every trace: the common cases (one tensor argument, a call
    # made straight from user code or by nn.Sequential) take no loop and no method call.
    def record_call(module, *args, **kwargs):
        if get_ident() != owner:  # not recorded, but noted: the trace says so after the forward
            note_other_thread(module)
            return impl(module, *args, **kwargs)
        # Modules Dynamo runs while it compiles (torch.cond's branches, on fake tensors) are no module calls.
        if _compiler._is_compiling_flag:
            return impl(module, *args, **kwargs)
        if id(module) in skip:
            if st is None or module is not st.root:
                return impl(module, *args, **kwargs)
            if not st.root_running:  # the trace's own call of its root, which is not a module call
                return _run_root(module, args, kwargs)
            # else the root called again inside its own call (recursion): a module call like any other
        if st.acting:  # a call an intervention's action makes (intervene/runtime.py): none of the forward's
            return impl(module, *args, **kwargs)
        parent = stack[-1] if stack else -1
        # record_call <- (the dispatcher, while several threads trace) <- (the relay, when the code of
        # _call_impl is swapped) <- _wrapped_call_impl <- the caller: a user frame is the answer
        # (FrameClassifier.module_call_frame, inlined).
        wrapped = getframe(1)
        code = wrapped.f_code
        if code is dispatcher_code:
            wrapped = wrapped.f_back
            code = wrapped.f_code
        if code is relay_code:
            wrapped = wrapped.f_back
            code = wrapped.f_code
        if code is _WRAPPED_CALL:
            caller = wrapped.f_back
            code = caller.f_code
            verdict = verdicts.get(id(code))
            if verdict == _USER:
                frame = (code, caller.f_lasti)
            elif verdict == _SKIP and (back := caller.f_back) is not None and (
                    (code := back.f_code) is _CALL_IMPL or code is _INNER):
                # Torch code run as a forward by _call_impl (nn.Sequential's) made it: the site of
                # the call running that forward.
                if parent >= 0:
                    frame = call_frames[parent]
                elif outside[0] is caller:
                    frame = outside[1]
                else:
                    frame = call_frame(caller, parent)
                    outside[:] = caller, frame
            else:
                frame = call_frame(caller, parent)
        elif parent >= 0 and calls[parent][0] is module or parent < 0 and module is st.root:
            # A class's own _call_impl calling nn.Module's (super()): the same call, recorded once (the root's
            # own call, never).
            return impl(module, *args, **kwargs)
        else:
            frame = call_frame(wrapped, parent)
        if len(args) == 1 and not kwargs and type(args[0]) in TENSOR_TYPES:
            inputs = (bound(args[0]),)
        else:  # the positional arguments' tensors, then the keyword arguments', in the order passed
            inputs = bound_all(args) + bound_all(tuple(kwargs.values())) if kwargs else bound_all(args)
        index = len(calls)
        call = [module, parent, clock(), None, inputs, ()]
        call_frames.append(frame)
        calls.append(call)
        stack.append(index)  # after the record: an interrupt between them strands nothing
        if extras:
            if markers is not None:
                markers.module_enter(index)
            if progress is not None:
                progress.update()
        try:
            output = impl(module, *args, **kwargs)
        except BaseException as raised:
            if not call[5]:  # it returned nothing: None, where a call returning None has () (capture/caught.py)
                call[5] = None
            if st.raised_in is None or st.raised_in[0] is not raised:  # the innermost call it left
                st.raised_in = (raised, index)
            raise
        finally:
            call[3] = clock()
            stack.pop()
            if extras and markers is not None:
                markers.module_exit(index)
        if type(output) in TENSOR_TYPES:
            call[5] = (bound(output),)
        elif output is not None:
            call[5] = bound_output(output)
        if st.pass_through is not None:  # an op in it returned its argument itself: CaptureState.note_pass_through
            st.end_pass_through(index, parent, call[5])
        return output

    return record_call, verdicts, bound_all, bound_output, call_frame, rebind
