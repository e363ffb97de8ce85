"""What every extra run must leave as it found it: the global random number generators (``RngState``),
the Python attributes of a module tree (``ModuleAttributes``), and both with the buffers' values and the
parameters' versions (``ForwardState``), or with the values of every tensor a module tree holds, for
``tl.validate``'s untraced reference run on the model itself (``ModelState``, ``RunState``); and what a
backward torchlens runs itself (``kernel_profile``'s, ``tl.extract``'s) must leave: the parameters'
``.grad`` (``grads_set_aside``), and that of every other leaf their backward reaches (``backward_leaves``).

Every run torchlens makes besides the traced one (``tl.validate``'s untraced reference, the metadata
pass that resolves intervention labels, the patching tables' runs, ``flops_vs_dispatch``) must leave the
generators as it found them, so that the traced forward draws what one untraced forward would.  Besides
torch's CPU and CUDA generators that means Python's ``random`` and NumPy's global ``numpy.random``:
transformers' speech models (wav2vec2, HuBERT, WavLM) draw their training-time time masks from NumPy.
NumPy is read only when something already imported it.

A forward may also change its modules' Python attributes: a flag set by the first call (RWKV rescales
its weights once in eval mode and notes it), a cache built on first use.  A run made only to look at
the forward must put them back, or the run after it would take another path.

Parameters are not copied before a run (that would double a large model's memory), so a parameter a
forward writes in place is found only after the run, by its version counter.  Once found, it is
remembered for that model (weakly), and every later ``ForwardState`` of the model copies those
parameters and puts them back: an ``nn.Embedding`` with ``max_norm`` renormalizes its weight in every
forward, and the first extra run on it can only be refused.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
import random
import sys
import threading
import types
import weakref
from collections import OrderedDict, deque

import torch
from torch.nn.parameter import is_lazy

from ..errors import first_few
from ..record.layouts import version_of
from .teardown import restore_torch_function_state, torch_function_state, until_done
from ..tree import without_values


def module_run_by(fn):
    """The module a callable runs: the callable itself when it is one, a bound method's module
    (``m.generate``), either behind ``functools.partial`` or behind a wrapper that says what it wraps
    (``__wrapped__``, set by ``functools.wraps``: accelerate replaces a module's ``forward`` with such a
    wrapper of the bound method); None for any other callable (a lambda)."""
    for _ in range(100):  # a chain of wrappers is short; a cycle of them must not hang the trace
        if isinstance(fn, torch.nn.Module):
            return fn
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            return owner
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:
            fn = wrapped
        elif isinstance(fn, functools.partial):
            fn = fn.func
        else:
            return None
    return None


class GeneratorStates:
    """The states of ``torch.Generator`` objects (a module's own), each noted once, when first given: restorable."""

    def __init__(self):
        self.states: dict = {}  # id(generator) -> (generator, its state when first given)

    def keep(self, generators) -> None:
        for g in generators:
            self.states.setdefault(id(g), (g, g.get_state()))

    def restore(self) -> None:
        for g, state in self.states.values():
            g.set_state(state)


class RngState:
    """The global generators (torch's CPU and every initialized CUDA device, Python's ``random``, NumPy's
    global ``numpy.random`` when imported), and the ``torch.Generator`` objects given to ``keep``, restorable."""

    def __init__(self):
        self.kept = GeneratorStates()
        self.cpu_rng = torch.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda_rng = torch.cuda.get_rng_state_all() if cuda else None
        self.python_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None

    def keep(self, generators) -> None:
        """Also restore these generators (a module's own ``torch.Generator``) to their states now."""
        self.kept.keep(generators)

    def restore(self) -> None:
        self.kept.restore()
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            sys.modules["numpy"].random.set_state(self.numpy_rng)

    def moved(self) -> bool:
        """Whether any generator drew numbers since this state was taken."""
        return bool(self.moved_generators())

    def moved_generators(self) -> list:
        """The names of the generators that drew numbers since this state was taken, for a refusal to name."""
        moved = []
        if not torch.equal(torch.get_rng_state(), self.cpu_rng):
            moved.append("torch's CPU generator")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # CUDA started since (no state kept): its generators may have been used
            if self.cuda_rng is None or any(not torch.equal(a, b)
                                            for a, b in zip(torch.cuda.get_rng_state_all(), self.cuda_rng)):
                moved.append("torch's CUDA generators")
        if random.getstate() != self.python_rng:
            moved.append("Python's random")
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy_rng is not None and _numpy_moved(numpy, self.numpy_rng):
            moved.append("NumPy's numpy.random")
        return moved


def _numpy_moved(numpy, before) -> bool:
    # ('MT19937', key array, position, has_gauss, cached_gaussian): the key array compares element-wise.
    now = numpy.random.get_state()
    return now[0] != before[0] or not numpy.array_equal(now[1], before[1]) or now[2:] != before[2:]


def held_generators(module) -> list:
    """The ``torch.Generator`` objects a module holds as attributes (``self.g = torch.Generator()``): a run a trace
    makes besides the user's must leave them where they were, as it does the global ones."""
    return _held(module, torch.Generator)


def held_tensors(module) -> list:
    """The tensors a module holds as plain attributes, neither parameters nor buffers (``self.steps =
    torch.zeros(())``, a list of cached tensors): a forward that writes one in place (``self.steps += 1``) must
    find it as it was after a run a trace makes besides the user's."""
    buffers = {id(b) for b in module._buffers.values()}
    # (A nested tensor is left out: torch has no in-place copy into one to put it back with.)
    return [t for t in _held(module, torch.Tensor)
            if not (isinstance(t, torch.nn.Parameter) or id(t) in buffers or t.is_nested)]


_TABLES = frozenset(("_parameters", "_buffers", "_modules"))  # a module's own tables: kept by their own rules


def _held(module, kind) -> list:
    """The ``kind`` objects among a module's attributes, directly or in a plain container: one level deep, as
    ``ModuleAttributes`` notes them."""
    found = []
    for name, value in vars(module).items():
        if name in _TABLES:
            continue
        attributes = _object_attributes(value)
        members = value.values() if isinstance(value, dict) else \
            value if isinstance(value, (list, tuple, deque)) else \
            attributes.values() if attributes is not None else (value,)
        found.extend(member for member in members if isinstance(member, kind))
    return found


# Whose namespace is no state of the model's: a class, a Python module, a function.  (A torch module is the model's
# own, kept by its own rules; a tensor's attributes are not its value.)
_NO_STATE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
             torch.nn.Module, torch.Tensor)


