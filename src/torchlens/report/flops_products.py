"""FLOPs of the products over several operands or several dimensions: ``linalg.multi_dot`` and ``chain_matmul``
(a chain of matrices, multiplied in the cheapest order, as torch multiplies them), ``tensordot`` (one
matrix product over the contracted dimensions, as torch reshapes it) and ``linalg.matrix_power`` (the squarings
and products of its binary decomposition).  Each is counted as the matrix products torch runs for it, 2 per
multiply-add, so the counts meet ``FlopCounterMode``'s.

Also the products that torch computes in one kernel ``FlopCounterMode`` has no entry for (it counts 0 inside
them): ``bilinear``, ``linalg.vecdot``, ``conv_tbc`` and ``cdist``, each counted as the other products are (2 per
multiply-add), and ``outer``/``kron``, whose every output element is one multiply (elementwise, as ``einsum``
counts ``i,j->ij``)."""

from __future__ import annotations

import math


def multi_dot_flops(a):
    """``torch.linalg.multi_dot(matrices)``: the matrices come in one list."""
    return _chain(a.nested_shapes())


def chain_matmul_flops(a):
    """``torch.chain_matmul(*matrices)``, which runs ``linalg.multi_dot`` on its matrices, passed one by one."""
    return _chain([a.shape(i) for i in range(a.arg_count)])


def _chain(shapes):
    """The chain's products in the order torch picks (the cheapest); None where a shape is unknown."""
    if len(shapes) < 2 or None in shapes:
        return None
    first, last = shapes[0], shapes[-1]  # a 1-D first operand is a row (1, k), a 1-D last one a column (k, 1)
    dims = [first[0] if len(first) == 2 else 1] + [s[-1] for s in shapes[:-1]] + [last[-1] if len(last) == 2 else 1]
    return 2 * _cheapest_chain(dims)


def _cheapest_chain(dims) -> int:
    """Multiply-adds of the cheapest order to multiply matrices of sizes dims[i] x dims[i + 1]."""
    n = len(dims) - 1
    cost = [[0] * n for _ in range(n)]
    for length in range(1, n):
        for i in range(n - length):
            j = i + length
            cost[i][j] = min(cost[i][k] + cost[k + 1][j] + dims[i] * dims[k + 1] * dims[j + 1]
                             for k in range(i, j))
    return cost[0][n - 1]


def tensordot_flops(a):
    """``torch.tensordot(x, y, dims)``: one multiply-add per output element and contracted element.  ``dims`` an
    int contracts the last ``dims`` dimensions of ``x``; a pair of lists names them.  Given as a tensor, it is
    not read (None: unknown)."""
    left, dims = a.shape(0, "a"), a.value(2, "dims", 2)
    if left is None or a.has_tensor(2, "dims"):
        return None
    if isinstance(dims, int):
        contracted = left[len(left) - dims:] if dims else ()
    else:
        named = dims[0]
        contracted = [left[d % len(left)] for d in ((named,) if isinstance(named, int) else named)]
    return 2 * a.out_numel * math.prod(contracted)


def matrix_power_flops(a):
    """``torch.linalg.matrix_power(A, n)``: ATen squares ``A`` once per bit of ``n`` past the first and multiplies
    the squares whose bit is set into the result, so ``bit_length(n) - 1 + popcount(n) - 1`` products of the
    (k, k) matrices (none for n 0 or 1).  A negative n first inverts ``A``, work no formula here counts: None."""
    n = a.value(1, "n")
    if not isinstance(n, int) or n < 0:
        return None
    products = n.bit_length() - 1 + bin(n).count("1") - 1 if n else 0
    return 2 * products * a.out_numel * a.out_shape[-1]


def bilinear_flops(a):
    """``F.bilinear(x1, x2, W, b)``, ``x1 W x2 + b`` with W (out, in1, in2): ATen's ``_trilinear`` contracts x1
    with W over in1, then that with x2 over in2, then adds the bias."""
    weight = a.shape(2, "weight")
    if weight is None:
        return None
    out, in1, in2 = weight
    rows = a.out_numel // out if out else 0
    return 2 * rows * out * in2 * (in1 + 1) + (a.out_numel if a.has_tensor(3, "bias") else 0)


def vecdot_flops(a):
    """``torch.linalg.vecdot(x, y, dim=-1)``: a multiply-add per output element and element of ``dim``, whose size
    is the broadcast one (an operand of size 1 there is read once per element of the other)."""
    shapes = [a.shape(0, "x"), a.shape(1, "y")]
    if None in shapes:
        return None
    ndim = len(a.out_shape) + 1  # the broadcast shape, before ``dim`` is summed out
    dim = a.value(None, "dim", -1) % ndim - ndim  # counted from the right, where broadcasting aligns the operands
    size = max(s[dim] if -dim <= len(s) else 1 for s in shapes)
    return 2 * a.out_numel * size


def conv_tbc_flops(a):
    """``torch.conv_tbc(input, weight, bias, pad)``: weight is (kernel, in, out), unlike a convolution's (out, in,
    kernel...), so the multiply-adds per output element are kernel x in; the bias is added to every one."""
    weight = a.shape(1, "weight")
    if weight is None:
        return None
    return 2 * a.out_numel * weight[0] * weight[1] + a.out_numel


def cdist_flops(a):
    """``torch.cdist(x1, x2, p)``: per output element (a pair of rows of m features) m subtractions, m absolute
    values or squares and m adds; a p other than 0, 1, 2 and inf also raises each difference to p (m more) and
    takes the root of the sum (1), p == 2 takes the square root alone."""
    left, p = a.shape(0, "x1"), a.value(2, "p", 2.0)
    if left is None or not isinstance(p, (int, float)):
        return None
    m = left[-1]
    per_pair = 3 * m
    if p not in (0, 1, 2, math.inf):
        per_pair += m + 1
    elif p == 2:
        per_pair += 1
    return per_pair * a.out_numel
