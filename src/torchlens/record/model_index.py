"""The address of every module, parameter and buffer of a model by object, walked once per model.

Every part of a trace that needs an address (buffer sources during capture, module records, parameter
records, the save policy) reads this index instead of walking ``named_modules`` again.  ``index_of``
keeps one index per model and hands it to later traces while the model's structure is unchanged
(``Structure``): tracing the same model again walks nothing it already knows.  A model whose modules are
named by a ``named_modules`` of its own is walked on every trace (``_names_its_own``).
"""

from __future__ import annotations

import functools
import gc
import sys
import types
from collections import OrderedDict
from itertools import chain
from typing import NamedTuple
from operator import is_, itemgetter
from weakref import ref as weakref

import torch

from ..errors import first_few, listed

WRAPPED = "_orig_mod"  # where a torch.compile wrapper (an OptimizedModule) holds the module it compiles


def traced_address(name: str) -> str:
    """A module's address as a trace gives it: without the step a torch.compile wrapper adds inside it
    (``head._orig_mod.0`` is ``head.0``; the wrapper keeps ``head``)."""
    return ".".join(part for part in name.split(".") if part != WRAPPED) if WRAPPED in name else name


QUANTIZED_MODULES = "torch.ao.nn.quantized"  # where torch's quantized module classes live
_PACKED_PREFIX, _PACKED_SUFFIX = "__torch__.torch.classes.quantized.", "PackedParamsBase"
_PACKED_CELL = "__torch__.torch.classes.rnn.CellParamsBase"  # a quantized LSTM's or GRU's, one per layer


# How the caveat of a trace whose model holds packed weights begins (capture/session.py writes it, the module
# table reads it, also from a loaded trace).
PACKED_WEIGHTS_CAVEAT = "quantized modules hold packed weights"


def holds_packed_weights(trace) -> bool:
    """Whether ``trace``'s model held packed weights as it ran (its caveat says so, in a loaded trace too)."""
    return any(caveat.startswith(PACKED_WEIGHTS_CAVEAT) for caveat in trace.caveats)


def is_packed_weight(value) -> bool:
    """Whether ``value`` is a quantized kernel's packed weight (``LinearPackedParamsBase``,
    ``Conv2dPackedParamsBase`` ..., a quantized RNN's ``CellParamsBase``): a TorchScript object holding the
    weights and biases, not tensors."""
    if not isinstance(value, torch.ScriptObject):
        return False
    name = value._type().qualified_name()
    return name.startswith(_PACKED_PREFIX) and name.endswith(_PACKED_SUFFIX) or name == _PACKED_CELL


class BatchCounters(NamedTuple):
    """The batch counters of a model's ``nn.BatchNorm*`` layers (``ModelIndex.batch_counters``)."""

    slot_of: dict  # id(running statistic) -> the position of its layer's counter in ``counters``
    counters: tuple  # each layer's num_batches_tracked


