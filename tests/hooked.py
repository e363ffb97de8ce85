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


def held_activations(trace) -> dict:
    """Each op's activation by label, cloned: a later forward that writes a buffer the trace holds by
    reference would make the trace drop that value (``Trace.drop_written``); the snapshot keeps it."""
    return {op.label: None if op.activation is None else op.activation.clone() for op in trace.ops}


def differing_activations(a, b, skip=()):
    """Labels whose activations differ between two traces of the same ops (``a`` may be a
    ``held_activations`` snapshot)."""
    held = a if isinstance(a, dict) else held_activations(a)
    assert list(held) == b.labels
    differ = []
    for label, op_b in zip(held, b.ops):
        if label in skip:
            continue
        x, y = held[label], op_b.activation
        if (x is None) != (y is None) or (x is not None and not structures_equal(x, y)[0]):
            differ.append(label)
    return differ
