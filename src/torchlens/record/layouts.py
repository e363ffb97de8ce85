"""Shapes of tensors that have no single shape: nested (ragged) tensors; the values of those and of
sparse tensors, read for checks of values; and the bytes of its storage a strided tensor reaches.

A nested tensor (``torch.nested``, and the padding-mask path of eval ``nn.TransformerEncoder``) raises on
``.shape``, or, in the jagged layout, answers with symbolic sizes.  Capture records it as a tuple with
``None`` for each irregular dimension, so a trace never shows a plausible but wrong size; ``Op.numel`` and
``Op.nbytes`` then come from the components' sizes, and every check of its values (NaN/Inf flags, the
viewer's statistics) reads ``dense_values``.
"""

from __future__ import annotations

from operator import attrgetter

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..tree import TENSOR_TYPES, is_uninitialized

_VERSION = attrgetter("_version")
_REQUIRES_GRAD = attrgetter("requires_grad")
_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")


def shape_of(t: torch.Tensor) -> tuple:
    """``t.shape``, or for a nested tensor a ``RaggedShape``, ``None`` for each irregular dimension: a strided
    one raises on ``.shape``, and a jagged one (``layout=torch.jagged``) answers with symbolic sizes (``j1``)
    that are no numbers, so its elements are counted from its values."""
    try:
        shape = t.shape
    except RuntimeError:
        if not t.is_nested:
            raise
        return ragged_shape(t)
    # A jagged nested tensor is a subclass: a plain tensor is not asked (under a capture mode, reading a
    # property of a tensor is a call the mode handles).
    if type(t) not in TENSOR_TYPES and t.is_nested:
        return RaggedShape([d if type(d) is int else None for d in shape], t.values().numel())
    return shape


def shape_text(shape) -> str:
    """A recorded shape as text, ``4x16``: ``scalar`` for no dimensions, ``?`` for a nested tensor's
    irregular one (``shape_of``'s ``None``)."""
    return "x".join("?" if d is None else str(d) for d in shape) or "scalar"


def numel_of(shape) -> int:
    """Elements of a tensor of recorded ``shape``; for a nested tensor's, its components' count."""
    if None in shape:
        return shape.numel
    n = 1
    for d in shape:
        n *= d
    return n


_SPARSE_LAYOUTS = frozenset([torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                             torch.sparse_bsc])


# Float8 dtypes have no CPU kernels for ``isfinite``, ``min``, ``max`` or norms; each value is a float32
# exactly (NaN and Inf included), so they are read as float32.
_FLOAT8 = frozenset([torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
                     torch.float8_e8m0fnu])


