"""Finding the user's line for each op, cheaply.

Walking ``f_back`` from the handler, frames inside torch and inside torchlens's capture package are
skipped; the first other frame is the user's.  The verdict per code object is cached, so the walk is a
few dict lookups.  Reaching the trace driver's own frame means no user code called the op (a bare
``nn.Sequential``): the op then has no source line, and reports fall back to its module call site.
"""

from __future__ import annotations

import os
import weakref

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_CAPTURE_DIR = os.path.dirname(__file__) + os.sep
# torch's dispatcher: its frames are how an op reached us, never where it was called.
_DISPATCHERS = (_TORCH_DIR + "overrides.py",)
_USER, _SKIP, _STOP, _DISPATCH, _BOUNDARY = 0, 1, 2, 3, 4

# Verdicts per code object, shared by every trace.  Keyed by ``id(code)``: hashing a code object
# hashes its bytecode (about a microsecond), an id costs nothing.  So that no id is reused while its verdict
# is cached, a code's verdict is forgotten as the code dies (a weak reference's callback, run before its memory
# can be reused), and while any trace runs every code classified is held (``_HELD``, let go as the last
# running trace ends): the compiled handler remembers the verdicts it read in a trace by the code's address.
# A code made at run time (a ``torch.fx`` module's forward) is thus freed with its model.  A module call's
# ``_call_impl`` frame is a boundary: above it, every op of that call has the same user frame, found once when
# the call starts (``module_call_frame``).
_CALL_IMPL = torch.nn.Module._call_impl.__code__
_VERDICTS: dict = {id(_CALL_IMPL): _BOUNDARY}
_KEPT: list = [_CALL_IMPL]  # codes whose verdicts are set, not classified: held for good
_HELD: list = []  # the codes classified since the last running trace ended
_WATCHES: dict = {}  # id(code) -> the weak reference that forgets its verdict as it dies
VERDICTS, USER = _VERDICTS, _USER  # for the capture handler's inlined check of an already-known user frame
# ``_call_impl``'s nested ``inner``, which calls ``forward`` when hooks are installed: the handler's
# inlined check of an op called straight from a torch module's forward (``FrameClassifier.locate``'s
# walk for that case, two frames long).
SKIP, DISPATCH, CALL_IMPL = _SKIP, _DISPATCH, _CALL_IMPL
STOP, BOUNDARY = _STOP, _BOUNDARY  # and the rest of the walk, for the compiled handler's copy of it
CALL_IMPL_INNER = next((c for c in _CALL_IMPL.co_consts if getattr(c, "co_name", None) == "inner"), None)


def _classify(code) -> int:
    name = code.co_filename
    if name.startswith(_CAPTURE_DIR) or name.startswith(_DISPATCHERS):
        verdict = _DISPATCH
    elif name.startswith(_TORCH_DIR):
        verdict = _SKIP
    else:
        verdict = _USER
    key = id(code)
    _HELD.append(code)
    _WATCHES[key] = weakref.ref(code, lambda _, key=key, forget=_forget: forget(key))
    _VERDICTS[key] = verdict
    return verdict


def _forget(key: int, verdicts: dict = _VERDICTS, watches: dict = _WATCHES) -> None:
    # The dicts are bound here: at interpreter exit a code may die after this module's globals are gone.
    verdicts.pop(key, None)
    watches.pop(key, None)


def release_classified() -> None:
    """Let go of the codes classified while traces ran (called as the last running trace ends): each keeps
    its verdict until it dies."""
    _HELD.clear()


def outside_torch(frame):
    """The first frame from ``frame`` up that is neither torch's nor code made by ``torch.fx`` (the graph Dynamo
    compiled a higher-order op's call into), or ``frame`` when there is none."""
    start = frame
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_filename.startswith("<eval_with_key>")):
        frame = frame.f_back
    return frame if frame is not None else start


def verdict_of(code) -> int:
    verdict = _VERDICTS.get(id(code))
    return _classify(code) if verdict is None else verdict


