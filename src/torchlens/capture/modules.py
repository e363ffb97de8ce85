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

from .state import CaptureState


def _tensors_in(obj, out: list, depth: int = 0) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 4:
        if isinstance(obj, (tuple, list)):
            for item in obj:
                _tensors_in(item, out, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                _tensors_in(item, out, depth + 1)
    return out


class ModuleCallTracker:
    """Context manager that records module calls into ``state.module_calls``."""

    def __init__(self, state: CaptureState, root, frames=None, skip=()):
        self.state = state
        self.root = root
        self.frames = frames  # a FrameClassifier: each call's user frame is found once, here
        self.skip = skip  # ids of modules whose calls are not module calls (see capture/compiled.py)
        self._handles = []
        self._hooks = None

    def __enter__(self):
        st, root, owner, frames = self.state, self.root, threading.get_ident(), self.frames
        skip = {id(root), *self.skip}

        def pre_hook(module, args):
            if id(module) in skip or threading.get_ident() != owner:
                return
            inputs = tuple(st.bound_producer(t) for t in _tensors_in(args, []))
            parent = st.module_stack[-1] if st.module_stack else -1
            if frames is not None:
                st.call_frames.append(frames.module_call_frame(sys._getframe(1), st.call_frames, parent))
            else:
                st.call_frames.append((None, None))
            st.module_calls.append([module, parent, perf_counter_ns(), None, inputs, ()])
            st.module_stack.append(len(st.module_calls) - 1)
            if st.markers is not None:
                st.markers.module_enter(len(st.module_calls) - 1)

        def post_hook(module, args, output):
            if id(module) in skip or threading.get_ident() != owner or not st.module_stack:
                return
            index = st.module_stack.pop()
            call = st.module_calls[index]
            call[3] = perf_counter_ns()
            if st.markers is not None:
                st.markers.module_exit(index)
            if output is not None:
                call[5] = tuple(st.bound_producer(t) for t in _tensors_in(output, []))
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
        # An interrupt landing mid-teardown is re-raised only once every hook is gone
        # (RemovableHandle.remove is idempotent).
        interrupted = None
        while self._handles:
            try:
                self._handles[-1].remove()
                self._handles.pop()
            except BaseException as e:  # noqa: BLE001
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted
        return False