class ModelIndex:
    def __init__(self, model):
        self.module_addresses: dict = {}  # id(module) -> [every address it is reachable under]
        self.submodules: dict = {}  # walk address -> module, for every module object but the root
        self._addressed: dict = {}  # first user-facing address -> module (a compiled wrapper keeps its address)
        self.params: list = []  # (address, Parameter), each parameter once, at its first address
        self.param_addresses: dict = {}  # id(Parameter) -> address
        self.buffers: dict = {}  # id(buffer) -> (buffer, address)
        self._param_names: dict = {}  # id(module) -> (module, [parameter name, ...])
        self._of_type: dict = {}  # module class -> the submodules of exactly that class (see ``of_type``)
        self._root = None  # a weak reference: a cached index must not keep its model alive
        self._module_types = None  # every distinct module class, the root's included (on first use)
        self.wrappers = False  # whether a module holds an ``_orig_mod`` (a torch.compile wrapper does)
        self.params_by_module = None  # record.finalize: id(module) -> (module, [its parameters]), on first trace
        self.param_layouts = None  # record.finalize: each parameter's (shape, dtype) as the last trace ended
        self._batch_counters = None  # BatchCounters, on first use
        if isinstance(model, torch.nn.Module):
            self._root = weakref(model)
            self._walk(model)

    def _walk(self, model) -> None:
        for raw, module in model.named_modules(remove_duplicate=False):
            name = traced_address(raw)  # inside a torch.compile'd submodule: the address it was given
            seen = self.module_addresses.get(id(module))
            if seen is not None:  # an alias: same object, another address
                seen.append(name or "self")
                continue
            self.module_addresses[id(module)] = [name or "self"]
            if WRAPPED in module._modules:
                self.wrappers = True
            if raw:
                self.submodules[raw] = module  # every module object, wrappers too: the structure check
                self._addressed.setdefault(name, module)
            prefix = f"{name}." if name else ""
            names = []  # as the walk saw them: the module records of a trace name what its index knew
            for key, p in module._parameters.items():
                if p is not None:
                    names.append(key)
                    if id(p) not in self.param_addresses:
                        self.param_addresses[id(p)] = prefix + key
                        self.params.append((prefix + key, p))
            if raw:  # not the root, which the index holds only weakly
                self._param_names[id(module)] = (module, names)
            for key, b in module._buffers.items():
                if b is not None and id(b) not in self.buffers:
                    self.buffers[id(b)] = (b, prefix + key)

    def tensor_named(self, t) -> tuple | None:
        """``(kind, address)`` of ``t`` when it is one of the model's parameters or buffers, else None."""
        address = self.param_addresses.get(id(t))
        if address is not None:
            return "parameter", address
        buffer = self.buffers.get(id(t))
        return ("buffer", buffer[1]) if buffer is not None and buffer[0] is t else None

    def module_types(self) -> tuple:
        """Every distinct class of the model's modules, the root's first: capture checks which of them
        replace ``nn.Module._call_impl`` themselves (``capture/call_impl.py``)."""
        if self._module_types is None:
            root = self._root() if self._root is not None else None
            modules = chain((root,) if root is not None else (), self.submodules.values())
            self._module_types = tuple(dict.fromkeys(map(type, modules)))
        return self._module_types

    @property
    def root(self):
        """The model, while it is alive (None for a callable's index)."""
        return self._root() if self._root is not None else None

    def all_modules(self) -> list:
        """Every module object of the model once, the root first (wrappers included)."""
        root = self.root
        return ([root] if root is not None else []) + list(self.submodules.values())

    @property
    def modules(self) -> dict:
        """First address -> module, the root (address ``""``) included."""
        root = self._root() if self._root is not None else None
        return {"": root, **self._addressed} if root is not None else dict(self._addressed)

    def modules_and_aliases(self) -> dict:
        """``modules``, and each module's further addresses after its first (one module registered under two
        names answers to both): a fresh dict per call, from a table listed once per index."""
        root = self._root() if self._root is not None else None
        return {"": root, **self._aliased} if root is not None else dict(self._aliased)

    @functools.cached_property
    def _aliased(self) -> dict:
        """Every address of every module but the root -> the module (the root is held only weakly)."""
        aliased = dict(self._addressed)
        for module in list(aliased.values()):
            for alias in self.module_addresses.get(id(module), ())[1:]:
                aliased.setdefault(alias, module)
        return aliased

    def attributes_holding(self, tensors) -> list:
        """``address.name`` of each tensor of ``tensors`` that a module of the model holds as a plain
        attribute, not as a parameter or buffer (so a trace does not know it as either), and
        ``address.name['key']`` (or ``[i]``) of one held in a dict, list or tuple attribute: the cache an
        earlier forward filled (LeViT keeps its attention biases per device so).  Walks every module's
        attributes: called only for a trace that read tensors from outside it."""
        wanted = {id(t): t for t in tensors}
        found = []
        for address, module in self.modules.items():
            for name, value in vars(module).items():
                where = f"{address}.{name}" if address else name
                if value is not None and wanted.get(id(value)) is value:
                    found.append(where)
                elif isinstance(value, (dict, list, tuple)) and value and not name.startswith("_"):
                    items = value.items() if isinstance(value, dict) else enumerate(value)
                    found += [f"{where}[{key!r}]" for key, held in items if wanted.get(id(held)) is held]
        return found

    def batch_counters(self) -> BatchCounters:
        """The batch counter (``num_batches_tracked``) of each ``nn.BatchNorm*`` of the model that keeps
        running statistics, and which of them counts for each statistic: its forward adds one to the counter
        whenever its kernel updates the statistics (training mode), a write that moves the statistics' own
        version counters no more than the kernel's does.  Modules that count otherwise (a subclass with its
        own forward, ``InstanceNorm``) are left out."""
        if self._batch_counters is None:
            from torch.nn.modules.batchnorm import SyncBatchNorm, _BatchNorm

            counting = (_BatchNorm.forward, SyncBatchNorm.forward)
            norms = [m for m in self.submodules.values()
                     if isinstance(m, _BatchNorm) and type(m).forward in counting and m.track_running_stats
                     and m.num_batches_tracked is not None]
            self._batch_counters = BatchCounters(
                {id(stat): k for k, m in enumerate(norms) for stat in (m.running_mean, m.running_var)
                 if stat is not None},
                tuple(m.num_batches_tracked for m in norms))
        return self._batch_counters

    def of_type(self, cls) -> list:
        """The submodules whose class is exactly ``cls`` (the root excluded), found once per index: an
        index lives only while the model's structure is unchanged (``Structure``)."""
        found = self._of_type.get(cls)
        if found is None:
            found = self._of_type[cls] = [m for m in self.submodules.values() if type(m) is cls]
        return found

    def param_names_of(self, module) -> list:
        """Names of the module's parameters (a fresh list): as the walk saw them for a module of the
        index, whose structure check covers every ``_parameters`` dict; read now for any other."""
        names = self._param_names.get(id(module))
        if names is None or names[0] is not module:
            return [k for k, p in module._parameters.items() if p is not None]
        return list(names[1])

    @functools.cached_property
    def param_at(self) -> dict:
        """``address -> Parameter``, as the walk saw them."""
        return dict(self.params)

    @functools.cached_property
    def param_objects(self) -> tuple:
        """``(parameters, their ids)``, in ``params`` order: listed once per index, read per trace (the
        versions replay checks are read when each trace ends)."""
        params = [p for _, p in self.params]
        return params, [id(p) for p in params]

    @functools.cached_property
    def script_modules(self) -> tuple:
        """The addresses of the TorchScript modules (``torch.jit.script``) not inside another one: their
        ops run in TorchScript's interpreter, out of capture's sight."""
        found = []
        for address, module in self.modules.items():
            if isinstance(module, torch.jit.ScriptModule) and \
                    not any(address.startswith(f"{outer}.") or not outer for outer in found):
                found.append(address or "self")
        return tuple(found)

    @functools.cached_property
    def packed_weights(self) -> tuple:
        """``address.attribute`` of each packed weight the model's modules hold (a quantized module's
        ``_packed_params``): not tensors, so no op lists them among its ``params``.  Looked for only in a model
        with quantized module classes."""
        if not any(t.__module__.startswith(QUANTIZED_MODULES) for t in self.module_types()):
            return ()
        return tuple(f"{address}.{name}" if address else name for address, module in self.modules.items()
                     for name, value in vars(module).items() if is_packed_weight(value))

    def unwalked(self, modules) -> set:
        """The ids of those of ``modules`` whose parameter names the walk did not keep (the root's, or a
        module outside the model): a trace reads theirs when it ends."""
        return set(map(id, modules)).difference(self._param_names)


