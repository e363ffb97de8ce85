"""Private copies of a call's inputs for an extra run (validation's untraced run, replay, patching reports): every
tensor copied with its strides and its memory's alignment (``copy_with_layout``), aliasing kept, generators and
the plain objects a forward fills in place (a key/value cache) copied too, so that the extra run computes what the
caller's run does and leaves the caller's inputs as they were.  The tensors are found by the one walker
(``tree.py``)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from .errors import warn_user
from .tree import (MAX_DEPTH, SCALAR_TYPES, SCALARS, TENSOR_TYPES, container_items, fill, made_in_transform,
                   shape_or_none, strip, tensor_leaves, without_values)

Tensor = torch.Tensor


def clone_inputs(obj, memo=None):
    """A copy of a model's inputs for a run that must leave the caller's inputs as they were (a
    reference forward): every tensor cloned, keeping aliasing (a tensor passed twice stays one tensor:
    ``nn.MultiheadAttention`` takes a different path when ``query is key``), containers rebuilt, and
    plain objects deep-copied (a key/value cache the forward extends, also one still empty), as are the
    containers ``strip`` keeps as they are (a dataclass, an ``OrderedDict``, a ``ModelOutput``), whose
    tensors would otherwise be the caller's.  ``memo`` (``id -> copy``) shares the aliasing across several
    values, such as args and kwargs."""
    memo = {} if memo is None else memo
    clones = {}
    for path, t in tensor_leaves(obj):
        if id(t) not in memo:
            memo[id(t)] = _copy_of_input(t)
        clones[path] = memo[id(t)]
    held = tensor_leaves(obj, attrs=True)
    # A generator the forward draws from (``model(x, g)``) is an input too: the extra run draws from a copy of it,
    # so that the caller's generator moves once, for the run the caller asked for.
    twins = _generator_twins(obj, memo)
    if len(held) == len(clones) and not twins and not _holds_state(obj):
        rebuilt = fill(strip(obj), clones)
        if all(t is clones[path] for path, t in tensor_leaves(rebuilt)):
            return rebuilt
    # A plain object (a key/value cache, empty or not), or tensors in a container strip keeps: a forward may
    # update them in place, so the object is copied too, each tensor as its clone.
    for _, t in held:
        if id(t) not in memo:
            memo[id(t)] = _copy_of_input(t)
    _keep_behaviour(obj, memo)
    before = dict(memo)
    try:
        return copy.deepcopy(obj, memo)
    except Exception as exc:  # noqa: BLE001 - an object that cannot be copied is passed as it is
        # A failed copy leaves half-built objects in the memo: another argument holding them gets the original.
        memo.clear()
        memo.update(before)
        warn_user(f"torchlens could not copy a {type(obj).__name__} input ({type(exc).__name__}: {exc}): "
                  "the extra run uses it as given, so a forward that changes it in place changes it again")
    return fill(strip(obj), clones)


def generators_in(obj, depth: int = 0, seen=None) -> list:
    """Every ``torch.Generator`` inside ``obj``, walked as ``tensor_leaves(attrs=True)`` walks it."""
    if isinstance(obj, torch.Generator):
        return [obj]
    if depth >= MAX_DEPTH or type(obj) in SCALAR_TYPES or isinstance(obj, (Tensor, *SCALARS)):
        return []
    seen = set() if seen is None else seen
    children = container_items(obj, attrs=True)
    if children is None or id(obj) in seen:
        return []
    seen.add(id(obj))
    return [g for _, child in children for g in generators_in(child, depth + 1, seen)]


def _generator_twins(obj, memo: dict) -> bool:
    """Put a copy of each generator inside ``obj`` in ``memo`` (``id -> copy``), at the state it is in now; returns
    whether ``obj`` holds any."""
    # The global generators are put back by the run's own RngState, and the caller's forward advances them.
    found = [g for g in generators_in(obj) if not is_global_generator(g)]
    for g in found:
        if id(g) not in memo:
            memo[id(g)] = generator_twin(g)
    return bool(found)


def is_global_generator(g: torch.Generator) -> bool:
    """Whether ``g`` is torch's default CPU generator or an initialized CUDA device's."""
    cuda = torch.cuda.default_generators if torch.cuda.is_available() and torch.cuda.is_initialized() else ()
    return g is torch.default_generator or any(g is d for d in cuda)


def generator_twin(g: torch.Generator) -> torch.Generator:
    """A new generator at ``g``'s state: it draws what ``g`` would, and drawing from it leaves ``g`` as it is."""
    twin = torch.Generator(device=g.device)
    twin.set_state(g.get_state())
    return twin