# float4_e2m1fn_x2 packs two 4-bit floats in each byte, which torch has no kernel to widen; read through the 16
# values a 4-bit float can be (it has no NaN or Inf), each exact in float32.
_FLOAT4 = getattr(torch, "float4_e2m1fn_x2", None)
_FLOAT4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dense_values(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the elements of a tensor whose layout or dtype the reductions a check of values needs
    (``any``, ``all``, ``min``, ``sum``, ``isfinite``) have no kernels for: a nested tensor's components'
    elements, in one flat tensor; a sparse tensor's stored values (summed where an index repeats), with one
    zero more when some elements are implicit zeros, so that its min, max, norm and NaN/Inf count are those
    of the dense tensor it stands for, without making that tensor; a float8 tensor's values as float32,
    which holds each of them exactly (a float4 tensor's two per element); a quantized tensor's dequantized values."""
    if t.is_nested:
        t = torch.cat([component.reshape(-1) for component in t.unbind()])
    elif t.layout in _SPARSE_LAYOUTS:
        t = _sparse_values(t)
    if t.dtype in _FLOAT8:
        return t.float()
    if t.dtype is _FLOAT4:
        packed = t.view(torch.uint8).reshape(-1)
        codes = torch.cat((packed & 15, packed >> 4)).long()
        return torch.tensor(_FLOAT4_VALUES, device=t.device)[codes]
    if t.is_quantized:
        return t.dequantize()
    return t


def magnitudes(t: torch.Tensor) -> torch.Tensor:
    """``|z|`` of a complex tensor's values, which the statistics of a complex value are taken of.  A complex64
    (or complex32) number whose parts are finite can have a magnitude past its float32 (float16) parts' largest
    number (``2.5e38 + 2.5e38j``): those are taken again in float64, so that no Inf is counted that the values
    do not hold."""
    values = t.abs()
    if t.dtype in (torch.complex64, torch.complex32) and not bool(torch.isfinite(values).all()):
        values = t.to(torch.complex128).abs()
    return values


def held_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s own elements, as ``max_saved_bytes`` and ``Trace.saved_bytes`` count a saved tensor:
    its elements times their size, or for a sparse tensor the indices and values it stores (a 1000 x 1000
    matrix of three entries holds three values, not a million)."""
    layout = t.layout
    if layout not in _SPARSE_LAYOUTS:
        return t.numel() * t.element_size()
    if layout == torch.sparse_coo:
        parts = (t._indices(), t._values())
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values())
    else:
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    return sum(part.numel() * part.element_size() for part in parts)


def _sparse_values(t: torch.Tensor) -> torch.Tensor:
    """A sparse tensor's values, flat, and a zero for its implicit elements if it has any."""
    values = (t.coalesce().values() if t.layout == torch.sparse_coo else t.values()).reshape(-1)
    if values.numel() < t.numel():
        values = torch.cat([values, values.new_zeros(1)])
    return values


def ragged_shape(t: torch.Tensor) -> "RaggedShape":
    sizes = t._nested_tensor_size()  # one row of sizes per component
    dims = [t.size(0)]
    for d in range(sizes.shape[1]):
        column = sizes[:, d]
        dims.append(int(column[0]) if bool((column == column[0]).all()) else None)
    return RaggedShape(dims, int(sizes.prod(1).sum()))


class RaggedShape(tuple):
    """A nested tensor's shape: ``None`` where components differ; ``numel`` counts every component."""

    def __new__(cls, dims, numel: int):
        shape = super().__new__(cls, dims)
        shape.numel = numel
        return shape

    def __eq__(self, other):  # two ragged shapes with the same pattern may hold different counts
        return tuple.__eq__(self, other) and getattr(other, "numel", None) == self.numel

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash((tuple(self), self.numel))

    def __getnewargs__(self):
        return tuple(self), self.numel


def version_of(t: torch.Tensor):
    """``t._version``, or None for an inference tensor, which has no version counter."""
    try:
        return t._version
    except RuntimeError:
        return None


def param_versions(params: list) -> list:
    """Each parameter's version counter, by a C-level pass; None for an inference tensor (a model built under
    ``torch.inference_mode()``), which has none.  Read as every trace begins and ends: torchlens-accel's
    ``_reads`` reads them off the TensorImpls, without a binding call per parameter, where it can answer."""
    reads = _compiled_reads()
    versions = reads.versions(params) if reads is not None else None
    if versions is not None:
        return versions
    try:
        return list(map(_VERSION, params))
    except RuntimeError:
        return list(map(version_of, params))


def requires_grad_flags(params: list) -> list:
    """Each parameter's requires_grad flag, by a C-level pass (read as a trace ends, for replay); off the
    TensorImpls with torchlens-accel's ``_reads``, where it can answer."""
    reads = _compiled_reads()
    flags = reads.requires_grad(params) if reads is not None else None
    return flags if flags is not None else list(map(_REQUIRES_GRAD, params))


def param_layouts(params: list, known: list | None) -> list:
    """Each parameter's ``(shape, dtype)`` as a trace ends: ``known`` (what an earlier trace of the same parameters
    kept) while every one still matches it, checked by a C-level pass, else read anew.  A parameter's data can be
    replaced without a new ``Parameter`` and without moving its version counter (``model.half()``, ``p.data =
    ...``, transformers' ``resize_token_embeddings``): a trace keeps the layouts its forward read, not the live
    ones.  torchlens-accel's ``_reads`` compares them off the TensorImpls, where it can answer."""
    reads = _compiled_reads()
    same = reads.same_layouts(params, known) if reads is not None and known is not None else None
    if same:
        return known
    try:
        now = list(zip(map(_SHAPE, params), map(_DTYPE, params)))
    except RuntimeError:  # a lazy module's parameter its forward did not materialize has no shape yet
        now = list(map(_layout_if_any, params))
    return known if same is None and now == known else now


def _layout_if_any(p) -> tuple | None:
    """``(shape, dtype)``, or None for an uninitialized parameter (``nn.LazyLinear``'s before its first call)."""
    return None if is_uninitialized(p) else (p.shape, p.dtype)


def _compiled_reads():
    """torchlens-accel's ``_reads`` when capture uses it, else None."""
    global _accel
    if _accel is None:
        from ..capture import accel  # imported here, not above: capture imports record

        _accel = accel
    return _accel.compiled("_reads")


_accel = None  # capture.accel, once imported


def memory_span(t: torch.Tensor):
    """``(start, end, element size, shape, strides)``: the bytes of its storage a tensor can reach (``start``
    to ``end``, end excluded) and the layout that says which of them it holds, or None when unknown (a
    layout without strides).  Two views of one storage whose spans do not meet cannot see each
    other's writes, although they share a version counter (``torch.chunk``'s pieces, a tensor's halves);
    a storage smaller than ``end`` no longer holds the tensor (its memory was freed)."""
    try:
        if t.layout is not torch.strided:  # sparse layouts answer some of the reads below, wrongly for this
            return None
        if t.numel() == 0:
            return 0, 0, 0, (), ()
        size = t.element_size()
        start = t.storage_offset() * size
        shape, strides = tuple(t.shape), t.stride()
        reach = sum((n - 1) * stride for n, stride in zip(shape, strides))
        return start, start + (reach + 1) * size, size, shape, strides
    except (RuntimeError, NotImplementedError, TypeError):
        return None


# References to a storage, by its ``_cdata``.
storage_use_count = torch._C._storage_Use_Count


def storage_holders(t: torch.Tensor) -> int:
    """How many references hold ``t``'s memory, counting the storage object the count is read through (so
    at least 2); a large number where torch cannot say."""
    try:
        return storage_use_count(t.untyped_storage()._cdata)
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):
        return 1 << 30


