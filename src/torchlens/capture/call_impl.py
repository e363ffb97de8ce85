"""Seeing every module call by redirecting ``nn.Module._call_impl`` while a trace runs.

``Module.__call__`` is ``_wrapped_call_impl``, which looks ``self._call_impl`` up at every call.  While
a trace runs, that function's code is swapped for a relay (``_relay``: one frame that calls what the
site's ``slot`` holds), and the call itself, with the module's own hooks, jit tracing and everything
else ``_call_impl`` does, runs untouched inside it, in a copy of the function that keeps torch's code.
Swapping the code of the function, not the class attribute, leaves every type alone: writing an
attribute of ``nn.Module`` would invalidate the attribute caches of ``nn.Module`` and of every subclass
(each later lookup on a module, in the trace and after it, misses once: about 5 us on a one-op model,
more with every module class a model has).  The function stays the same object, so Dynamo, ``inspect``
and any reference taken before see the same function, whose code is torch's again once no trace runs.
Global forward hooks would see the same calls but move every one of them onto torch's slow hook path.

The redirection is process-wide and shared by the threads that trace.  Each trace brings a recorder
per redirected function: ``recorder(module, *args, **kwargs)``, which records the calls of its own thread
and hands any other thread's straight to torch's code.  While one trace runs, its recorder is in the
slot; while several do, a dispatcher picks the calling thread's.  A class that defines its own
``_call_impl`` (``torch.compiler.disable`` on a module class does) is not reached through ``nn.Module``'s,
so its own is redirected the same way for the traces whose model holds one; one whose code cannot be
swapped (a closure, as ``super()`` or a wrapper makes, or another signature) has its class attribute
replaced instead.  Each redirected function (a ``Site``) is restored when no trace needs it, and every
step is idempotent, so teardown can be retried until it finishes (``until_done``): an interrupt cannot
strand a redirection.
"""

from __future__ import annotations

import sys
import threading
import types

import torch

from .teardown import release_stranded, until_done

_ATTRIBUTE = "_call_impl"
MARK = "_torchlens_replaces"  # set on what is put in a class attribute here: the ``_call_impl`` it wraps
_lock = threading.RLock()  # reentrant: a hold stranded by an interrupt on a ``with`` exit line is dropped
_MODULE_ONLY = (torch.nn.Module,)  # the owners of a trace whose model's classes keep nn.Module's _call_impl
_sites: dict = {}  # id(owner) -> the Site replacing owner's _call_impl: nn.Module's stays, others while held
_watching: dict = {}  # id(Replacement) -> ids of the modules threads that do not trace called while it is held


def _dispatcher(impl, recorders: dict):
    """The replacement while several threads trace: the calling thread's recorder, or ``impl``."""
    get_recorder, get_ident = recorders.get, threading.get_ident

    def _call_impl(self, *args, **kwargs):
        recorder = get_recorder(get_ident())
        if recorder is None:  # a thread that records no call here
            note_other_thread(self)
            return impl(self, *args, **kwargs)
        return recorder(self, *args, **kwargs)

    setattr(_call_impl, MARK, impl)
    return _call_impl


def note_other_thread(module) -> None:
    """Note a call of ``module`` made by a thread that is not recording (a thread pool's worker running an expert)
    for every trace running: each records its own thread's calls only, and says after the forward which of its
    model's modules ran elsewhere.  A thread that traces (a second trace of the model, or one paused for a compiled
    region) is left out: its calls are its own trace's.  Called on that other thread only, never the tracing one."""
    if _watching and not held_by(threading.get_ident()):
        for seen in list(_watching.values()):
            seen.add(id(module))  # ids alone: no module is held; a model's, alive all trace long, keeps its id


DISPATCHER_CODE = _dispatcher(None, {}).__code__  # a recorder called by it finds the caller one frame up

_SLOT_MARK = 0x7E1A7C0DE  # a constant of the relay's code, replaced by each site's slot (a ``Slot``)


