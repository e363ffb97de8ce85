"""``torch.compile``'d functions a traced forward calls: run compiled, as untraced, with capture out of the way.

Dynamo runs such a function's compiled code, where capture could see only part of it: inductor's generated code
calls a few Python-level torch functions (``extern_kernels.addmm``) and none of its fused kernels, so a trace of
it would hold some of its ops, out of order and without parents.  And with capture's mode on the function-mode
stack and module calls recorded, Dynamo finds the function's guards failed and compiles it again, tracing capture
itself.  So while Dynamo runs a compiled function on the tracing thread, capture steps aside: its mode comes off
the stack, module calls and the shim are suspended (as around a compiled submodule's op), and nothing inside is
recorded, whatever the backend.  The function's result enters the trace with no parent op
(``Trace.unattributed``), and a caveat names the function and the way out.

Dynamo's entry to a compiled function (``compile_wrapper``, which ``torch.compile`` returns) calls
``set_eval_frame_isolate_recompiles_id`` twice, with Dynamo's frame evaluation off both times: as it starts the
function and as it has finished.  While a trace runs, that name in ``torch._dynamo.eval_frame`` is a stand-in
which, called by that entry on a tracing thread, steps capture aside at the first call when capture's mode is on
top of the stack, and back at the second.  A compiled submodule (an ``OptimizedModule``) runs under its own op,
the mode already lifted, so it is left to ``compiled.py``.
"""

from __future__ import annotations

import sys
import threading

import torch

from ..errors import warn_user
from .teardown import release_stranded, until_done

_push = torch._C._push_on_torch_function_stack
_pop = torch._C._pop_torch_function_stack
_depth = torch._C._len_torch_function_stack
_at = torch._C._get_function_stack_at

_EVAL_FRAME = "torch._dynamo.eval_frame"
_HOOK = "set_eval_frame_isolate_recompiles_id"  # called by the entry only, as it starts and as it finishes
_HOP_UTILS = "torch._higher_order_ops.utils"  # where torch.cond, while_loop, map and scan compile their bodies
_ENTRY = "compile_wrapper"  # the function ``torch.compile`` returns, made in ``_TorchDynamoContext.__call__``
_lock = threading.RLock()  # reentrant: a hold stranded by an interrupt is dropped (release_stranded)
_steppers: dict = {}  # tracing thread id -> its trace's CompiledFunctions
_routed: list = []  # [torch's function] while the stand-in stands in for it


def compiled_function_caveat(names) -> tuple:
    """The caveat of a trace whose forward called ``torch.compile``'d functions (``names``), or none."""
    if not names:
        return ()
    text = (f"torch.compile'd functions ({', '.join(names)}) ran compiled, with capture out of the way: none of "
            "their ops or module calls is recorded, and their results enter the trace with no parent op "
            "(Trace.unattributed); to record their interior, call the plain function while tracing (for "
            "generate(), pass disable_compile=True)")
    warn_user(text)
    return (text,)


