"""The one tensor walker: every tensor inside a nested Python value, with the path that reaches it.

Capture, module calls, validation, extraction and output comparison all need the same answer to
"which tensors are in this argument, and where", so they all ask this module.  Containers walked:
tuples, lists and deques (named tuples included), dicts and other mappings (``ModelOutput``-style ordered
dicts included), and dataclasses.  ``attrs=True`` also walks the instance attributes of plain
objects (their ``__dict__``, or the attributes their class declares in ``__slots__``), for comparing return
values of any shape.

A path is a tuple of keys: list indices, dict keys and field names, outermost first.  ``strip``
copies a value with every tensor replaced by ``None`` (so a record holds the non-tensor arguments by
value, not by reference to a list the model may mutate later) and ``fill`` puts tensors back.
Copies of a call's inputs for an extra run are made in ``copies.py`` from what this module walks."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections import deque
from collections.abc import Mapping

import torch
from torch.nn.parameter import UninitializedTensorMixin


Tensor = torch.Tensor
# Whether a tensor is a torch.func transform's wrapper (vmap's batched tensor, grad's): it has no storage of
# its own, and it cannot be read once its transform has returned.
made_in_transform = torch._C._functorch.is_functorch_wrapped_tensor
MAX_DEPTH = 32  # deeper nesting is not walked: a guard against self-referencing containers


def without_values(t: Tensor) -> bool:
    """Whether ``t`` has a shape and dtype but no values: a meta tensor, or a ``FakeTensor`` (made under
    ``FakeTensorMode``, which reports a real device).  Comparing such tensors compares shapes and dtypes."""
    fake = sys.modules.get("torch._subclasses.fake_tensor")  # none exists before that module is loaded
    return t.is_meta or (fake is not None and isinstance(t, fake.FakeTensor))


def is_uninitialized(t) -> bool:
    """Whether ``t`` is a lazy module's parameter or buffer not yet materialized (no shape, no memory, and it
    refuses every torch call): the module's first forward gives it memory by ``t.data = ...``, in place."""
    return isinstance(t, UninitializedTensorMixin)


def shape_or_none(t) -> tuple | None:
    """``t``'s shape, or None where it has none yet (torch refuses to read an uninitialized parameter's)."""
    return None if is_uninitialized(t) else tuple(t.shape)


def unmaterialized(module) -> list:
    """The names of ``module``'s parameters and buffers that are not yet materialized (``is_uninitialized``)."""
    named = (*module.named_parameters(), *module.named_buffers()) if isinstance(module, torch.nn.Module) else ()
    return [name for name, t in named if is_uninitialized(t)]


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


_DATACLASS_FIELDS = "__dataclass_fields__"  # what dataclasses.is_dataclass looks for on the class


def container_items(obj, attrs: bool):
    """``(key, child)`` pairs of a container, or None when ``obj`` is not one we walk."""
    if isinstance(obj, (tuple, list, deque)):
        return enumerate(obj)
    if isinstance(obj, dict) or isinstance(obj, Mapping):  # a dict subclass (ModelOutput) skips the ABC check
        return obj.items()
    if not isinstance(obj, type) and hasattr(type(obj), _DATACLASS_FIELDS):  # dataclasses.is_dataclass, inlined
        return ((f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj))
    if not attrs or isinstance(obj, (type, torch.nn.Module)):
        return None
    if hasattr(obj, "__dict__"):
        return vars(obj).items()
    return _slot_items(obj)


def _slot_items(obj):
    """The attributes an object's class declares in ``__slots__`` (it has no ``__dict__`` to read them from), or
    None for a value with an equality of its own and no tensor in them (a ``Decimal``, a ``pathlib.Path``, whose
    slots may cache what ``==`` does not compare)."""
    slots = _slot_names(type(obj))
    if not slots:
        return None
    items = [(name, getattr(obj, name, None)) for name in slots]
    if type(obj).__eq__ is not object.__eq__ and not any(has_tensor(value) for _, value in items):
        return None
    return items


@functools.lru_cache(maxsize=256)
def _slot_names(cls) -> tuple:
    """The attributes a class and its bases declare in ``__slots__`` (a string names one), in declaration order."""
    names = []
    for klass in reversed(cls.__mro__):
        declared = vars(klass).get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return tuple(names)


