"""FLOPs of the ``torch.fft`` transforms, counted as a radix-2 transform of the sizes torch transforms, whatever
algorithm its kernel picks for them."""

from __future__ import annotations

import math


def fft_flops(rank, kind, inverse: bool):
    """A ``torch.fft`` transform of ``rank`` 1, 2 or None (n-dimensional); ``kind`` ``"c2c"``, ``"r2c"`` (real
    input: ``rfft``, ``ihfft``) or ``"c2r"`` (real output: ``irfft``, ``hfft``); ``inverse`` for the ``i`` ones.
    The radix-2 count: n points take n/2 log2 n butterflies of a complex multiply (6 operations) and two complex
    adds (4), so 5 n log2 n over the transformed sizes' product n, half of that with a real side; a size that is
    no power of two is counted alike.  The 1/n scale of a normalised direction is a multiply per real output
    value."""
    def formula(a):
        given = a.value(1, "n" if rank == 1 else "s")
        given = (given,) if isinstance(given, int) else given
        default = -1 if rank == 1 else (-2, -1) if rank == 2 else None
        dims = _dims(a.value(2, "dim", default), given, len(a.out_shape))
        n = math.prod(_sizes(a, kind, given, dims))
        transforms = a.out_numel // math.prod(a.out_shape[d] for d in dims) if n else 0
        butterflies = (5 if kind == "c2c" else 2.5) * transforms * n * math.log2(n) if n else 0
        norm = a.value(3, "norm")
        scaled = norm == "ortho" or (norm in (None, "backward")) == inverse  # "backward": the inverse scales
        return round(butterflies) + scaled * (1 if kind == "c2r" else 2) * a.out_numel
    return formula


def _dims(dims, given, ndim: int) -> list:
    """The dimensions a transform runs over, counted from the front: ``dim=``, else the last ``len(s)``, else all."""
    if dims is None:
        dims = range(ndim - len(given), ndim) if given else range(ndim)
    return [d % ndim for d in ((dims,) if isinstance(dims, int) else dims)]


def _sizes(a, kind, given, dims) -> list:
    """The transformed sizes: the output's, except for a real input, whose output keeps n // 2 + 1 of the last
    dimension's n: then ``n=``/``s=`` where given (-1 in ``s``: the input's size), else the input's."""
    if kind != "r2c":
        return [a.out_shape[d] for d in dims]
    source = a.shape(0, "input")
    return [g if g not in (None, -1) else source[d] for g, d in zip(given or [None] * len(dims), dims)]
