"""Shapes of tensors that have no single shape: nested (ragged) tensors.

A nested tensor (``torch.nested``, and the padding-mask path of eval ``nn.TransformerEncoder``) raises on
``.shape``.  Capture records it as a tuple with ``None`` for each irregular dimension, so a trace never
shows a plausible but wrong size; ``Op.numel`` and ``Op.nbytes`` then come from the components' sizes,
and every check of its values (NaN/Inf flags, the viewer's statistics) reads ``dense_values``.
"""

from __future__ import annotations

import torch


def shape_of(t: torch.Tensor) -> tuple:
    """``t.shape``, or for a nested tensor the shape with ``None`` for each irregular dimension."""
    try:
        return t.shape
    except RuntimeError:
        if not t.is_nested:
            raise
        return ragged_shape(t)


def numel_of(shape) -> int:
    """Elements of a tensor of recorded ``shape``; for a nested tensor's, its components' count."""
    if None in shape:
        return shape.numel
    n = 1
    for d in shape:
        n *= d
    return n


def dense_values(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a nested tensor its components' elements in one flat tensor: the reductions a check
    of values needs (``any``, ``all``, ``min``, ``sum``) have no nested kernels."""
    if not t.is_nested:
        return t
    return torch.cat([component.reshape(-1) for component in t.unbind()])


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