def tensor_leaves(obj, path: tuple = (), *, attrs: bool = False) -> list:
    """``(path, tensor)`` for every tensor inside ``obj``, in a stable depth-first order."""
    out: list = []
    _walk(obj, path, out, attrs, 0, set())
    return out


# Exact types decided by a set lookup, before any isinstance check (one against torch.Tensor, whose
# metaclass is not ``type``, costs about 0.07 us): tensors are leaves, scalars (and torch's dtypes,
# devices, layouts and memory formats) hold no tensor, and tuples, lists and dicts are walked.  Subclasses
# of any of them take the general checks.
TENSOR_TYPES = frozenset((Tensor, torch.nn.Parameter))
SCALARS = (str, bytes, int, float, bool, type(None))
SCALAR_TYPES = frozenset((*SCALARS, torch.dtype, torch.device, torch.layout, torch.memory_format))
_CONTAINER_TYPES = frozenset((tuple, list, dict))


def _walk(obj, path, out, attrs, depth, seen) -> None:
    kind = type(obj)
    if kind is Tensor or kind in TENSOR_TYPES:  # a lone tensor, the commonest value, by identity first
        out.append((path, obj))
        return
    if kind in _CONTAINER_TYPES:  # container_items's answer for them, without its checks
        if depth >= MAX_DEPTH:
            return
        children = obj.items() if kind is dict else enumerate(obj)
    elif kind in SCALAR_TYPES:
        return
    elif isinstance(obj, Tensor):  # a tensor subclass
        out.append((path, obj))
        return
    elif depth >= MAX_DEPTH or isinstance(obj, SCALARS):
        return
    else:
        children = container_items(obj, attrs)
        if children is None:
            return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    depth += 1
    for key, child in children:
        kind = type(child)
        if kind in TENSOR_TYPES:  # a leaf, without a call
            out.append((path + (key,), child))
        elif kind not in SCALAR_TYPES:
            _walk(child, path + (key,), out, attrs, depth, seen)
    seen.discard(id(obj))


def has_tensor(obj) -> bool:
    return bool(tensor_leaves(obj))


def holds_tensor(value) -> bool:
    """Whether a tensor lies inside ``value`` at any depth (plain objects' attributes included), as
    ``tensor_leaves`` would find it if it looked below ``MAX_DEPTH``."""
    stack, seen = [value], set()
    while stack:
        value = stack.pop()
        if isinstance(value, Tensor):
            return True
        children = container_items(value, True) if id(value) not in seen and type(value) not in SCALAR_TYPES \
            else None
        if children is not None:
            seen.add(id(value))
            stack.extend(child for _, child in children)
    return False


def cut_off_path(obj, attrs: bool = False) -> tuple | None:
    """The path of the first value that ``tensor_leaves`` does not look into, being ``MAX_DEPTH`` levels down,
    and that holds a tensor (one missing from the walk's answer); None where there is none."""
    return _cut_off(obj, (), attrs, 0, set())


def _cut_off(obj, path, attrs, depth, seen):
    if isinstance(obj, Tensor) or type(obj) in SCALAR_TYPES or id(obj) in seen:
        return None
    children = container_items(obj, attrs)
    if children is None:
        return None
    if depth >= MAX_DEPTH:
        return path if holds_tensor(obj) else None
    seen.add(id(obj))
    for key, child in children:
        found = _cut_off(child, path + (key,), attrs, depth + 1, seen)
        if found is not None:
            return found
    return None


def strip(obj, depth: int = 0):
    """A copy of ``obj`` with every tensor replaced by ``None``; containers are copied, leaves kept."""
    if isinstance(obj, Tensor):
        return None
    if depth >= MAX_DEPTH:
        return obj
    if isinstance(obj, list):
        return [strip(x, depth + 1) for x in obj]
    if _is_namedtuple(obj):
        return _named_tuple_of(obj, [strip(x, depth + 1) for x in obj])
    if isinstance(obj, tuple):
        return tuple(strip(x, depth + 1) for x in obj)
    if type(obj) is dict:
        return {k: strip(v, depth + 1) for k, v in obj.items()}
    return obj  # other values are kept as they are (immutable in practice: numbers, dtypes, slices)


_PLAIN = (int, float, bool, str, bytes, type(None), slice, type(Ellipsis), torch.dtype, torch.device)