class FrameClassifier:
    def __init__(self, stop_codes=()):
        self._verdicts = _VERDICTS
        for code in stop_codes:
            if id(code) not in _VERDICTS:
                _KEPT.append(code)
            _VERDICTS[id(code)] = _STOP

    def _classify(self, code) -> int:
        return _classify(code)

    def verdict_of(self, code) -> int:
        return verdict_of(code)

    def is_user(self, code) -> bool:
        return self.verdict_of(code) == _USER

    def locate(self, frame, func=None, call_frames=None, module_call: int = -1):
        """``(site, code, line)`` for an op called from ``frame``'s caller chain.

        ``site`` is ``(code, instruction offset)`` of the nearest frame that called the op (torch's own
        module code included; the frame of a Python-level torch function ``func`` itself, which only
        dispatched to capture, excluded): it identifies the call site, so the same site run again is a
        loop.
        ``code, offset`` are the nearest user frame's code and instruction offset (``line_of`` turns them
        into a line number, lazily), or ``None, None`` when only torch code called it.  The walk stops at
        the innermost module call's boundary, whose user frame ``call_frames[module_call]`` holds.
        """
        verdicts = self._verdicts
        site = None
        own_code = getattr(func, "__code__", None)
        while frame is not None:
            code = frame.f_code
            verdict = verdicts.get(id(code))  # verdict_of, inlined: this loop runs for every op
            if verdict is None:
                verdict = self._classify(code)
            if verdict == _USER:
                offset = frame.f_lasti
                reached = user_site(frame, code, offset)  # torch's line keeps the user lines that reached it
                return (reached if site is None else (site[0], site[1], reached)), code, offset
            if verdict == _STOP:
                return site, None, None
            if verdict == _BOUNDARY and module_call >= 0:
                user = call_frames[module_call]
                return site or (user if user[0] is not None else None), user[0], user[1]
            if verdict == _SKIP and site is None and code is not own_code:
                site = (code, frame.f_lasti)
            frame = frame.f_back
        return site, None, None

    def module_call_frame(self, frame, call_frames, parent: int):
        """``(code, offset)`` of the user frame that makes a module call, walking up from ``frame`` (the
        call has not started yet).

        Stops at the first user frame, or at the parent call's boundary, whose answer is already known."""
        verdicts = self._verdicts
        while frame is not None:
            code = frame.f_code
            verdict = verdicts.get(id(code))  # verdict_of, inlined: this loop runs for every module call
            if verdict is None:
                verdict = self._classify(code)
            if verdict == _USER:
                return frame.f_code, frame.f_lasti
            if verdict == _STOP:
                break
            if verdict == _BOUNDARY and parent >= 0:
                return call_frames[parent]
            frame = frame.f_back
        return None, None


def called_by_module_call(frame) -> bool:
    """Whether ``frame`` is torch's module call machinery itself calling ``forward`` (``_call_impl``, or
    its ``inner`` when hooks are installed), the boundary ``FrameClassifier.locate`` stops at."""
    if frame is None:
        return False
    code = frame.f_code
    if code is CALL_IMPL_INNER:
        frame = frame.f_back
        code = frame.f_code if frame is not None else None
    return code is _CALL_IMPL


def user_site(frame, code, offset):
    """The site of an op called from the user frame ``frame`` (running ``code`` at ``offset``):
    ``(code, offset)``, followed by the site of the user line that called its function, and so on up to the
    module call (or the trace).  A helper function called from two lines (``rotate_half(q)`` and
    ``rotate_half(k)``; a custom ``autograd.Function``, a checkpointed function) then makes two sites, while
    one called again by a loop repeats one.  An op called straight from a module's forward costs one frame
    read more (its caller is the module call).  Each depth of a function calling itself is the same site."""
    back = _user_caller(frame, code)
    if back is None:
        return (code, offset)  # the common case: called from a module's forward, or from the trace
    callers = []  # walked, not recursed: the model's own stack may be deep
    while back is not None:
        callers.append((back.f_code, back.f_lasti))
        back = _user_caller(back, back.f_code)
    site = callers.pop()
    while callers:
        site = callers.pop() + (site,)
    return (code, offset, site)


def _user_caller(frame, code):
    """The user frame that called ``frame``'s function (running ``code``), through torch's own frames (the
    ``apply`` of an ``autograd.Function``, ``checkpoint``, a ``torch.no_grad()`` decorator) and ``code``'s
    own (a recursion); None when the function was called by a module call, the trace or torchlens."""
    back = frame.f_back
    while back is not None:
        caller = back.f_code
        if caller is not code:
            verdict = verdict_of(caller)
            if verdict == _USER:
                return back
            if verdict != _SKIP:
                return None
        back = back.f_back
    return None


def dispatched_site(frame, func, call_frames, module_call: int, locate):
    """``locate``'s answer (``FrameClassifier.locate``) for a call that torch's dispatcher (``frame``)
    handed over.  For a Python-level torch function (``F.relu``) whose own frame is next, neither frame
    can be the answer: the walk starts at the function's caller, and is skipped when that caller is user
    code or a torch module's forward called by its module call."""
    own = frame.f_back
    if own is None or own.f_code is not getattr(func, "__code__", None) or _VERDICTS.get(id(own.f_code)) != _SKIP:
        return locate(frame, func, call_frames, module_call)
    caller = own.f_back
    if caller is not None:
        code = caller.f_code
        verdict = _VERDICTS.get(id(code))
        if verdict == _USER:
            line = caller.f_lasti
            return user_site(caller, code, line), code, line
        if verdict == _SKIP and module_call >= 0 and called_by_module_call(caller.f_back):
            user_code, user_line = call_frames[module_call]
            return (code, caller.f_lasti), user_code, user_line
    return locate(caller, func, call_frames, module_call)