def _object_attributes(value):
    """The attributes of a plain object a module holds (``self.stats = RunningStats()``), which a forward may write
    as a module's own (``self.stats.count += 1``); None for anything else."""
    if isinstance(value, _NO_STATE) or type(value) in _PLAIN_CONTAINERS:
        return None
    attributes = getattr(value, "__dict__", None)  # None without one: a number, slots, a type of C's (a lock)
    return attributes if type(attributes) is dict else None


class ParametrizationCache:
    """The weights ``torch.nn.utils.parametrize.cached()`` keeps while its block lasts: a dict global to torch,
    keyed by module and name, that a forward fills at its first read of each parametrized weight.  A run besides
    the user's inside such a block must leave it as it found it, or the run after it would read the weights from
    it without computing them: another path than the forward the user asked for takes."""

    def __init__(self):
        parametrize = sys.modules.get("torch.nn.utils.parametrize")
        enabled = getattr(parametrize, "_cache_enabled", 0)
        self.entries = list(parametrize._cache.items()) if enabled else None

    def restore(self) -> None:
        cache = getattr(sys.modules.get("torch.nn.utils.parametrize"), "_cache", None)
        if self.entries is not None and isinstance(cache, dict):
            _put_members_back(cache, self.entries)


class ModuleAttributes:
    """Every module's Python attributes (``vars(module)``: flags, counters, caches, and the parameter,
    buffer, submodule and hook tables), restorable; a container's members, and a plain object's attributes, are
    noted one level deep, so membership is restored, not the values inside them.  Tensor values are restored as
    objects, not as contents.

    The containers themselves are put back, not copies of them: a hook's ``RemovableHandle`` removes the
    hook from the very dict it was registered in, and the model index's structure check holds the very
    tables it saw.  A plain container whose members changed gets them back in place; one left as it was
    is not written (a dict keeps its version).  Another kind (a subclass with its own rules for changing
    it) is put back as a copy, as a run cannot be trusted to leave it alone."""

    def __init__(self, modules):
        self.saved: list = []
        for m in modules:
            self.add(m)

    def add(self, module) -> None:
        self.saved.append((module, {k: _noted(v) for k, v in vars(module).items()}))

    def restore(self) -> None:
        until_done(self._restore_all)  # an interrupt landing meanwhile is re-raised once every module is back

    def _restore_all(self) -> None:
        """Idempotent.  Each module gets its saved attributes first and loses the others after: an interrupt
        between the two steps leaves no module without its parameter, buffer and submodule tables."""
        for m, attributes in self.saved:
            state = vars(m)
            for k, (value, members, copied) in attributes.items():
                if members is not None:  # a container's members, or a plain object's attributes
                    _put_members_back(value if type(value) in _PLAIN_CONTAINERS else vars(value), members)
                elif copied is not None:  # another kind of container: a copy of it as it was
                    value = copy.copy(copied)
                if state.get(k, _ABSENT) is not value:
                    state[k] = value
            for added in [k for k in state if k not in attributes]:
                del state[added]