def scripted_outer(address: str, modules: dict) -> str | None:
    """The address of the TorchScript module that is ``address`` or holds it, or None: such a module's
    ops run in TorchScript's interpreter, so no op of a trace makes its output or anything inside it."""
    parts = address.split(".")
    for n in range(1, len(parts) + 1):
        outer = ".".join(parts[:n])
        if isinstance(modules.get(outer), torch.jit.ScriptModule):
            return outer
    return None


def container_note(address: str, module) -> str:
    """For a module with no forward of its own (``nn.ModuleList``, ``nn.ModuleDict``), which is never called and
    so has no output: ``"is a ModuleList, a container ... (a.0, a.1, a.2, ...)"``, naming the modules it holds;
    '' for any other module."""
    if module is None or type(module).forward is not torch.nn.Module.forward or "forward" in vars(module):
        return ""
    held = [f"{address}.{name}" for name, _ in module.named_children()]
    if not held:  # a holder of parameters only: torch.export's unlifted module keeps the inlined modules' so
        return (f"is a {type(module).__name__} with no forward and no submodules (as torch.export's unlifted "
                "modules keep the parameters of the modules they inlined): it is never called, so it has no output; "
                "name the ops that read its parameters (each op's params lists them) by their labels")
    shown = listed(held, 3, ", ...")
    return (f"is a {type(module).__name__}, a container with no forward of its own: it is never called, so it has "
            f"no output; name the modules it holds ({shown})")


