"""How a call's arguments are recorded: the scan the pure-Python hot path runs before each op.

A call's record keeps its arguments with every tensor blanked (the skeleton), the record index of each
tensor argument's producing op (its parents), the Parameters it read, and each tensor's version before
the call, by which writes are found after it.  ``scan_arguments`` is the general scan; ``scan_linear``
and ``bound_parent`` are the same scan for the commonest shapes of call, without its loop.  The compiled
handler (accel/src/torchlens_accel/_capture.c) records the same, and tests/test_scan_shortcuts.py checks
each shortcut against the general scan.
"""

from __future__ import annotations

import sys
from weakref import ref as weakref

import torch

from ..tree import split

Tensor = torch.Tensor
Parameter = torch.nn.Parameter
_CONTAINERS = (list, tuple, dict)  # argument types walked for tensors (named tuples and dict subclasses too)
_Size = torch.Size
# Exact types no tensor has, ruled out before ``isinstance(a, Tensor)``, which costs about 0.07 us for any
# other type than Tensor itself (torch.Tensor's metaclass is not ``type``): a tuple of sizes would pay it on
# every call.  (Sizes and other plain values are skipped before; a Parameter is taken by its type.)
_NOT_TENSORS = frozenset((tuple, list, dict))
# Argument types that are neither tensors nor containers (exact types: subclasses take the full checks).
PLAIN_VALUES = frozenset([int, float, bool, str, type(None), slice, type(Ellipsis), torch.dtype, torch.device,
                          torch.layout, torch.memory_format, _Size])
# The exact types a flat tuple argument may hold and be recorded as it is (``tree.split``'s plain values);
# the walker finds no tensor in them, so a module call's flat tuple of these and tensors is read in one loop.
TUPLE_VALUES = frozenset([int, float, bool, str, type(None), slice, type(Ellipsis), torch.dtype, torch.device])
_UNSIGNED = {1: "u1", 2: "u2", 4: "u4", 8: "u8"}  # element size -> the NumPy unsigned integer of that size


def _ndarray():
    """``numpy.ndarray`` where NumPy is imported (a model passing one has imported it), else None.  An array
    argument (``torch.asarray(y.numpy())``) is recorded as a copy (``recorded_array``): it may share memory a
    later write changes without moving any version counter, and the record must hold what the op read."""
    numpy = sys.modules.get("numpy")
    return numpy.ndarray if numpy is not None else None


def recorded_array(st, a):
    """A copy of the array argument ``a``, as an op reads it.  One copy per array per trace while its bytes stay
    the same: an array no version counter guards is compared with the copy last taken of it (one pass over
    its bytes, no second copy), so that a large array many ops take is held once, and a write between them
    (through a tensor on its memory, or by NumPy) gets the ops after it a copy of their own."""
    copies = st.array_copies
    if copies is None:
        copies = st.array_copies = {}
    kept = copies.get(id(a))
    if kept is not None and kept[0]() is a and _same_bytes(a, kept[1]):
        return kept[1]
    copy = a.copy()
    copies[id(a)] = (weakref(a), copy)
    return copy


def _same_bytes(a, kept) -> bool:
    """Whether array ``a`` holds the bytes of ``kept``, a copy of it: compared as unsigned integers of the
    element's size, so that NaNs and signed zeros compare as the bytes they are; False for an element size
    without such an integer, or one holding Python objects (whose identity a byte test would not see)."""
    code = _UNSIGNED.get(a.itemsize)
    if code is None or a.dtype != kept.dtype or a.shape != kept.shape or a.dtype.hasobject:
        return False
    return bool((a.view(code) == kept.view(code)).all())


def is_subclass_param(t) -> bool:
    """Whether ``t``, a tensor of a subclass, is a parameter: ``nn.Parameter`` of a subclass's tensor (a fake
    tensor's under ``FakeTensorMode``, a tensor subclass of the user's) is that subclass, marked ``_is_param``,
    which ``isinstance(t, Parameter)`` reads."""
    return isinstance(t, Parameter)