_ABSENT = object()
# A deque too: a module keeping its last few states in one (deque(maxlen=n)) appends to it in every forward.
_PLAIN_CONTAINERS = (dict, OrderedDict, list, set, deque)


def _noted(value) -> tuple:
    """``(value, members, copy)``: a plain container's members (``_members``), or a copy of any other
    container, or a plain object's attributes (as a dict's members), or none of them."""
    if type(value) in _PLAIN_CONTAINERS:
        return value, _members(value), None
    if isinstance(value, (list, dict, set)):
        return value, None, copy.copy(value)
    attributes = _object_attributes(value)
    return value, None if attributes is None else _members(attributes), None


def _members(container) -> list:
    """A plain container's members, in its order: a dict's ``(key, value)`` entries, a list's or set's items."""
    return list(container.items()) if isinstance(container, dict) else list(container)


def _put_members_back(container, members: list) -> None:
    """Give ``container`` back ``members`` (from ``_members``), in place, only where they differ."""
    if not _same_members(container, members):
        container.clear()
        if isinstance(container, (list, deque)):  # within a deque's maxlen: it held them all
            container.extend(members)
        else:  # a dict from its entries, a set from its items
            container.update(members)


def _same_members(container, members: list) -> bool:
    """Whether ``container`` holds exactly ``members``: values by identity (they may be tensors), a dict's
    keys by equality, in order."""
    now = _members(container)
    if len(now) != len(members):
        return False
    if not isinstance(container, dict):
        return all(map(operator.is_, now, members))
    try:
        return all(a[1] is b[1] and (a[0] is b[0] or bool(a[0] == b[0])) for a, b in zip(now, members))
    except Exception:  # noqa: BLE001 - a key that cannot be compared: taken as changed
        return False