# Where the ops that read a parameter or a buffer are listed, as the refusals of its name say.
READERS_LISTED = {"parameter": "log.params[k].op_labels", "buffer": "log.buffers[k].readers"}


def tensor_address_note(model, address: str, where: str) -> str:
    """For a name that is no op, layer or module but a parameter's or a buffer's address (``fc.weight``): what it
    is and what ``where`` (``save=``, ``intervene=``) takes instead: ops are recorded, the tensors they
    read are not, so the name would otherwise be refused as unknown, or as a near miss of a module's name."""
    if not isinstance(model, torch.nn.Module) or not address:
        return ""
    for kind, named in (("parameter", model.named_parameters), ("buffer", model.named_buffers)):
        if any(name == address for name, _ in named(remove_duplicate=False)):
            listing = READERS_LISTED[kind]
            own = "; its own gradient, on a trace taken with grads=, is log.params[k].grad" if kind == "parameter" \
                else ""
            return (f" ({address} is a {kind} of the model, which no op of the forward makes: {where} takes ops; "
                    f"name the ops that read it, which {listing} lists{own})")
    return ""


def refuse_module_object(value, modules: dict, where: str) -> None:
    """Refuse a class or a module object given ``where`` a name or a predicate over ops is taken (``save=``,
    ``grads=``, an intervention site).  Both are callable, so either would be called on each op as a predicate:
    a class builds an object of every op (``nn.ReLU(op)``: all selected, every op ablated), a module runs its
    forward on an op.  ``modules`` (address -> module) names the addresses to give instead."""
    if isinstance(value, type):
        found = [name for name, m in modules.items() if name and isinstance(m, value)]
        instead = f"give its modules' addresses ({first_few(map(repr, found))}) or " if found else \
            "give module addresses or "
        raise TypeError(f"{where} got the class {value.__name__}, which names no op and no module: {instead}a "
                        "predicate over ops (lambda op: op.type == 'relu')")
    if isinstance(value, torch.nn.Module):
        found = [name for name, m in modules.items() if name and m is value]
        instead = f"give its address instead: {first_few(map(repr, found))}" if found else \
            "and this one is no submodule of the traced model, so it has no address in it"
        raise TypeError(f"{where} got a module object ({type(value).__name__}), where a module is named by its "
                        f"address; {instead}")


# ----- one index per model, while its structure is unchanged ------------------------------------
# Each module keeps its submodules, parameters and buffers in three dicts of its ``__dict__``; every
# change to the module tree (assigning, replacing or deleting a submodule, parameter or buffer,
# ``register_*``, ``add_module``, ``_apply`` producing new tensors) changes the keys or the values of
# one of them, or replaces the dict.  A module given another class (``module.__class__ = ...``) keeps its
# dicts: the index's module classes (which of them bring their own ``_call_impl``) would go stale, so each
# module's class is compared too.
_DICTS = itemgetter("_modules", "_parameters", "_buffers")