class Slot:
    """Where a site's relay finds what receives the calls.  An object hashed by identity, not a list:
    it is a constant of the relay's code, and a code object hashes its constants (profilers and
    Dynamo put code objects in sets and dicts)."""

    __slots__ = ("target",)

    def __init__(self, target):
        self.target = target


def _relay(self, *args, **kwargs):
    # The code a redirected ``_call_impl`` runs: what its site's slot holds (a recorder, the dispatcher, or
    # torch's code).  The slot is a constant of each site's copy of this code (nothing is looked up by name
    # in torch's module globals); a frame that read it as the last trace ended runs torch's code.
    slot = 0x7E1A7C0DE  # _SLOT_MARK, written out: a constant of the code, not a name looked up
    return slot.target(self, *args, **kwargs)


def _swappable(function) -> bool:
    """Whether ``function``'s code can be the relay's: a plain function shaped ``(self, *args, **kwargs)``
    with no closure and no defaults (torch's ``_call_impl`` is)."""
    if type(function) is not types.FunctionType or function.__closure__ is not None \
            or function.__defaults__ is not None or function.__kwdefaults__ is not None:
        return False
    code, relay = function.__code__, _relay.__code__
    return (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags & _SHAPE) == \
        (relay.co_argcount, relay.co_posonlyargcount, relay.co_kwonlyargcount, relay.co_flags & _SHAPE)


_SHAPE = 0x04 | 0x08  # CO_VARARGS | CO_VARKEYWORDS


class Site:
    """One class whose ``_call_impl`` is redirected, and the traces that hold it.

    ``impl`` runs torch's (or the class's) code: a copy of the function when its code is swapped, the
    function itself when the class attribute is replaced.  ``relays``: the code of the frames between
    ``_wrapped_call_impl`` and a recorder (the relay, the dispatcher), which a recorder looks past."""

    def __init__(self, owner):
        self.owner = owner
        self.original = original = vars(owner)[_ATTRIBUTE]
        self.threads: set = set()  # threads whose trace holds this site, paused or not
        self.recorders: dict = {}  # thread id -> its trace's recorder, while that trace records
        if _swappable(original) and _SLOT_MARK in _relay.__code__.co_consts:
            self.code = original.__code__
            impl = types.FunctionType(self.code, original.__globals__, original.__name__, None, None)
            impl.__qualname__ = original.__qualname__
            self.slot = Slot(impl)
            consts = tuple(self.slot if type(c) is int and c == _SLOT_MARK else c for c in _relay.__code__.co_consts)
            # co_qualname too: tracebacks name the function as torch does
            names = {"co_name": self.code.co_name, "co_qualname": self.code.co_qualname}
            self.relay = _relay.__code__.replace(co_consts=consts, **names)
        else:  # the class attribute is replaced instead
            self.code = self.slot = self.relay = None
            impl = original
        self.impl = impl
        self.dispatcher = _dispatcher(impl, self.recorders)
        self.relays = (DISPATCHER_CODE, self.relay)  # in the order a recorder meets them (None: no relay)
        # The recorders' codes (None: a compiled recorder, which has none) whose frames, with this site's relays,
        # Dynamo runs uncompiled: a process may trace on both capture paths, whose recorders differ.
        self.unseen_by_dynamo: set = set()

    def changed(self) -> bool:
        """Whether the class now holds another ``_call_impl`` (or the function other code) than this site
        found: asked only while no trace holds the site, when it must hold what it found."""
        # getattr, not vars(): no mapping proxy made per trace; the owner's own attribute comes first in
        # its MRO, and one removed from it leaves an inherited one, which is not ``original`` either.
        original = getattr(self.owner, _ATTRIBUTE, None)
        return original is not self.original or (self.code is not None and original.__code__ is not self.code)

    def install(self, target) -> None:
        """Make ``target`` (a recorder or the dispatcher) receive the calls of the class's ``_call_impl``."""
        if self.slot is not None:
            self.slot.target = target  # first: the relay must find it once in place
            self.original.__code__ = self.relay
        elif vars(self.owner).get(_ATTRIBUTE) is not target:
            setattr(self.owner, _ATTRIBUTE, target)

    def update(self) -> None:
        """Put in place what the recording traces need: torch's own, the one recorder, or the dispatcher."""
        recorders = self.recorders
        if not recorders:
            self.restore()
        elif len(recorders) == 1:
            self.install(next(iter(recorders.values())))
        else:
            self.install(self.dispatcher)

    def restore(self) -> None:
        """Put torch's own ``_call_impl`` (or the class's) back in place, and in Dynamo's sight."""
        if self.slot is not None:
            self.original.__code__ = self.code  # first: no call reaches the relay from here on
            self.slot.target = self.impl
            return
        original = self.original
        setattr(self.owner, _ATTRIBUTE, original)  # unconditionally: cheaper than reading it first
        if "torch._dynamo" in sys.modules:  # the usual case: Dynamo never imported, nothing kept
            _unsee_in_dynamo(original)

    def receiver(self):
        """What a call of the class's ``_call_impl`` reaches now (a recorder, the dispatcher or torch's)."""
        if self.slot is not None:
            return self.slot.target if self.original.__code__ is self.relay else self.original
        return vars(self.owner).get(_ATTRIBUTE)