class ForwardState:
    """What a forward may change on a model that a run made besides the user's must put back: the global
    generators and those the modules hold, the buffers' values (running statistics), the modules' Python
    attributes and the values of the tensors among them (a step counter written in place), the weights
    ``parametrize.cached()`` keeps, and the values of the parameters the model's forward is known to write in
    place (``owner``: the model).  Other
    parameters are not copied: their version counters tell whether a forward wrote one in place, which
    cannot be put back (``written_params``), and which the next state of the model then copies."""

    def __init__(self, modules, params, buffers, owner=None):
        self.rng = RngState()
        self.rng.keep(g for m in modules for g in held_generators(m))
        self.attributes = ModuleAttributes(modules)
        self.buffers = [(b, b.detach().clone()) for b in buffers]
        self.held = {id(t): (t, t.detach().clone()) for m in modules for t in held_tensors(m)}
        self.parametrized = ParametrizationCache()
        self.params = list(params)  # [(address, Parameter)]
        self.lazy = {id(p) for _, p in self.params if is_lazy(p)}  # a lazy module's, not yet made
        self.versions = [version_of(p) for _, p in self.params]  # None: an inference tensor
        self.owner = owner
        known = _known_written(owner)
        renormalized = _renormalized(modules)
        self.kept = [(p, p.detach().clone()) for address, p in params if address in known or id(p) in renormalized] \
            if known or renormalized else []

    def add(self, module) -> None:
        """Also keep ``module``'s own state (its attributes, buffers and parameters, not its children's): a
        module met while a run goes on (``FirstCalls``), before anything of it runs."""
        self.attributes.add(module)
        self.rng.keep(held_generators(module))
        self.buffers.extend((b, b.detach().clone()) for b in module.buffers(recurse=False))
        self.held.update((id(t), (t, t.detach().clone())) for t in held_tensors(module) if id(t) not in self.held)
        params = [(f"{type(module).__name__}.{name}", p) for name, p in module.named_parameters(recurse=False)]
        self.params.extend(params)
        self.versions.extend(version_of(p) for _, p in params)
        self.lazy.update(id(p) for _, p in params if is_lazy(p))
        renormalized = _renormalized([module])
        self.kept.extend((p, p.detach().clone()) for _, p in params if id(p) in renormalized)

    @classmethod
    def of(cls, model) -> "ForwardState":
        """The state of ``model`` (a module, or a bound method of one; anything else has only the RNG)."""
        owner = module_run_by(model)
        if owner is None:
            return cls([], [], [])
        return cls(list(owner.modules()), list(owner.named_parameters()), list(owner.buffers()), owner)

    def written_params(self) -> list:
        """The addresses of the parameters written in place since this state was taken that it cannot put
        back; the model's next state copies them."""
        kept = {id(p) for p, _ in self.kept}
        written = [address for (address, p), version in zip(self.params, self.versions)
                   if version_of(p) != version and id(p) not in kept]
        if written and self.owner is not None:
            try:
                _written[self.owner] = _known_written(self.owner) | frozenset(written)
            except TypeError:  # a module class that is not hashable: nothing is remembered
                pass
        return written

    def written_cause(self, written: list, examples: str = "") -> tuple:
        """``(why, lazy)``: why the parameters ``written_params`` named changed, for a refusal, and whether it was
        lazy modules' first forward (``nn.LazyLinear`` makes and initializes its parameters there, once), which
        one forward of the model before the run avoids; ``examples`` follows the addresses of other writes."""
        lazy = [address for address, p in self.params if id(p) in self.lazy and not is_lazy(p)]
        if lazy:
            return (f"the forward initialized the parameters of lazy modules ({first_few(lazy)}: a lazy module, "
                    "such as nn.LazyLinear, makes and initializes them on its first forward)"), True
        return f"the forward writes parameters in place ({first_few(written)}{examples})", False

    def restore(self) -> None:
        self.rng.restore()
        self.attributes.restore()
        for tensor, value in [*self.buffers, *self.kept, *self.held.values()]:
            put_back(tensor, value)
        self.parametrized.restore()