def scan_arguments(st, args, kwargs):
    """Parents (by producing op), parameters and version counters of a call's tensor arguments.

    Returns ``(skeleton, kw_skeleton, parents, params, versions)``: the arguments as recorded (a tuple
    with tensors blanked, or ``args`` itself when nothing was blanked; the keywords likewise), a tuple of
    ``(position, record index)`` pairs, ``(position, Parameter)`` pairs or None, and ``(tensor, version
    before the call)`` pairs, by which writes are detected after it, predicted or not.
    """
    producers = st.producers
    parents = []
    params = None
    versions = []
    skeleton = None
    for pos, a in enumerate(args):
        kind = type(a)
        if kind in PLAIN_VALUES:
            continue
        if kind is Tensor or kind is Parameter or (kind not in _NOT_TENSORS and isinstance(a, Tensor)):
            if skeleton is None:
                skeleton = list(args)
            skeleton[pos] = None
            try:
                version = a._version
            except RuntimeError:  # an inference tensor: no version counter
                version = st.version(a)
            versions.append((a, version))
            if kind is Parameter or (kind is not Tensor and is_subclass_param(a)):
                if params is None:
                    params = []
                params.append((pos, a))
                continue
            entry = producers.get(id(a))
            if entry is not None and entry[2] == version and version is not None and (entry[0] is a or entry[0]() is a):
                parents.append((pos, entry[1]))
            else:
                parents.append((pos, st.producer_of(a)))
        elif kind is tuple and TUPLE_VALUES.issuperset(map(type, a)):
            continue  # x[:t, :t], normalized_shape: held as it is, as the container walk would hold it
        elif isinstance(a, _CONTAINERS) and kind is not _Size:  # walked when it may hold a tensor
            inner, found = scan_container(st, a, pos, parents, versions)
            if found:
                params = (params or []) + found
            if inner is not a:
                if skeleton is None:
                    skeleton = list(args)
                skeleton[pos] = inner
        elif kind is _ndarray():
            if skeleton is None:
                skeleton = list(args)
            skeleton[pos] = recorded_array(st, a)
    kw_skeleton = kwargs
    if kwargs:
        kw_skeleton, params = _scan_keywords(st, kwargs, parents, params, versions)
    return tuple(skeleton) if skeleton is not None else args, kw_skeleton, tuple(parents), params, versions


def scan_linear(st, args):
    """``scan_arguments`` for ``(tensor, Parameter)`` and ``(tensor, Parameter, Parameter or None)``:
    returns ``(skeleton, parents, params, versions)``."""
    parent, first = bound_parent(st, args[0])
    weight = args[1]
    try:
        versions = [first, (weight, weight._version)]
    except RuntimeError:  # an inference tensor: no version counter
        versions = [first, (weight, st.version(weight))]
    params = [(1, weight)]
    if len(args) == 2:
        return (None, None), ((0, parent),), params, versions
    bias = args[2]
    if bias is not None:
        try:
            versions.append((bias, bias._version))
        except RuntimeError:
            versions.append((bias, st.version(bias)))
        params.append((2, bias))
    return (None, None, None), ((0, parent),), params, versions


def bound_parent(st, t):
    """``(record index, (t, version))`` of a plain tensor argument: the hot path's second argument."""
    try:
        version = t._version
    except RuntimeError:  # an inference tensor: no version counter
        version = st.version(t)
    entry = st.producers.get(id(t))
    if entry is not None and entry[2] == version and version is not None and (entry[0] is t or entry[0]() is t):
        return entry[1], (t, version)
    return st.producer_of(t), (t, version)


def _scan_keywords(st, kwargs, parents, params, versions):
    """``scan_arguments`` for keyword arguments: returns the keywords as recorded and the parameters."""
    kw_skeleton = kwargs
    for key, a in kwargs.items():
        kind = type(a)
        if kind in PLAIN_VALUES:
            continue
        if kind is Tensor or kind is Parameter or (kind not in _NOT_TENSORS and isinstance(a, Tensor)):
            if kw_skeleton is kwargs:
                kw_skeleton = dict(kwargs)
            kw_skeleton[key] = None
            params = _scan_tensor(st, a, key, parents, versions, params)
        elif isinstance(a, _CONTAINERS):
            inner, found = scan_container(st, a, key, parents, versions)
            if found:
                params = (params or []) + found
            if inner is not a:
                if kw_skeleton is kwargs:
                    kw_skeleton = dict(kwargs)
                kw_skeleton[key] = inner
        elif kind is _ndarray():
            if kw_skeleton is kwargs:
                kw_skeleton = dict(kwargs)
            kw_skeleton[key] = recorded_array(st, a)
    return kw_skeleton, params


def scan_container(st, value, key, parents, versions):
    """Tensors at any depth inside a container argument (``torch.cat([a, b])``, ``x[..., idx]``,
    ``cat(tensors=[a, b])``), at positions ``(key, *path)``; returns the argument as recorded (a copy
    with its tensors blanked, so a list the model mutates later cannot rewrite the record) and the
    parameters found, if any."""
    leaves, inner = split(value, (key,))  # a flat tuple without tensors comes back as it is
    found = None
    for path, t in leaves:
        found = _scan_tensor(st, t, path, parents, versions, found)
    return inner, found


def _scan_tensor(st, t, where, parents, versions, params):
    """One tensor met by the keyword or container scan, at position ``where``: its version is noted, and
    it is a parameter (appended to ``params``, a list made here if None; returned) or a parent."""
    try:
        versions.append((t, t._version))
    except RuntimeError:  # an inference tensor: no version counter
        versions.append((t, st.version(t)))
    kind = type(t)
    if kind is Parameter or (kind is not Tensor and is_subclass_param(t)):
        if params is None:
            params = []
        params.append((where, t))
    else:
        parents.append((where, st.producer_of(t)))
    return params
