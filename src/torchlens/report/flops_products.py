"""FLOPs of the products over several operands or several dimensions: ``linalg.multi_dot`` and ``chain_matmul``
(a chain of matrices, multiplied in the cheapest order, as torch multiplies them) and ``tensordot`` (one
matrix product over the contracted dimensions, as torch reshapes it).  Each is counted as the matrix products
torch runs for it, 2 per multiply-add, so the counts meet ``FlopCounterMode``'s."""

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