class FirstCalls:
    """Calls ``add(module)`` for each module a run calls, just before its first call, for as long as the block
    lasts: a callable traced without ``root=`` (``lambda x: model(x).logits``) names no model, so the modules
    whose state an extra run must put back (BatchNorm's running statistics in training, a cache, a flag) are
    known only by running it (``ForwardState.add``; validation's ``ModelState.add``).  A global forward
    pre-hook, removed on exit; it runs before the module's own pre-hooks, and with torch function handling
    off, so that a capture running meanwhile records nothing of it.  It notes the calls of the thread that
    entered it only: another thread's model is not this run's to put back."""

    def __init__(self, add):
        self.add = add
        self.seen: set = set()
        self.handle = None
        self.thread = None

    def __enter__(self) -> "FirstCalls":
        self.thread, self.torch_functions = threading.get_ident(), torch_function_state()
        try:
            self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._called)
            return self
        except BaseException:  # interrupted before the block began, whose exit would then never run
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> bool:
        until_done(self._release)
        return False

    def _release(self) -> None:
        """Idempotent.  Also puts back the thread's torch-function state: an interrupt on the exit line of the
        ``with`` in ``_called`` skips its exit, leaving torch functions off."""
        if self.handle is not None:
            self.handle.remove()
        restore_torch_function_state(self.torch_functions)

    def _called(self, module, args) -> None:
        if id(module) in self.seen or threading.get_ident() != self.thread:
            return
        self.seen.add(id(module))
        with torch._C.DisableTorchFunction():
            self.add(module)


class ModelState:
    """Everything a forward can change on a module tree, restorable: parameter and buffer values
    (non-persistent buffers too), tensors and generators held in plain attributes (or in a plain container
    among them), and every Python attribute (counters, caches, flags; containers are copied one level deep)."""

    def __init__(self, model):
        modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
        self.attributes = ModuleAttributes(modules)
        self._kept: dict = {}  # id(tensor) -> (tensor, its value now)
        self._generators = GeneratorStates()
        self.parametrized = ParametrizationCache()
        for m in modules:
            self._keep_tensors(m)

    def add(self, module) -> None:
        """Also keep ``module``'s own state: a module met while a run goes on (``capture.restore.FirstCalls``)."""
        self.attributes.add(module)
        self._keep_tensors(module)

    def _keep_tensors(self, m) -> None:
        for t in [*m._parameters.values(), *m._buffers.values(), *held_tensors(m)]:
            if isinstance(t, torch.Tensor) and id(t) not in self._kept:
                self._kept[id(t)] = (t, t.detach().clone())
        self._generators.keep(held_generators(m))

    def restore(self) -> None:
        self.attributes.restore()
        for t, value in self._kept.values():
            put_back(t, value)
        self._generators.restore()
        self.parametrized.restore()

    def tensors_changed(self) -> bool:
        """Whether a run since this state was taken changed the value of a tensor it keeps (a running statistic)."""
        return any(_differs(t, value) for t, value in self._kept.values())


class RunState:
    """The global generators and everything ``ModelState`` restores (training flags and a cache built on
    first use among the Python attributes): what two runs must share to be comparable.  Runs go inside
    ``watching`` (a callable naming no model has its modules noted there as they are first called)."""

    def __init__(self, model, root=None):
        self.rng = RngState()
        self.model, self.watching = model_state(model, root)

    def restore(self) -> None:
        self.rng.restore()
        self.model.restore()


def model_state(model, root=None) -> tuple:
    """``(ModelState, context)`` for runs of ``model`` that must be put back: the modules of ``root=``, or of the
    module the callable runs (``module_run_by``); for a callable naming no model (a lambda), each module the
    runs call, noted inside the context just before its first call."""
    owner = root if root is not None else module_run_by(model)
    if isinstance(owner, torch.nn.Module):
        return ModelState(owner), contextlib.nullcontext()
    state = ModelState(None)
    return state, FirstCalls(state.add)


