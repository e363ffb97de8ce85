"""Interventions: change what an op or module call produces, by its address, and trace what follows.

``tl.trace(model, x, intervene={site: action})`` and ``tl.trace(model, x, stop_after=site)``.  Sites and
their resolution live in ``sites``, the helpers users pass as actions in ``actions``, and the code that
runs during the forward in ``runtime``.
"""

from __future__ import annotations

import torch

from ..capture.rng import RngState
from .actions import Action, clamp, mean_ablate, noise, patch_from, scale, steer, zero_ablate
from .runtime import Applied, Interventions, StopForward
from .sites import resolve_labels, split_sites

__all__ = ["Action", "Applied", "Interventions", "StopForward", "clamp", "mean_ablate", "noise", "patch_from",
           "prepare", "scale", "steer", "zero_ablate"]


def prepare(model, *, intervene, stop_after, reference, index, keep_originals: bool, run_reference):
    """The runtime for one intervened trace, or None when nothing is asked.  Label sites are resolved
    against ``reference`` or, when None, a metadata-only trace made here by ``run_reference()``."""
    if not intervene and stop_after is None:
        return None
    if intervene is not None and not isinstance(intervene, dict):
        raise TypeError(f"intervene= takes a dict {{site: action}}, got {type(intervene).__name__}")
    module_sites, pending = split_sites(model, intervene or {}, stop_after)
    label_sites = []
    if pending or (stop_after is not None and reference is not None):
        if reference is None:
            reference = _reference_pass(run_reference, index)
        label_sites = resolve_labels(reference, pending)
    runtime = Interventions(label_sites, module_sites, index, keep_originals)
    runtime.reference = reference
    return runtime


def _reference_pass(run_reference, index):
    """A metadata-only trace of the same inputs that leaves the RNG and the buffers as it found them, so the
    intervened run sees the same random numbers and running statistics a plain trace would."""
    rng = RngState()
    buffers = [(b, b.detach().clone()) for b, _ in index.buffers.values()]
    try:
        return run_reference()
    finally:
        rng.restore()
        with torch.no_grad():
            for buffer, value in buffers:
                if not torch.equal(buffer, value):
                    buffer.copy_(value)