class CompiledFunctions:
    """Context manager: for the duration of a trace, this thread's compiled functions run with capture stepped
    aside; ``state.compiled_functions`` names those that ran."""

    def __init__(self, state):
        self.state = state
        self.thread = threading.get_ident()
        self.running: list = []  # (entry frame, suspension and mode or None) per compiled function running
        self.outer = None  # the trace this thread was running when this one began (a trace nested in it), if any

    def __enter__(self):
        if _entry[0] is None and _entry_code() is None:  # a torch whose Dynamo enters compiled code otherwise
            return self
        # acquire/release rather than ``with``, as the other parts do: a trace pays for this part whenever Dynamo is
        # imported (transformers imports it), compiled functions or not.
        _lock.acquire()
        try:
            self.outer = _steppers.get(self.thread)
            _steppers[self.thread] = self  # first: whatever happens next, __exit__ takes it out
            if not _routed:
                eval_frame = sys.modules[_EVAL_FRAME]
                _routed.append(getattr(eval_frame, _HOOK))
                setattr(eval_frame, _HOOK, _entered_or_left)
        finally:
            _lock.release()
        return self

    def __exit__(self, *exc):
        until_done(self._release)  # an interrupt landing mid-teardown cannot leave the stand-in in place
        return False

    def _release(self) -> None:
        while self.running:  # an interrupt between the entry's two calls: capture steps back all the same
            self.step_back()
        release_stranded(_lock)
        _lock.acquire()
        try:
            if _steppers.get(self.thread) is self:
                if self.outer is not None:
                    _steppers[self.thread] = self.outer
                else:
                    del _steppers[self.thread]
            if not _steppers and _routed:
                setattr(sys.modules[_EVAL_FRAME], _HOOK, _routed[-1])  # put back before forgetting: see compiled.py
                _routed.pop()
        finally:
            _lock.release()

    def entered_or_left(self, entry_frame) -> None:
        """The entry running in ``entry_frame`` starts its compiled function, or has finished it."""
        if self.running and self.running[-1][0] is entry_frame:
            self.step_back()
        else:
            self.running.append((entry_frame, self.step_aside(entry_frame)))

    def step_aside(self, entry_frame):
        """The suspension of capture entered, and the mode lifted, for the compiled function ``entry_frame``
        runs; None when capture's mode is not on top of the stack (a handler running, a compiled submodule's
        op, another mode pushed by the forward), or for ``torch.cond``'s own compile in eager mode, inside which
        capture records the call as one op (``compiled.py``, ``DynamoCompiles``)."""
        state = self.state
        depth = _depth()
        if state.suspend is None or not depth or getattr(_at(depth - 1), "state", None) is not state:
            return None
        hop_utils = sys.modules.get(_HOP_UTILS)
        if hop_utils is not None and hop_utils._in_hop_compile():
            return None
        name = _function_name(entry_frame.f_locals.get("fn"))
        if name not in state.compiled_functions:
            state.compiled_functions = (*state.compiled_functions, name)
        suspension = state.suspend()
        suspension.__enter__()
        return suspension, _pop()

    def step_back(self) -> None:
        _, aside = self.running.pop()
        if aside is not None:
            suspension, mode = aside
            _push(mode)
            suspension.__exit__(None, None, None)


def _entered_or_left(value):
    """``set_eval_frame_isolate_recompiles_id`` while traces run: torch's, after stepping capture aside or back
    when Dynamo's entry calls it on a tracing thread."""
    stepper = _steppers.get(threading.get_ident())
    if stepper is not None:
        caller = sys._getframe(1)
        if caller.f_code is _entry[0]:
            stepper.entered_or_left(caller)
    return (_routed[0] if _routed else getattr(sys.modules[_EVAL_FRAME], _HOOK))(value)


_entry: list = [None]  # the code of Dynamo's entry, once found


def _entry_code():
    """The code of Dynamo's entry to a compiled function, or None where this torch's does not call the hook."""
    if _entry[0] is None:
        context = getattr(sys.modules.get(_EVAL_FRAME), "_TorchDynamoContext", None)
        consts = context.__call__.__code__.co_consts if context is not None else ()
        code = next((c for c in consts if getattr(c, "co_name", None) == _ENTRY), None)
        if code is not None and _HOOK in code.co_names:
            _entry[0] = code
    return _entry[0]


def _function_name(fn) -> str:
    """How a caveat names a compiled function: its qualified name, or a module's class and ``__call__`` for a
    compiled module call (``torch.compile(model.__call__)``, as transformers' generate() compiles its steps)."""
    fn = getattr(fn, "__wrapped__", fn)
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", None) or type(fn).__name__
    if isinstance(owner, torch.nn.Module):
        return f"{type(owner).__name__}.{'__call__' if name in ('_wrapped_call_impl', '_call_impl') else name}"
    return getattr(fn, "__qualname__", None) or name