def holds_more_than_itself(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds more bytes than its own elements (a view of part of a larger tensor):
    kept or sent as it is, ``t`` would keep or send the rest too.  False for layouts without one storage."""
    if t.layout is not torch.strided or t.is_nested:
        return False
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()


def spans_meet(a, b) -> bool:
    """Whether two ``memory_span``s may share a byte (an unknown span may share any).  Spans that overlap
    may still hold no common byte: the column halves of a matrix (``x.chunk(2, dim=-1)``) interleave."""
    if a is None or b is None:
        return True
    if not (a[0] < b[1] and b[0] < a[1]):
        return False
    return not _interleaved_apart(a, b)


def _interleaved_apart(a, b) -> bool:
    """Whether two overlapping spans with the same element size provably share no element.

    Each span's elements are its first one plus whole steps along its strides (a dimension of one element,
    or of stride 0, adds none).  Both are placed in one box over the strides of either, and of 1:
    ``b``'s first element is ``a``'s plus a whole number of steps of each (found from the largest stride
    down).  When that box reaches each element at most once, elements are the same only where their
    coordinates are, so the two are apart when their ranges along one stride do not meet.  Any other case
    (a stride that two dimensions of one tensor share, a box that reaches an element twice) answers False:
    they may meet."""
    if a[2] != b[2]:
        return False
    extents_a, extents_b = _extents_by_stride(a), _extents_by_stride(b)
    if extents_a is None or extents_b is None:
        return False
    if b[0] < a[0]:
        (a, extents_a), (b, extents_b) = (b, extents_b), (a, extents_a)
    delta, rest = divmod(b[0] - a[0], a[2])
    if rest:
        return False
    strides = sorted(set(extents_a) | set(extents_b) | {1}, reverse=True)
    steps = {}
    for stride in strides:
        steps[stride], delta = divmod(delta, stride)
    inner = 0  # the furthest the box's smaller strides reach, in elements
    for stride in reversed(strides):
        size = max(extents_a.get(stride, 1), steps[stride] + extents_b.get(stride, 1))
        if size > 1:
            if stride <= inner:
                return False  # the box reaches some element twice: coordinates do not tell elements apart
            inner += (size - 1) * stride
    return any(steps[stride] >= extents_a.get(stride, 1) for stride in strides)


def _extents_by_stride(span):
    """``{stride: number of elements}`` along each dimension of a span's tensor that has more than one distinct
    element, or None when two of them share a stride."""
    extents = {}
    for size, stride in zip(span[3], span[4]):
        if size > 1 and stride > 0:
            if stride in extents:
                return None
            extents[stride] = size
    return extents


def memory_freed(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage no longer covers ``t`` (``untyped_storage().resize_(0)``, as FSDP2 frees its
    unsharded parameters): torch does not check, so a read would touch freed memory and may crash."""
    span = memory_span(t)
    if span is None or span[1] == 0:
        return False  # nested, sparse and other layouts without one strided storage; an empty tensor
    return t.untyped_storage().nbytes() < span[1]