def _holds_state(obj, seen=None) -> bool:
    """Whether ``obj`` is, or holds in its containers, a plain object that a forward may fill in place though it
    holds no tensor yet: an empty key/value cache (``DynamicCache()``), which a prefill forward extends, so that
    the next run given the same object would find it extended (a generator is copied by ``_generator_twins``).
    Callables (a logits processor, a tokenizer) and modules are taken as they are: they carry behaviour, not the
    call's state."""
    if type(obj) in SCALAR_TYPES or isinstance(obj, (Tensor, type, torch.nn.Module)):
        return False
    if isinstance(obj, (tuple, list, Mapping)):
        seen = set() if seen is None else seen
        if id(obj) in seen:  # a container holding itself
            return False
        seen.add(id(obj))
        items = obj.values() if isinstance(obj, Mapping) else obj
        return any(_holds_state(item, seen) for item in items)
    return hasattr(obj, "__dict__") and not callable(obj)


def _keep_behaviour(obj, memo: dict, seen=None) -> None:
    """Note in ``memo`` (a ``copy.deepcopy`` memo) every module and callable in ``obj``'s containers and plain
    objects as its own copy, so that the deep copy shares them: a module an input object refers to (a helper, a
    whole model) runs as itself, hooks and all, rather than as a copy that would double its memory."""
    seen = set() if seen is None else seen
    if id(obj) in seen or len(seen) > _MOST_WALKED or type(obj) in SCALAR_TYPES or \
            isinstance(obj, (Tensor, torch.Generator)):
        return
    seen.add(id(obj))  # each object once: a cache's layers may point back at it
    if isinstance(obj, (torch.nn.Module, type)) or callable(obj):
        memo.setdefault(id(obj), obj)
        return
    children = container_items(obj, attrs=True)
    for _, child in children if children is not None else ():
        _keep_behaviour(child, memo, seen)


_MOST_WALKED = 100_000  # objects; an input graph larger than this is copied as it is past that point


def _copy_of_input(t: Tensor) -> Tensor:
    """A copy of a plain tensor with its strides and alignment (``copy_with_layout``): a kernel reading a strided
    input (``torch.dot`` over ``x[::2]``) sums in another order, to other bits, than over a contiguous clone.
    Any other tensor (a subclass, a fake one) is cloned as its class clones it."""
    return copy_with_layout(t) if type(t) is Tensor and not without_values(t) else t.clone()


def clone_call(args, kwargs) -> tuple:
    """``(args, kwargs)`` of a call, each copied by ``clone_inputs`` with one memo, so that a tensor
    passed both positionally and by keyword stays one tensor, and tensors that view one storage (an input
    and a view of it, ``model(x, x[1:])``) stay views of one copy of it.  Each argument is copied on its own:
    one that cannot be (a streamer holding a lock) is shared with the extra run, and a cache beside it is
    still copied, so that the caller's cache is extended once."""
    memo = _views_of_copied_storages(tensor_leaves((args, kwargs), attrs=True))
    args = tuple(clone_inputs(a, memo) for a in args) if type(args) is tuple else clone_inputs(args, memo)
    if type(kwargs) is dict:
        return args, {name: clone_inputs(value, memo) for name, value in kwargs.items()}
    return args, clone_inputs(kwargs, memo)


def _views_of_copied_storages(leaves) -> dict:
    """``{id(tensor): copy}`` for the tensors whose memory overlaps another one's: each copy views one copy
    of the memory they span, with the tensor's own size and stride, so that a write the forward makes through
    one shows in the others, as it does in the caller's tensors.  Cloned one by one, the copies would each
    hold their own values, and a reference run would compute what the traced run never did.  Only the span
    the overlapping tensors cover is copied, not their whole storage (two slices of a dataset tensor)."""
    by_storage: dict = {}
    for _, t in leaves:
        if type(t) is Tensor and t.layout == torch.strided and t.numel() and \
                not (t.is_quantized or t.is_conj() or t.is_neg() or without_values(t) or made_in_transform(t)):
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr(), t.dtype), {})[id(t)] = t
    memo: dict = {}
    for shared in by_storage.values():
        if len(shared) > 1:
            for overlapping in _overlapping(shared.values()):
                memo.update(_views_of_one_copy(overlapping))
    return memo


def _span(t: Tensor) -> tuple:
    """The elements of its storage a tensor can reach: ``[first, last + 1)``."""
    return t.storage_offset(), t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1


def _overlapping(tensors) -> list:
    """The groups of two or more tensors (of one storage) whose spans overlap, each a list."""
    groups, end = [], -1
    for t in sorted(tensors, key=lambda v: _span(v)[0]):
        start, stop = _span(t)
        if start < end:
            groups[-1].append(t)
        else:
            groups.append([t])
        end = max(end, stop)
    return [group for group in groups if len(group) > 1]


