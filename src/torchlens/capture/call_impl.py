"""Seeing every module call by replacing ``nn.Module._call_impl`` while a trace runs.

``Module.__call__`` is ``_wrapped_call_impl``, which looks ``self._call_impl`` up at every call.
Replacing that class attribute (a plain dict entry, unlike ``__call__``, a type slot that every subclass
would be updated for) puts one Python function around every module call, and the call itself, with
the module's own hooks, jit tracing and everything else ``_call_impl`` does, runs untouched inside it.
Global forward hooks would see the same calls but move every one of them onto torch's slow hook path.

The replacement is process-wide, shared by every thread that traces: ``_recorders`` maps each tracing
thread to its trace's recorder, and a call from any other thread goes straight to the original after
one dict lookup.  A class that defines its own ``_call_impl`` (``torch.compiler.disable`` on a module
class does) is not reached through ``nn.Module``'s, so its attribute is replaced the same way for the
traces whose model holds one.  Each replaced attribute (a ``Site``) remembers the threads using it and
is restored when the last of them is done.  Every step is idempotent, so teardown can be retried until
it finishes (``until_done``) and an interrupt cannot strand a replacement.
"""

from __future__ import annotations

import sys
import threading
import types

import torch

from .teardown import until_done

_ATTRIBUTE = "_call_impl"
_lock = threading.RLock()  # reentrant: a hold stranded by an interrupt on a ``with`` exit line is dropped
_recorders: dict = {}  # thread id -> that thread's recorder: f(impl, module, args, kwargs)
_sites: dict = {}  # id(owner) -> the Site replacing owner's _call_impl, while any thread uses it


def _dispatcher(impl):
    """The replacement for one ``_call_impl``: this thread's recorder around ``impl``, or ``impl``."""
    get_recorder, get_ident = _recorders.get, threading.get_ident

    def _call_impl(self, *args, **kwargs):
        recorder = get_recorder(get_ident())
        if recorder is None:
            return impl(self, *args, **kwargs)
        return recorder(impl, self, args, kwargs)

    _call_impl.__wrapped__ = impl
    return _call_impl


_REPLACEMENT_CODE = _dispatcher(None).__code__


def is_replacement(value) -> bool:
    """Whether ``value`` is one of the replacements made here (they all share one code object)."""
    return getattr(value, "__code__", None) is _REPLACEMENT_CODE


class Site:
    """One class whose ``_call_impl`` attribute is replaced, and the threads that need it replaced."""

    def __init__(self, owner):
        self.owner = owner
        self.original = vars(owner)[_ATTRIBUTE]
        self.replacement = _dispatcher(self.original)
        self.threads: set = set()

    def install(self) -> None:
        if vars(self.owner).get(_ATTRIBUTE) is not self.replacement:
            setattr(self.owner, _ATTRIBUTE, self.replacement)

    def restore(self) -> None:
        if vars(self.owner).get(_ATTRIBUTE) is self.replacement:
            setattr(self.owner, _ATTRIBUTE, self.original)
        _unsee_in_dynamo(self.replacement, self.original)


def owners_overriding(module_types) -> list:
    """The classes, among the bases of ``module_types``, whose own ``_call_impl`` a call of one of those
    types reaches instead of ``nn.Module``'s (rare: ``torch.compiler.disable`` on a module class)."""
    owners = []
    for cls in module_types:
        if cls._call_impl is torch.nn.Module._call_impl:  # the common case: one attribute lookup
            continue
        owner = next(k for k in cls.__mro__ if _ATTRIBUTE in vars(k))
        if owner is not torch.nn.Module and owner not in owners:
            owners.append(owner)
    return owners


def unsupported_overrides(owners) -> list:
    """Those of ``owners`` whose ``_call_impl`` is not a plain function (a descriptor of another kind):
    calls of their modules cannot be seen and are not module calls."""
    return [o for o in owners if not isinstance(vars(o)[_ATTRIBUTE], types.FunctionType)]


class Replacement:
    """Context manager: while it is entered, this thread's module calls (of ``nn.Module`` and of the
    classes in ``owners``) go through ``recorder(impl, module, args, kwargs)``."""

    def __init__(self, recorder, owners=()):
        self.recorder = recorder
        self.owners = (torch.nn.Module, *owners)
        self.held: list = []  # ids of the sites this thread is counted in
        self.paused = False

    def __enter__(self):
        try:
            self._acquire()
            return self  # inside the try: an interrupt landing here must not strand the replacement
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _acquire(self) -> None:
        tid = threading.get_ident()
        with _lock:
            for owner in self.owners:
                site = _sites.get(id(owner))
                if site is None:
                    site = _sites[id(owner)] = Site(owner)
                self.held.append(id(owner))  # before counting: whatever happens next, __exit__ undoes it
                site.threads.add(tid)
                site.install()
            _recorders[tid] = self.recorder

    def __exit__(self, *exc):
        until_done(self._release_all)  # an interrupt landing mid-teardown cannot strand the replacement
        return False

    def _release_all(self) -> None:
        while _lock._is_owned():  # stranded by an interrupt on a ``with _lock:`` exit line
            _lock.release()
        tid = threading.get_ident()
        with _lock:
            _recorders.pop(tid, None)
            while self.held:
                site = _sites.get(self.held[-1])
                if site is not None:
                    site.threads.discard(tid)
                    if not site.threads:  # the last trace using it: the class gets its own back
                        site.restore()
                        _sites.pop(self.held[-1], None)
                self.held.pop()

    def pause(self) -> None:
        """Stop recording this thread's calls, and put the originals back unless another thread's trace
        still needs them (a compiled region runs meanwhile: Dynamo would trace the replacement)."""
        tid = threading.get_ident()
        with _lock:
            _recorders.pop(tid, None)
            for key in self.held:
                site = _sites.get(key)
                if site is not None and site.threads == {tid}:
                    site.restore()

    def resume(self) -> None:
        tid = threading.get_ident()
        with _lock:
            if not self.held:
                return  # already torn down
            for key in self.held:
                site = _sites.get(key)
                if site is not None:
                    site.install()
            _recorders[tid] = self.recorder


def installed() -> list:
    """Descriptions of every replacement now in place (for tests and the teardown check)."""
    return [f"{site.owner.__qualname__}._call_impl" for site in list(_sites.values())
            if vars(site.owner).get(_ATTRIBUTE) is site.replacement]


def _unsee_in_dynamo(replacement, original) -> None:
    """Dynamo keeps ``nn.Module._call_impl`` as found when it was imported, to recognise unpatched
    modules; imported while a trace ran, it kept the replacement: give it the original."""
    for name in ("torch._dynamo.utils", "torch._dynamo.variables.nn_module"):
        namespace = sys.modules.get(name)
        if namespace is not None and getattr(namespace, "unpatched_nn_module_call_impl", None) is replacement:
            namespace.unpatched_nn_module_call_impl = original