def put_back(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` back into ``tensor`` if it differs: only then, since a copy bumps the version counter,
    which a trace's replay reads as a parameter changed since the trace.  A tensor the forward resized (an
    observer's empty ``min_val`` given a value per channel, a buffer grown by ``resize_``) gets its old shape
    back with its values, where a copy would broadcast into the new shape, or fail."""
    if not _differs(tensor, value):
        return
    # An inference tensor is written only inside inference mode; leaving it (mode False) turns gradients
    # back on, hence no_grad inside.
    with torch.inference_mode(tensor.is_inference()), torch.no_grad():
        if _reshaped(tensor, value):
            tensor.data = value.clone()
        else:
            tensor.copy_(value)


def _reshaped(tensor: torch.Tensor, value: torch.Tensor) -> bool:
    return not tensor.is_nested and (tensor.shape != value.shape or tensor.dtype != value.dtype)  # (nested: no .shape)


def _differs(tensor: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``tensor`` no longer holds ``value``.  ``torch.equal`` takes strided tensors only: a sparse or other
    layout counts as changed whatever it holds.  A meta or fake tensor holds no values, so never differs."""
    if _reshaped(tensor, value):
        return True
    return not without_values(tensor) and (tensor.layout != torch.strided or not torch.equal(tensor, value))


def parameters_read(trace, module=None) -> list:
    """The parameters a backward through ``trace`` may write ``.grad`` into, each once: ``module``'s (the
    model the traced callable runs, if any) and those the recorded calls read (a lambda traced without
    ``root=`` names no model, but its forward still reads the model's weights)."""
    found = {}
    if isinstance(module, torch.nn.Module):
        found.update((id(p), p) for p in module.parameters())
    for call in trace.calls:
        found.update((id(p), p) for _, p in call.params)
    return list(found.values())


def backward_leaves(trace, module, output) -> list:
    """Every tensor a backward from ``output`` (a result of ``trace``'s forward) may write ``.grad`` into, each once:
    the parameters (``parameters_read``) and the other leaves it reaches (``_leaves_reached``), for a backward
    torchlens runs itself to set aside (``grads_set_aside``)."""
    found = {id(t): t for t in parameters_read(trace, module)}
    found.update((id(t), t) for t in _leaves_reached(output))
    return list(found.values())


def _leaves_reached(output) -> list:
    """The leaf tensors a backward from ``output`` accumulates ``.grad`` into, each once, found on the graph (their
    ``AccumulateGrad`` nodes): besides the parameters, an input that requires grad and a tensor the forward read
    from elsewhere (a learnt prompt, a steering vector), which an optimizer may hold as it holds parameters."""
    from ..tree import tensor_leaves

    found, seen = {}, set()
    nodes = []
    for _, t in tensor_leaves(output):
        if t.grad_fn is not None:
            nodes.append(t.grad_fn)
        elif t.requires_grad:  # returned as it is: a leaf itself
            found[id(t)] = t
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # only AccumulateGrad holds one
        if isinstance(leaf, torch.Tensor):
            found[id(leaf)] = leaf
        nodes.extend(child for child, _ in node.next_functions)
    return list(found.values())


@contextlib.contextmanager
def grads_set_aside(params):
    """Run a backward torchlens makes for a report or an extraction so that ``params`` end with the ``.grad``
    they had: the same tensors, with the same values (an optimizer step after it reads the user's own)."""
    kept = [p.grad for p in params]
    try:
        # Taken off first: autograd adds into an existing ``.grad`` in place, so a kept reference alone
        # would be put back holding this backward's share too.
        for p in params:
            p.grad = None
        yield
    finally:
        for p, g in zip(params, kept):
            p.grad = g


# model -> the addresses of the parameters its forward was seen writing in place (see the module docstring)
_written: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _known_written(owner) -> frozenset:
    try:
        return _written.get(owner, frozenset()) if owner is not None else frozenset()
    except TypeError:  # a module class that is not hashable
        return frozenset()


def _renormalized(modules) -> set:
    """The ids of the weights that ``nn.Embedding``/``nn.EmbeddingBag`` modules with ``max_norm`` renormalize
    in place in every forward: known writes, kept from the first run on."""
    return {id(m.weight) for m in modules
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None}
