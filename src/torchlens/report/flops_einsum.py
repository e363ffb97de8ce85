"""FLOPs of ``torch.einsum``, counted the way torch computes it.

``torch.einsum`` (ATen's ``einsum``) aligns every operand to one set of labels (an ellipsis stands for the
dimensions it covers, aligned from the right and broadcast), takes diagonals for labels repeated within an
operand (views), then contracts the operands pairwise: left to right, or in the order ``opt_einsum`` picks
for three operands or more when ``torch.backends.opt_einsum`` is available and enabled.  In each pair a
summed label that only one of the two still has at a size other than 1, and no later operand needs, is summed
out of that operand first; the pair is then one batched matrix product (``aten.bmm``) when some label is
summed over both, else an elementwise multiply.  A single operand is only summed.

So the count is split as the work is: the batched products are matmul (2 per multiply-add, what
``FlopCounterMode`` counts for the same call), the sums are other (1 per element read, as ``sum`` counts),
the multiplies elementwise (1 per output element).  A dimension of size 1 is broadcast and costs nothing.
"""

from __future__ import annotations

import math

ELLIPSIS = "..."


def einsum_flops(equation: str, shapes: list) -> dict:
    """``{family: flops}`` of ``torch.einsum(equation, *operands)`` for operands of ``shapes``."""
    terms, output = _parse(equation)
    if len(terms) != len(shapes):
        raise ValueError(f"einsum equation {equation!r} names {len(terms)} operands, the call passed {len(shapes)}")
    ellipsis_dims = max([len(s) - len(t) + 1 for t, s in zip(terms, shapes) if ELLIPSIS in t] + [0])
    operands = [_aligned(term, shape, ellipsis_dims) for term, shape in zip(terms, shapes)]
    kept = _output_labels(terms, output, ellipsis_dims)
    summed = {label for term, shape in zip(terms, shapes) for label in _labels(term, len(shape), ellipsis_dims)}
    summed -= kept
    counts = {"matmul": 0, "other": 0, "elementwise": 0}
    if len(operands) == 1:
        counts["other"] = math.prod(operands[0].values()) if summed else 0  # one sum over the summed labels
    else:
        _contract(operands, summed, _torch_path(equation, shapes), counts)
    return {family: n for family, n in counts.items() if n or family == "matmul"}


def _parse(equation: str):
    """``([labels per operand], output labels or None when implicit)``; a label is a letter or ``...``."""
    inputs, arrow, output = equation.replace(" ", "").partition("->")
    terms = [_tokens(term) for term in inputs.split(",")]
    return terms, _tokens(output) if arrow else None


def _tokens(term: str) -> list:
    tokens, i = [], 0
    while i < len(term):
        if term.startswith(ELLIPSIS, i):
            tokens.append(ELLIPSIS)
            i += len(ELLIPSIS)
        elif term[i].isalpha():
            tokens.append(term[i])
            i += 1
        else:
            raise ValueError(f"einsum subscript {term[i]!r} is neither a letter nor part of '...'")
    return tokens


def _labels(term, ndim: int, ellipsis_dims: int) -> list:
    """One label per dimension of an operand; the ellipsis's dimensions are ``(ELLIPSIS, j)``, right-aligned
    to the widest ellipsis so that they broadcast against each other."""
    labels = []
    for token in term:
        if token == ELLIPSIS:
            covered = ndim - len(term) + 1
            labels += [(ELLIPSIS, j) for j in range(ellipsis_dims - covered, ellipsis_dims)]
        else:
            labels.append(token)
    return labels


def _aligned(term, shape, ellipsis_dims: int) -> dict:
    """``{label: size}`` of an operand's dimensions of size other than 1 (size 1 broadcasts); a label repeated
    within the operand is its diagonal, one dimension."""
    labels = _labels(term, len(shape), ellipsis_dims)
    if len(labels) != len(shape):
        raise ValueError(f"einsum subscripts {''.join(term)!r} do not match an operand of shape {tuple(shape)}")
    return {label: size for label, size in zip(labels, shape) if size != 1}


def _output_labels(terms, output, ellipsis_dims: int) -> set:
    """The labels kept: the explicit output's, or (implicit) the ellipsis and the letters used once."""
    letters = [token for term in terms for token in term if token != ELLIPSIS]
    if output is None:
        kept = {letter for letter in letters if letters.count(letter) == 1}
        return kept | {(ELLIPSIS, j) for j in range(ellipsis_dims)}
    kept = {token for token in output if token != ELLIPSIS}
    return kept | ({(ELLIPSIS, j) for j in range(ellipsis_dims)} if ELLIPSIS in output else set())


def _contract(operands, summed, path, counts) -> None:
    """Contract the operands pairwise as ATen's einsum does, adding each step's FLOPs to ``counts``."""
    ops = list(operands)
    left = {label: sum(label in op for op in ops) for label in summed}  # operands still holding each label
    steps = iter(path) if path is not None else None
    while len(ops) > 1:
        i, j = sorted(next(steps)) if steps is not None else (0, 1)
        a, b = ops[i], ops[j]
        del ops[j], ops[i]
        both = _summed_in_pair(a, b, left)
        a, b = _presum(a, left, counts), _presum(b, left, counts)
        result = _product(a, b, both, counts)
        ops.insert(len(ops) if steps is not None else 0, result)


def _summed_in_pair(a: dict, b: dict, left: dict) -> set:
    """Summed labels both operands hold that no other operand still needs: the product sums them."""
    both = set()
    for label in left:
        if label in a and label in b:
            left[label] -= 1
            if left[label] == 1:
                both.add(label)
                left[label] = 0
    return both


def _presum(op: dict, left: dict, counts) -> dict:
    """Sum out of one operand the summed labels only it still holds (one ``sum`` call, 1 per element read)."""
    alone = [label for label in op if label in left and left[label] == 1]
    if not alone:
        return op
    for label in alone:
        left[label] = 0
    counts["other"] += math.prod(op.values())
    return {label: size for label, size in op.items() if label not in alone}


def _product(a: dict, b: dict, summed: set, counts) -> dict:
    """One ``bmm`` over every label of the pair when it sums some, else a broadcast multiply."""
    union = {**a, **b}
    if summed:
        counts["matmul"] += 2 * math.prod(union.values())
    else:
        counts["elementwise"] += math.prod(union.values())
    return {label: size for label, size in union.items() if label not in summed}


def _torch_path(equation: str, shapes):
    """The pairwise order ``torch.einsum`` passes ATen for three operands or more: ``opt_einsum``'s, under
    ``torch.backends.opt_einsum``'s current settings, when it is available and enabled; else None (left to
    right)."""
    from torch.backends import opt_einsum

    if len(shapes) <= 2 or not opt_einsum.enabled or not opt_einsum.is_available():
        return None
    module = opt_einsum.get_opt_einsum()
    return module.contract_path(equation, *shapes, shapes=True, optimize=opt_einsum.strategy)[0]