def _views_of_one_copy(views: list) -> dict:
    start = min(_span(t)[0] for t in views)
    stop = max(_span(t)[1] for t in views)
    first = views[0]
    span = torch.empty(0, dtype=first.dtype, device=first.device).set_(first.untyped_storage(), start,
                                                                      (stop - start,), (1,))
    copy = span.detach().clone()
    if any(t.requires_grad for t in views):  # a non-leaf, as ``clone()`` gives, which a forward may write
        copy = copy.requires_grad_().clone()
    return {id(t): (copy if t.requires_grad else copy.detach()).as_strided(t.size(), t.stride(),
                                                                           t.storage_offset() - start)
            for t in views}


# The alignment torch's allocators give a new tensor's memory (CPU: 64 bytes).  Vectorized kernels take
# different paths for memory that is not so aligned, and so round differently: a view into a tensor (the
# step ``x[:, t]`` an RNN cell reads) is copied at the same offset from it.
_ALIGNMENT = 64


def copy_with_layout(t):
    """A private copy with ``t``'s strides and its memory's offset from an aligned address: a reduction over a
    strided view (``z.real``) sums in a different order, and so to different bits, than over a contiguous
    copy, a kernel reading unaligned memory can round differently from one reading aligned memory, and a
    write to one element of an expanded tensor reaches every place it shows in.  A conjugate or negative view
    (``z.mH``) stays one, over a copy of its memory: a copy written out holds the values conjugated, and a
    kernel reading them (``matmul``) takes another path, to other bits, than one reading the lazy view."""
    if t.is_conj():
        return copy_with_layout(t.conj()).conj()
    if t.is_neg():
        return torch._neg_view(copy_with_layout(torch._neg_view(t)))
    if t.layout != torch.strided or t.is_nested:  # in that order: CSR has no strides
        return t.clone()
    shift = _misalignment(t)
    if not shift and t.is_contiguous():
        return t.clone()
    try:
        return _empty_at(t, shift).copy_(t)
    except RuntimeError:  # overlapping strides (an expanded tensor) cannot be written element by element
        return _copy_of_span(t)


def _misalignment(t) -> int:
    """How many elements ``t``'s first element lies past an aligned address (0 when unknown or aligned)."""
    if without_values(t):  # a meta or fake tensor: no memory, and torch warns when a fake one is asked for it
        return 0
    try:
        size, address = t.element_size(), t.data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0
    offset = address % _ALIGNMENT
    return offset // size if size and offset % size == 0 else 0


def _empty_at(t, shift: int):
    """An uninitialized tensor with ``t``'s shape and strides whose first element lies ``shift`` elements into
    freshly allocated (aligned) memory: a tensor of its own, not a view, as ``torch.empty_strided`` makes."""
    if not shift or t.numel() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    reach = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride())) + 1
    memory = torch.empty((shift + reach,), dtype=t.dtype, device=t.device).untyped_storage()
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(memory, shift, t.shape, t.stride())


def _copy_of_span(t):
    """A copy of the memory an overlapping view spans (``x.expand(3, 4)``: ``x``'s four elements), viewed with
    the view's strides: a reduction over it then sums in the order it did in the forward."""
    reach = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride())) + 1
    return t.as_strided((reach,), (1,)).clone().as_strided(t.shape, t.stride())


def copied_whole(module, copied) -> bool:
    """Whether ``copied``, a deep copy of ``module``, holds parameters and buffers of the same classes and layouts,
    and a tensor subclass's plain attributes.  A ``Parameter`` subclass whose ``__new__`` takes more than the data
    (a scale, a quantization state) loses those attributes in ``Parameter.__deepcopy__``, which rebuilds it from its
    data alone: the copy then computes otherwise, and the difference would be blamed on the trace.  (A plain
    parameter's attributes, tags such as an initialization flag, are lost too, and read by no op.)"""
    pairs = zip((*module.named_parameters(), *module.named_buffers()),
                (*copied.named_parameters(), *copied.named_buffers()))
    return all(name == copy_name and type(t) is type(c) and t.dtype == c.dtype and shape_or_none(t) == shape_or_none(c)
               and (type(t) in TENSOR_TYPES or _plain_attributes(t) == _plain_attributes(c))
               for (name, t), (copy_name, c) in pairs)


def _plain_attributes(t) -> dict:
    """A tensor's own attributes, the plain values by value and the others by class."""
    return {k: v if isinstance(v, (bool, int, float, str, bytes, type(None))) else type(v) for k, v in vars(t).items()}