def owners_overriding(module_types) -> list:
    """The classes, among the bases of ``module_types``, whose own ``_call_impl`` a call of one of those
    types reaches instead of ``nn.Module``'s (rare: ``torch.compiler.disable`` on a module class)."""
    owners, base = [], torch.nn.Module._call_impl
    for cls in module_types:
        if cls._call_impl is base:  # the common case: one attribute lookup
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
    """Context manager: while it is entered, this thread's calls of ``nn.Module`` and of the classes in
    ``owners`` go through ``make_recorder(impl, relays)`` (one recorder per redirected function; see
    ``Site`` for its two arguments).  ``elsewhere`` (a set, or None) gets the ids of the modules other threads call
    meanwhile (``note_other_thread``)."""

    __slots__ = ("make_recorder", "owners", "held", "_recorders", "thread", "elsewhere")

    def __init__(self, make_recorder, owners=(), elsewhere=None):
        self.make_recorder = make_recorder
        self.elsewhere = elsewhere
        self.thread = threading.get_ident()  # the tracing thread (a forked child releases it from its own)
        self.owners = (torch.nn.Module, *owners) if owners else _MODULE_ONLY
        self.held: list = []  # ids of the sites this trace holds
        self._recorders: dict = {}  # id(owner) -> this trace's recorder there

    def __enter__(self):
        try:
            self.acquire()
            return self  # inside the try: an interrupt landing here must not strand the replacement
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def acquire(self) -> None:
        tid = self.thread
        # acquire/release rather than ``with``: half the cost; a hold an interrupt strands between them is
        # dropped by ``release_all`` (as one stranded on a ``with`` exit line would be).
        _lock.acquire()
        try:
            if self.elsewhere is not None:
                _watching[id(self)] = self.elsewhere
            for owner in self.owners:
                site = _sites.get(id(owner))
                if site is None or not site.threads and site.changed():
                    site = _sites[id(owner)] = Site(owner)  # first use, or the class has been given another
                self.held.append(id(owner))  # first: whatever happens next, __exit__ undoes it
                site.threads.add(tid)
                recorder = self._recorders[id(owner)] = self.make_recorder(site.impl, site.relays)
                code = recorder.__code__ if type(recorder) is types.FunctionType else None
                if code not in site.unseen_by_dynamo and _EVAL_FRAME in sys.modules \
                        and _unseen_by_dynamo((*site.relays, code)):
                    site.unseen_by_dynamo.add(code)
                if site.slot is None:  # a replaced class attribute: Dynamo may keep it (_unsee_in_dynamo)
                    setattr(recorder, MARK, site.original)
                recorders = site.recorders
                recorders[tid] = recorder
                if len(recorders) != 1:
                    site.update()
                elif site.slot is not None:  # the one trace recording: its recorder receives the calls itself
                    site.slot.target = recorder  # Site.install, inlined: first, the relay must find it in place
                    site.original.__code__ = site.relay
                else:
                    site.install(recorder)
        finally:
            _lock.release()

    def __exit__(self, *exc):
        until_done(self.release_all)  # an interrupt landing mid-teardown cannot strand the replacement
        return False

    def release_all(self) -> None:
        release_stranded(_lock)
        tid = self.thread
        _lock.acquire()
        try:
            _watching.pop(id(self), None)
            while self.held:
                key = self.held[-1]
                site = _sites.get(key)
                if site is not None:
                    site.recorders.pop(tid, None)
                    site.threads.discard(tid)
                    if site.recorders:
                        site.update()
                    elif site.slot is not None:  # no trace records: torch's own goes back (Site.restore, inlined)
                        site.original.__code__ = site.code  # first: no call reaches the relay from here on
                        site.slot.target = site.impl
                    else:
                        site.restore()
                    if not site.threads and site.owner is not torch.nn.Module:  # its original is back
                        _sites.pop(key, None)  # and the class is not held alive here
                self.held.pop()
        finally:
            _lock.release()

    def recording(self) -> bool:
        """Whether this thread's calls are recorded now: not paused, not released."""
        tid = threading.get_ident()
        return any(tid in site.recorders for site in (_sites.get(key) for key in self.held) if site is not None)

    def pause(self) -> None:
        """Stop recording this thread's calls, and take the recorder out of place (a compiled region
        runs meanwhile: Dynamo would trace it); torch's own is back unless another trace records."""
        tid = threading.get_ident()
        with _lock:
            for key in self.held:
                site = _sites.get(key)
                if site is not None:
                    site.recorders.pop(tid, None)
                    site.update()

    def resume(self) -> None:
        tid = threading.get_ident()
        with _lock:
            for key in self.held:  # empty once torn down: nothing comes back
                site = _sites.get(key)
                if site is not None and tid in site.threads:
                    site.recorders[tid] = self._recorders[key]
                    site.update()


