"""Module call tracking: a stack of integers maintained by global forward hooks.

Global hooks (``register_module_forward_pre_hook`` / ``register_module_forward_hook``) see every module
call however the module was reached, and are removed in ``finally``: nothing is left on the model.  A
call made by another thread is ignored.  Direct ``module.forward(...)`` calls bypass hooks and so are
not module calls, exactly as for ``torch.utils.module_tracker.ModuleTracker``.
"""

from __future__ import annotations

import sys
import threading
from time import perf_counter_ns

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..tree import tensor_leaves
from .source import _CALL_IMPL, _SKIP, _USER
from .state import CaptureState
from .teardown import remove_handles

_WRAPPED_CALL = torch.nn.Module._wrapped_call_impl.__code__
_TENSORS = frozenset([torch.Tensor, torch.nn.Parameter])


def _tensors_in(value) -> list:
    """Every tensor inside a module call's arguments or output, found by the package's one walker (so
    a module call sees exactly the tensors the trace does, at any depth)."""
    return [t for _, t in tensor_leaves(value)]


def _in_parent_call(frame, verdicts) -> bool:
    """Whether ``frame`` is torch's ``inner`` of the enclosing module call (its ``_call_impl`` next):
    the walk in ``FrameClassifier.module_call_frame`` would stop there with the parent's answer."""
    return (frame is not None and verdicts.get(id(frame.f_code)) == _SKIP and frame.f_back is not None
            and frame.f_back.f_code is _CALL_IMPL)


class ModuleCallTracker:
    """Context manager that records module calls into ``state.module_calls``."""

    def __init__(self, state: CaptureState, root, frames=None, skip=()):
        self.state = state
        self.root = root
        self.frames = frames  # a FrameClassifier: each call's user frame is found once, here
        self.progress = None  # a progress bar advanced once per module call (torchlens.progress), or None
        self.skip = skip  # ids of modules whose calls are not module calls (see capture/compiled.py)
        self._handles = []
        self._hooks = None

    def __enter__(self):
        st, root, owner, frames, progress = self.state, self.root, threading.get_ident(), self.frames, self.progress
        calls, stack, call_frames = st.module_calls, st.module_stack, st.call_frames
        producers = st.producers
        get_ident, getframe, clock = threading.get_ident, sys._getframe, perf_counter_ns
        verdicts = frames._verdicts if frames is not None else {}
        skip = {id(root), *self.skip}

        def bound(t):  # st.bound_producer, inlined
            entry = producers.get(id(t))
            return entry[1] if entry is not None and (entry[0] is t or entry[0]() is t) else -1

        # The hook bodies run once per module call inside every trace: the common cases (tensor
        # arguments, a call made straight from user code) take no loop and no method call.
        def pre_hook(module, args):
            if id(module) in skip or get_ident() != owner:
                return
            parent = stack[-1] if stack else -1
            if len(args) == 1 and type(args[0]) in _TENSORS:
                inputs = (bound(args[0]),)
            else:
                inputs = tuple(bound(t) for t in _tensors_in(args))
            # pre_hook <- inner <- _call_impl <- _wrapped_call_impl <- the caller: a user frame is the
            # answer (FrameClassifier.module_call_frame, its first step inlined).
            wrapped = getframe(3)
            caller = wrapped.f_back if wrapped.f_code is _WRAPPED_CALL else None
            verdict = verdicts.get(id(caller.f_code)) if caller is not None else None
            if verdict == _USER:
                call_frames.append((caller.f_code, caller.f_lasti))
            elif verdict == _SKIP and parent >= 0 and _in_parent_call(caller.f_back, verdicts):
                call_frames.append(call_frames[parent])  # torch code (nn.Sequential) made it: the parent's
            elif frames is not None:
                call_frames.append(frames.module_call_frame(getframe(1), call_frames, parent))
            else:
                call_frames.append((None, None))
            calls.append([module, parent, clock(), None, inputs, ()])
            stack.append(len(calls) - 1)  # after the record: an interrupt between them strands nothing
            if st.markers is not None:
                st.markers.module_enter(len(calls) - 1)
            if progress is not None:
                progress.update()

        # The one place a module call's end is seen: a value returned here would replace the module's
        # output (torch's forward-hook contract), after the call's record is complete.
        def post_hook(module, args, output):
            if id(module) in skip or get_ident() != owner or not stack:
                return
            index = stack.pop()
            call = calls[index]
            call[3] = clock()
            if st.markers is not None:
                st.markers.module_exit(index)
            if output is not None:
                if type(output) in _TENSORS:
                    call[5] = (bound(output),)
                else:
                    call[5] = tuple(bound(t) for t in _tensors_in(output))
            else:
                # Torch runs always-call hooks while an exception unwinds: remember the innermost call.
                raised = sys.exc_info()[1]
                if raised is not None and (st.raised_in is None or st.raised_in[0] is not raised):
                    st.raised_in = (raised, index)

        self._hooks = (pre_hook, post_hook)
        try:
            self.resume()
            return self  # inside the try: an interrupt landing here must not strand the hooks
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def resume(self) -> None:
        """Register the hooks (again, after ``pause``)."""
        pre_hook, post_hook = self._hooks
        if not self._handles:
            self._handles.append(register_module_forward_pre_hook(pre_hook))
            self._handles.append(register_module_forward_hook(post_hook, always_call=True))

    def pause(self) -> None:
        """Remove the hooks while a compiled region runs: Dynamo would trace them."""
        self.__exit__(None, None, None)

    def __exit__(self, *exc):
        remove_handles(self._handles)
        return False