class Structure:
    """What a model's index was derived from: every module's class and three dicts, their keys and their values.

    Everything is held strongly, so an object seen here can never be freed and its address reused by a
    different object that would then pass for it.  The check is a few C-level loops: the dicts and
    their values come from ``gc.get_referents`` (a container's references, in order: any change of a
    value changes the list), the keys from one chained iteration (string keys are not references)."""

    __slots__ = ("modules", "classes", "snapshot", "keyed", "keys", "by_referents")

    def __init__(self, model, modules: list):
        self.modules = modules  # every module but the root, once each, in walk order
        self.classes = list(map(type, chain((model,), modules)))  # the root's first
        # A plain module's references are its ``__dict__`` and its class, in that order: one C call then
        # finds every module's ``__dict__`` (no ``vars`` per module).  Anything else (slots, a dict not
        # materialised) takes the general path.
        owners = gc.get_referents(model, *modules)
        self.by_referents = len(owners) == 2 * (len(modules) + 1) and all(
            map(is_, owners[0::2], map(vars, chain((model,), modules))))
        dicts = self._dicts_of(model)
        if not all(type(d) in (dict, OrderedDict) for d in dicts):  # whose references are their values
            raise TypeError("a module keeps its submodules, parameters or buffers in a custom mapping")
        # Later checks find the very same dict objects (or fail on identity), so they are dicts too.
        self.snapshot = dicts + gc.get_referents(*dicts)
        # Keys are read back from the dicts that had any: a dict that was empty and gained an entry
        # already shows it among the values (every value is a reference, None included).
        self.keyed = [d for d in dicts if d]
        self.keys = list(chain.from_iterable(self.keyed))

    def _dicts_of(self, model) -> list:
        """Every module's three dicts, the root's first.  By referents, each module's first reference
        is taken for its ``__dict__`` (a class cannot gain references of another layout: ``__class__``
        assignment keeps it); anything else fails the check (KeyError, TypeError)."""
        if self.by_referents:
            owners = gc.get_referents(model, *self.modules)
            if len(owners) != 2 * len(self.modules) + 2:
                raise TypeError("a module's references changed layout")
            return gc.get_referents(*map(_DICTS, owners[0::2]))
        return gc.get_referents(*map(_DICTS, map(vars, chain((model,), self.modules))))

    def unchanged(self, model) -> bool:
        """Whether ``model``'s module tree is exactly what was snapshotted."""
        try:
            dicts = self._dicts_of(model)
        except (KeyError, TypeError):  # a module without the usual dicts: never cached anyway
            return False
        now = dicts + gc.get_referents(*dicts)
        # ``keyed`` holds some of the very dicts just found identical, so its keys are theirs now.
        return (len(now) == len(self.snapshot) and all(map(is_, now, self.snapshot))
                and list(chain.from_iterable(self.keyed)) == self.keys
                and list(map(type, chain((model,), self.modules))) == self.classes)  # a type equals itself alone


_cache: dict = {}  # id(model) -> (weak reference to the model, Structure, ModelIndex)


