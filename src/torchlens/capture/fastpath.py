"""Two torch globals answered by capture while any trace runs, installed together.

Keeping torch's fused fast paths on.  An active ``TorchFunctionMode`` makes
``torch.overrides.has_torch_function`` answer True, and eval-mode ``nn.MultiheadAttention`` /
``nn.TransformerEncoderLayer`` then leave their fused kernels for a decomposed path with different ops
and slightly different numbers.  Those modules look the function up on ``torch.overrides`` at call
time, so while any trace runs we answer it as if the capturing thread's own mode were absent.  The
shim is reference-counted across threads and removed when the last trace ends; threads that are not
tracing get torch's own answer.

Skipping torch's Python dispatcher.  Torch functions written in Python (``F.relu``, ``F.layer_norm``)
reach the capture mode through ``handle_torch_function``; the shim also puts capture's shorter one in
place (``dispatch.py``), which likewise answers only the tracing thread's calls.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.overrides

from . import dispatch
from .teardown import release_stranded, until_done

# Reentrant, so that a hold left by an interrupt on a ``with _lock:`` exit line can be found and dropped.
_lock = threading.RLock()
_users = 0
_original = None
_local = dispatch.capturing  # .mode: this thread's capture mode while its trace runs


def _has_torch_function_ignoring_capture(args) -> bool:
    mode = _local.mode
    if mode is None or torch._C._len_torch_function_stack() == 0:
        return _original(args)
    # Answer with our mode popped, exactly as torch would without it.
    top = torch._C._pop_torch_function_stack()
    try:
        if top is not mode:
            return True  # another mode is active above ours: torch would say True
        if sys._getframe(1).f_code is _OPERATOR_CALL and sys._getframe(1).f_locals.get("self") in OPERATORS_WHOLE:
            return True  # a higher-order op recorded whole: handed to capture as one op
        return _original(args)
    finally:
        torch._C._push_on_torch_function_stack(top)


def _operators_whole() -> frozenset:
    """Higher-order ops (``torch.cond``, ``torch.while_loop``, ``map``, ``scan``) that build a schema of their
    bodies before they run: in a forward with gradients on, torch traces every body, a branch that will not
    run included, with fake tensors.  Capture records each call of one as one op, its interior unseen, rather
    than record those calls as the model's.  They ask ``has_torch_function`` before they dispatch."""
    try:
        from torch._higher_order_ops.utils import _has_gen_schema
    except ImportError:  # an older torch (2.6): its higher-order ops build no schema, so trace no body early
        return frozenset()
    # torch 2.10 has no _supports_training_input_mutation: no op was exempt, each with a schema built it.
    return frozenset(op for op in torch._ops._higher_order_ops.values()
                     if _has_gen_schema(op) and not getattr(op, "_supports_training_input_mutation", False))


OPERATORS_WHOLE = _operators_whole()
_OPERATOR_CALL = torch._ops.HigherOrderOperator.__call__.__code__


class FastPathShim:
    """Context manager: install the shim for this thread's capture mode."""

    def __init__(self, mode):
        self.mode = mode
        self._counted = False

    def __enter__(self):
        global _users, _original
        try:
            # acquire/release rather than ``with``: half the cost; a hold an interrupt strands between
            # them is dropped by ``_release_all``.
            _lock.acquire()
            try:
                if torch.overrides.has_torch_function is not _has_torch_function_ignoring_capture:
                    if _users == 0:  # otherwise another trace has paused it (see pause): reinstall only
                        _original = torch.overrides.has_torch_function
                    torch.overrides.has_torch_function = _has_torch_function_ignoring_capture
                    dispatch.install()  # the two are in place together (removed together below)
                _users, self._counted = _users + 1, True  # one statement: no interrupt between them
            finally:
                _lock.release()
            _local.mode = self.mode
            return self  # inside the try: an interrupt landing here must not strand the shim
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            self._release_all()
        except BaseException:  # interrupted: finish (until_done), then let the interrupt through
            until_done(self._release_all)
            raise
        return False

    def _release_all(self) -> None:
        """Drop this trace's count (and the shim with the last one), whatever holds an interrupt left."""
        global _users
        release_stranded(_lock)
        _local.mode = None
        _lock.acquire()
        try:
            if self._counted:
                _users, self._counted = _users - 1, False
            if _users == 0:
                if torch.overrides.has_torch_function is _has_torch_function_ignoring_capture:
                    # _original stays set: another thread may have looked the shim up just before this.
                    torch.overrides.has_torch_function = _original
                dispatch.uninstall()
        finally:
            _lock.release()

    def pause(self) -> None:
        """Put torch's own function back while a compiled region runs (Dynamo would trace the shim),
        unless another thread's trace still needs the shim."""
        with _lock:
            if _users == 1:
                if torch.overrides.has_torch_function is _has_torch_function_ignoring_capture:
                    torch.overrides.has_torch_function = _original
                dispatch.uninstall()

    def resume(self) -> None:
        with _lock:
            if self._counted:
                if torch.overrides.has_torch_function is not _has_torch_function_ignoring_capture:
                    torch.overrides.has_torch_function = _has_torch_function_ignoring_capture
                dispatch.install()