def _named_tuple_of(like, fields: list):
    """A named tuple of ``like``'s class holding ``fields``, made as ``tuple`` makes it: a class whose own
    ``__new__`` checks or converts its fields (``PackedSequence`` refuses a ``None`` where its data goes) would
    refuse the skeleton ``strip`` makes, or convert fields it was given already converted."""
    return tuple.__new__(type(like), fields)


def slice_with_tensor(obj, depth: int = 0) -> bool:
    """Whether a recorded argument holds a slice with a tensor bound (``x[s:e]`` with ``s`` a 0-d tensor).
    Capture holds slices by value, as plain values, so such a bound is no parent and the slice keeps the live
    tensor, whose value may have changed since the call (Whisper's ``generate`` advances ``seek`` in place)."""
    if type(obj) is slice:
        return any(isinstance(bound, Tensor) for bound in (obj.start, obj.stop, obj.step))
    if depth >= MAX_DEPTH:
        return False
    if isinstance(obj, (list, tuple)):
        return any(slice_with_tensor(x, depth + 1) for x in obj)
    if type(obj) is dict:
        return any(slice_with_tensor(x, depth + 1) for x in obj.values())
    return False


def split(obj, path: tuple = ()) -> tuple:
    """``(tensor_leaves(obj, path), strip(obj))`` in one pass; flat lists and tuples of tensors and
    plain values (``torch.cat([a, b])``, ``x[..., idx]``), the common case on the capture hot path,
    take one loop."""
    if type(obj) is list or type(obj) is tuple:
        leaves, inner = [], None
        for i, item in enumerate(obj):
            if isinstance(item, Tensor):
                if inner is None:
                    inner = list(obj)
                inner[i] = None
                leaves.append((path + (i,), item))
            elif not isinstance(item, _PLAIN):
                break  # something nested: the general walk
        else:
            if inner is None:
                return leaves, list(obj) if type(obj) is list else obj
            return leaves, inner if type(obj) is list else tuple(inner)
    return tensor_leaves(obj, path), strip(obj)


def fill(skeleton, tensors: dict, path: tuple = ()):
    """Rebuild a value from ``strip``'s skeleton and ``{path: tensor}``."""
    if path in tensors:
        return tensors[path]
    if isinstance(skeleton, list):
        return [fill(x, tensors, path + (i,)) for i, x in enumerate(skeleton)]
    if _is_namedtuple(skeleton):
        return _named_tuple_of(skeleton, [fill(x, tensors, path + (i,)) for i, x in enumerate(skeleton)])
    if isinstance(skeleton, tuple):
        return tuple(fill(x, tensors, path + (i,)) for i, x in enumerate(skeleton))
    if type(skeleton) is dict:
        return {k: fill(v, tensors, path + (k,)) for k, v in skeleton.items()}
    return skeleton


def path_text(prefix: str, path: tuple) -> str:
    """``input.x.0``-style text for a path under a prefix."""
    return ".".join([prefix, *map(str, path)]) if prefix else ".".join(map(str, path))


def outputs_equal(a, b) -> bool:
    """Whether two return values (or two tensors) match exactly: ``structures_equal``'s verdict alone."""
    return structures_equal(a, b)[0]


def structures_equal(a, b, *, exact: bool = True, rtol: float = 0.0, atol: float = 0.0) -> tuple:
    """Whether two return values match, tensor for tensor and leaf for leaf: ``(equal, why)``.  Walks every
    container ``tensor_leaves`` walks, plus plain objects' attributes, and compares non-tensor leaves by ``==``
    (NaN equal to NaN); never falls back to comparing types alone.  ``rtol`` / ``atol`` (with ``exact=False``)
    apply to floating and complex values; integer and boolean tensors match exactly."""
    return _equal(a, b, (), exact, rtol, atol, 0)


def _equal(a, b, path, exact, rtol, atol, depth) -> tuple:
    where = path_text("output", path)
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return False, f"{where}: a tensor on one side only"
        return _tensors_equal(a, b, where, exact, rtol, atol)
    if type(a) is not type(b):
        return False, f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if depth >= MAX_DEPTH:
        return True, ""
    ca, cb = container_items(a, True), container_items(b, True)
    if ca is None or cb is None:
        return (True, "") if _leaves_equal(a, b, exact, rtol, atol) else (False, f"{where}: {a!r} vs {b!r}")
    da, db = dict(ca), dict(cb)
    if list(da) != list(db):
        return False, f"{where}: keys {list(da)} vs {list(db)}"
    for key in da:
        ok, why = _equal(da[key], db[key], path + (key,), exact, rtol, atol, depth + 1)
        if not ok:
            return ok, why
    return True, ""