_EVAL_FRAME = "torch._dynamo.eval_frame"  # imported by the first torch.compile; never imported here


def _unseen_by_dynamo(codes) -> bool:
    """Have Dynamo run frames of ``codes`` (a relay, the dispatcher, a Python recorder) without compiling
    them, and compile the frames they call as usual.  The swapped ``_call_impl`` is process-wide: a
    thread that is not tracing may call a ``torch.compile``'d module meanwhile, whose compiled frame
    would otherwise be the relay (Dynamo cannot trace its slot and raises); skipped, the frame it calls
    has torch's own code, so that thread compiles, and reuses, exactly what it would untraced."""
    skip = getattr(sys.modules.get(_EVAL_FRAME), "skip_code", None)
    if skip is None:
        return False
    for code in codes:
        if code is not None:
            skip(code)
    return True


def held_by(tid: int) -> bool:
    """Whether any replaced attribute is still held, or recorded into, by thread ``tid``'s trace."""
    return any(tid in site.threads or tid in site.recorders for site in list(_sites.values()))


def installed() -> list:
    """Every ``_call_impl`` now redirected by a trace (for tests and the teardown check)."""
    return [f"{site.owner.__qualname__}._call_impl" for site in list(_sites.values())
            if vars(site.owner).get(_ATTRIBUTE) is not site.original
            or (site.code is not None and site.original.__code__ is not site.code)]


def receiver(owner=torch.nn.Module):
    """What a call of ``owner``'s ``_call_impl`` reaches now: a trace's recorder, the dispatcher, or the
    function itself (no trace redirects it)."""
    site = _sites.get(id(owner))
    return site.receiver() if site is not None else vars(owner).get(_ATTRIBUTE)


def _unsee_in_dynamo(original) -> None:
    """Dynamo keeps ``nn.Module._call_impl`` as found when it was imported, to recognise unpatched
    modules; imported while a trace ran, it kept a replacement: give it the original."""
    for name in ("torch._dynamo.utils", "torch._dynamo.variables.nn_module"):
        namespace = sys.modules.get(name)
        kept = getattr(namespace, "unpatched_nn_module_call_impl", None)
        if kept is not None and getattr(kept, MARK, None) is original:
            namespace.unpatched_nn_module_call_impl = original
