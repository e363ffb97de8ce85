"""References for intervention tests: the same edit made untraced by a forward hook, the identity action,
and a comparison of two traces' activations."""

from __future__ import annotations

import torch

from torchlens.tree import structures_equal


def with_hook(module, model, args, edit):
    """``model(*args)`` untraced, with ``edit`` as a forward hook on ``module`` (removed afterwards)."""
    handle = module.register_forward_hook(edit)
    try:
        with torch.no_grad():
            return model(*args)
    finally:
        handle.remove()


def keep(t, op):
    """The identity action: returning None keeps the op's value."""
    return None


def differing_activations(a, b, skip=()):
    """Labels whose activations differ between two traces of the same ops."""
    assert a.labels == b.labels
    differ = []
    for op_a, op_b in zip(a.ops, b.ops):
        if op_a.label in skip:
            continue
        x, y = op_a.activation, op_b.activation
        if (x is None) != (y is None) or (x is not None and not structures_equal(x, y)[0]):
            differ.append(op_a.label)
    return differ