def _leaves_equal(a, b, exact, rtol, atol) -> bool:
    """Two non-tensor leaves of one type: by ``==``, with NaN equal to NaN as for tensors (two runs that
    both made a NaN agree), and NumPy arrays by value (their ``==`` is elementwise, with no truth value)."""
    numpy = sys.modules.get("numpy")  # an array can only exist once numpy is imported
    if numpy is not None and isinstance(a, numpy.ndarray):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.kind not in "fc":
            return bool(numpy.array_equal(a, b))
        return bool(numpy.array_equal(a, b, equal_nan=True) if exact else
                    numpy.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))
    try:
        return bool(a == b) or bool(a != a and b != b)  # NaN is the one value unequal to itself
    except Exception:  # noqa: BLE001 - values without a usable ==: compare identity
        return a is b


def _tensors_equal(a, b, where, exact, rtol, atol) -> tuple:
    if a.is_nested or b.is_nested:  # no single shape: compare component by component
        if not (a.is_nested and b.is_nested) or a.size(0) != b.size(0):
            return False, f"{where}: nested tensor layouts differ"
        for i, (x, y) in enumerate(zip(a.unbind(), b.unbind())):
            same, why = _tensors_equal(x, y, f"{where} component {i}", exact, rtol, atol)
            if not same:
                return same, why
        return True, ""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"{where}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if without_values(a) or without_values(b):  # meta or fake: shape and dtype are all there is to compare
        if without_values(a) and without_values(b):
            return True, ""
        return False, f"{where}: a tensor without values (meta or fake) on one side only"
    if a.device != b.device:
        return False, f"{where}: on {a.device} vs {b.device}"
    if a.layout != b.layout:  # a sparse result where the other run made a dense one is another result
        return False, f"{where}: {a.layout} vs {b.layout}"
    if a.layout != torch.strided:
        a, b = _dense(a), _dense(b)
    a, b = a.detach(), b.detach()
    if a.dtype is torch.complex32:  # torch.equal has no ComplexHalf kernel: compare the real and imaginary halves
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    rounded = a.is_floating_point() or a.is_complex()
    if exact or not rounded:  # a tolerance is for rounding: indices, counts and masks match exactly
        same = torch.equal(a, b)
        if not same and rounded:  # NaN == NaN for bit-identical runs
            same = bool(((a == b) | (a.isnan() & b.isnan())).all())
    else:
        same = torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    return (True, "") if same else (False, f"{where}: values differ")


def _dense(t: Tensor) -> Tensor:
    if t.is_nested:
        return torch.nested.to_padded_tensor(t, 0.0) if t.is_floating_point() else t.to_padded_tensor(0)
    return t.to_dense()


def as_args(value) -> tuple:
    """The positional arguments a forward is called with, by one rule and no guessing: a tuple is the positional
    arguments; any other value (a tensor, a list, a dict, ...) is the one positional argument.  So ``trace(model,
    (a, b))`` calls ``model(a, b)`` and ``trace(model, [a, b])`` calls ``model([a, b])``; to pass one tuple as the
    only argument, wrap it: ``((a, b),)``."""
    return value if isinstance(value, tuple) else (value,)


def as_kwargs(value, who: str = "tl.trace") -> dict:
    """The keyword arguments a forward is called with: a dict, or None for none.  Any other mapping is what
    ``model(**value)`` would take too (a tokenizer's ``BatchEncoding``), and is read as a dict.  Anything else is
    the common slip of giving a second positional argument where the keywords go, and is refused saying so."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{who}: kwargs must be a dict (or another mapping) of keyword arguments for forward, got a "
                        f"{type(value).__name__}; to call forward with several positional arguments, give them "
                        f"as one tuple: {who}(model, (x, y))")
    named = value if isinstance(value, dict) else dict(value)
    wrong = next((key for key in named if not isinstance(key, str)), None)  # else refused as forward is called
    if wrong is not None:
        raise TypeError(f"{who}: kwargs are keyword arguments, named by strings, but one key is "
                        f"{type(wrong).__name__} {wrong!r}; positional arguments go in args, as a tuple")
    return named