def fsdp_params(modules) -> list:
    """FSDP2's record of each parameter ``fully_shard`` sharded in ``modules`` (an ``FSDPParam``: its
    ``sharded_param``, the DTensor the module holds between forwards; its ``_unsharded_param``, made by the first
    all-gather and registered in its place during the module's forward; ``is_dtensor``, whether it was a DTensor
    before, as tensor parallelism makes).  Empty where FSDP2 was never imported."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not hasattr(fsdp, "FSDPModule"):
        return []
    return [param for module in modules if isinstance(module, fsdp.FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups for param in group.fsdp_params]


def offloaded_address(index: ModelIndex, module, p) -> str | None:
    """The address of ``module``'s own parameter that ``p``, a parameter outside the index read in the
    module's call, was loaded in place of; None when that cannot be told.  A hook that offloads weights
    (accelerate's ``cpu_offload``, ``disk_offload``, ``dispatch_model`` to "cpu" or "disk") keeps the
    module's parameters on the meta device, which holds no values, and registers a loaded copy in place of
    each only while the module runs.  Named only when exactly one meta parameter of the module has ``p``'s
    shape and dtype: two alike (a module's query and key weights) cannot be told apart."""
    addresses = index.module_addresses.get(id(module))
    if addresses is None:  # a module the walk never saw
        return None
    prefix = "" if addresses[0] == "self" else f"{addresses[0]}."
    found = [address for address in (prefix + name for name in index.param_names_of(module))
             if _stands_for(index.param_at.get(address), p)]
    return found[0] if len(found) == 1 else None


def _stands_for(offloaded, loaded) -> bool:
    return (offloaded is not None and offloaded.is_meta and offloaded.shape == loaded.shape
            and offloaded.dtype == loaded.dtype)


def index_of(model) -> ModelIndex:
    """The model's index: the cached one while its structure is unchanged, else a fresh walk."""
    if not isinstance(model, torch.nn.Module):
        return ModelIndex(model)
    entry = _cache.get(id(model))
    # A cached index is of a model no module of which named its own submodules as it was walked (below), and the
    # structure check compares their classes: what is left to see is a named_modules set on the model since.
    if entry is not None and entry[0]() is model and entry[1].unchanged(model) and "named_modules" not in \
            model.__dict__:
        return entry[2]
    index = ModelIndex(model)
    if any(map(_names_its_own, index.all_modules())):
        return index
    try:
        structure = _snapshot(model, list(index.submodules.values()))
    except (KeyError, TypeError):
        return index
    key = id(model)
    # The callback holds the cache itself: at interpreter exit this module's globals may already be gone.
    _cache[key] = (weakref(model, lambda _, key=key, cache=_cache: _forget(cache, key)), structure, index)
    return index


def _names_its_own(module) -> bool:
    """Whether ``module`` names its submodules with a ``named_modules`` of its own (its class's, or one set on it):
    what that yields may change while the module tree does not (a flag it reads, an override set later), so an
    index walked through it is never cached.  Checked for every module as an index is cached; as it is reused, the
    structure check compares the modules' classes, and ``index_of`` looks for one set on the model since."""
    own = type(module).named_modules is not torch.nn.Module.named_modules  # (nn.Module's as it is now)
    return own or "named_modules" in getattr(module, "__dict__", ())


# ----- a model its own modules lead back to --------------------------------------------------------
# The cache holds every module of an index (the structure check needs them alive).  A module leading back to
# its model (a hook that is a bound method of the model, a closure or ``partial`` holding it, a parent kept as
# a plain attribute) puts the model in a cycle that the cache, a global, reaches: the collector would never
# free it.  Such a model is a cycle of its own, which only a collection frees even untraced: so before each
# full collection the cache lets go of the entries whose modules lead back to their model, and the collection
# frees those no one else holds (a model still in use is walked again by its next trace).  So too for a model
# changed since its walk: its index still holds what the model let go (a block deleted, a head or a weight
# replaced), which nothing would free while the model lives untraced.
_NOT_SEARCHED = (type, types.ModuleType, types.CodeType)  # what leads back from there is the program's own
_SEARCH_LIMIT = 200_000  # objects; a search this long is given up, and the model taken to refer back


def refers_back(model, modules) -> bool:
    """Whether anything ``modules`` hold (searched through containers, objects, closures and defaults, not
    functions' globals, classes or Python modules) leads back to ``model``."""
    seen = set(map(id, modules))
    seen.add(id(model))
    # What the cache holds: the modules, and the root's own parameters and buffers (the others are found
    # through their modules).
    pending = [*modules, *(t for t in chain(model._parameters.values(), model._buffers.values()) if t is not None)]
    while pending:
        held = pending.pop()
        if type(held) is types.FunctionType:
            referents = (*(held.__closure__ or ()), *(held.__defaults__ or ()), held.__kwdefaults__)
        else:
            referents = gc.get_referents(held)
        for referent in referents:
            if referent is model:
                return True
            # By its type, not ``isinstance``, which reads an object's own ``__class__``: a proxy's can raise.
            if id(referent) in seen or not gc.is_tracked(referent) or issubclass(type(referent), _NOT_SEARCHED):
                continue
            seen.add(id(referent))
            pending.append(referent)
        if len(seen) > _SEARCH_LIMIT:
            return True
    return False


def _release_entries(phase: str, info: dict, cache: dict = _cache) -> None:
    """``gc.callbacks`` entry: before a full collection, drop the cache entries of models changed since their
    walk, and of models their modules lead back to (see above)."""
    if phase != "start" or info.get("generation") != 2 or not cache:
        return
    try:
        for key, (model_ref, structure, index) in list(cache.items()):
            model = model_ref()
            if model is not None and (not structure.unchanged(model)
                                      or refers_back(model, list(index.submodules.values()))):
                cache.pop(key, None)
            model = None  # this frame must not hold it through the collection
    except Exception:  # noqa: BLE001 - at interpreter exit the names it reads may be gone: nothing to release
        return


gc.callbacks.append(_release_entries)


def _snapshot(model, modules: list):
    """The structure check for a fresh index: torchlens-accel's compiled ``Snapshot`` when in use (the
    same changes seen, without a Python call per module), else ``Structure``.  The path is chosen when
    the index is cached; both see exactly the same changes."""
    from ..capture import accel  # imported here, not above: capture imports record

    native = accel.compiled("_index")
    return native.Snapshot(model, modules) if native is not None else Structure(model, modules)


def _forget(cache: dict, key: int) -> None:
    entry = cache.get(key)
    if entry is not None and entry[0]() is None:  # not a newer model that took the same id
        del cache[key]