def row_major_strides(shape) -> tuple:
    """The strides torch gives a new tensor of ``shape`` (an empty dim counts as size 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def permuted_strides(t) -> list | None:
    """``t``'s strides when its elements fill their memory without gaps in an order other than row-major
    (channels_last, a transpose): what a copy written in row order needs to be laid out as ``t`` is; None
    for a row-major tensor, and for one with gaps or overlaps, whose layout a copy of its values cannot keep (an
    empty tensor has neither, whatever its strides).
    Row-major means torch's own strides for the shape: ``is_contiguous()`` ignores a size-1 or empty dim's
    stride, which ``(x * 1).t()`` of an ``(n, 1)`` ``x`` sets otherwise, and a copy must keep it too."""
    if t.layout != torch.strided or t.is_nested or t.stride() == row_major_strides(t.shape):
        return None
    if t.numel() == 0:  # no element, no memory to leave a gap in: any strides (a slice's of its base) are kept
        return list(t.stride())
    expected = 1  # the stride the next dimension, innermost first, must have to leave no gap
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride != expected:
            return None
        expected *= size
    return list(t.stride())


def alias_key(t: torch.Tensor):
    """One key for saved tensors that are the same elements: an op that requires grad is saved as its output's
    ``detach()``, so an op returning its argument itself (eval-mode dropout, ``contiguous()`` of a contiguous
    tensor) saves a second object over its parent's saved elements, which holds no more.  A plain strided tensor
    with memory is keyed by where its elements lie and how they are read (a lazy conjugate or negative view reads
    the same memory as other values); any other tensor (meta, sparse, nested, quantized, a subclass) by itself."""
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_nested or t.is_quantized \
            or t.device.type == "meta":
        return id(t)
    address = t.untyped_storage().data_ptr()
    if not address:  # no memory (an empty tensor, or one whose storage was freed): nothing to share
        return id(t)
    return address, t.device, t.storage_offset(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg()


def storage_key(t: torch.Tensor) -> int:
    """Identity of the memory a tensor lives in; views share it with their base.  A storage with no memory (a
    meta or fake tensor's, or an empty one) has address 0, which every such storage shares: it is told apart by
    its own identity instead, without asking a fake tensor for an address (which torch warns against)."""
    try:
        storage = t.untyped_storage()
        if storage.device.type == "meta":
            return storage._cdata
        return storage.data_ptr() or storage._cdata
    # Sparse and other storage-less layouts; a lazy module's UninitializedParameter refuses with ValueError
    # (it has no memory until its first forward materializes it).
    except (RuntimeError, NotImplementedError, ValueError):
        inner = _first_inner(t)
        if inner is not None:
            return storage_key(inner)
        # Another tensor without memory: its views still know their base (which they keep alive, id and all).
        base = t._base
        return -id(t if base is None else base)


def storage_keys(t: torch.Tensor) -> list:
    """``[storage_key(t)]``, or for a wrapper subclass wrapping several tensors (``TwoTensor``) the key of each: a
    write to it writes them all, where its own key names the first alone."""
    inner = wrapped_tensors(t)
    return [key for wrapped in inner for key in storage_keys(wrapped)] if len(inner) > 1 else [storage_key(t)]


def _first_inner(t: torch.Tensor):
    """The first tensor a wrapper subclass (``TwoTensor``, ``DTensor``) keeps its data in, or None.  The wrapper has
    no memory of its own, but its views and detached copies wrap views of that same tensor: keyed by it, a write
    through one of them reaches what was saved of the others, as for plain tensors."""
    inner = wrapped_tensors(t)
    return inner[0] if inner else None


def wrapped_tensors(t: torch.Tensor) -> list:
    """The tensors a traceable wrapper subclass keeps its data in (``TwoTensor``'s two, ``DTensor``'s local shard),
    in ``__tensor_flatten__``'s order; ``[]`` for any other tensor."""
    if type(t) in TENSOR_TYPES or not is_traceable_wrapper_subclass(t):
        return []
    names, _ = t.__tensor_flatten__()
    return [getattr(t, name) for name in names]


def holds_unknown_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` is a strided wrapper subclass with no memory of its own that names no tensor it wraps: its
    aliases share no memory capture can read, only their base (``storage_key``)."""
    if t.layout != torch.strided or is_traceable_wrapper_subclass(t):
        return False
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:
        return True
    return False


def same_elements(new: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether ``new`` reads exactly the elements ``old`` reads, as they are: the same memory at the same offset and
    strides (of equal shapes, a dimension of size 1 is never stepped along, and ``view_as`` may give it another
    stride), and no conjugate or negative bit of its own.  An intervention returning such an alias
    (``t.view_as(t)``) changes no value an op after its site reads."""
    if new.layout != torch.strided or new.is_nested or storage_key(new) != storage_key(old):
        return False
    strides = [(a, b) for a, b, size in zip(new.stride(), old.stride(), old.shape) if size != 1]
    return (new.storage_offset() == old.storage_offset() and all(a == b for a, b in strides)
            and new.is_conj() == old.is_conj() and new.is_neg() == old.is_neg())


def sharing_bytes(tensors: list) -> list:
    """The distinct tensors among ``tensors`` (those one call wrote) that may share a byte with another of them."""
    reached = [(storage_key(t), memory_span(t), t) for t in tensors]
    return [t for key, span, t in reached
            if any(key == other_key and t is not other and spans_meet(span, other_span)
                   for other_key, other_span, other in reached)]
