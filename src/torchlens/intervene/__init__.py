"""Interventions: change what an op or module call produces, by its address, and trace what follows.

``tl.trace(model, x, intervene={site: action})`` and ``tl.trace(model, x, stop_after=site)``.  Sites and
their resolution live in ``sites``, the helpers users pass as actions in ``actions``, and the code that
runs during the forward in ``runtime``.
"""

from __future__ import annotations

import contextlib

from ..capture.restore import FirstCalls, ForwardState
from ..errors import InterventionError, add_note
from ..record.modules import is_unregistered
from ..record.trace import checked_trace
from .actions import Action, clamp, mean_ablate, noise, patch_from, scale, steer, zero_ablate
from .runtime import Applied, Interventions, StopForward
from .sites import resolve_labels, split_sites

__all__ = ["Action", "Applied", "Interventions", "StopForward", "clamp", "mean_ablate", "noise", "patch_from",
           "prepare", "scale", "steer", "zero_ablate"]


def prepare(model, *, intervene, stop_after, reference, index, keep_originals: bool, run_reference,
            compiled: str = "run", deep=False):
    """The runtime for one intervened trace, or None when nothing is asked.  Label sites are resolved
    against ``reference`` or, when None, a metadata-only trace made here by ``run_reference()``.
    ``compiled``: how torch.compile'd submodules run (``tl.trace``'s option), which decides whether a module
    inside one can be a site."""
    if intervene is not None and not isinstance(intervene, dict):  # first: intervene="" or 0 is no empty dict
        raise TypeError(f"intervene= takes a dict {{site: action}}, got {type(intervene).__name__}")
    if not intervene and stop_after is None:
        return None
    if reference is not None:
        checked_trace(reference, "reference=", "tl.trace(model, x) of a run taking the same path")
        _refuse_another_models(reference, index)
    module_sites, pending = split_sites(model, intervene or {}, stop_after, compiled, index)
    label_sites, made = [], False
    if pending or (stop_after is not None and reference is not None):
        if reference is None:
            reference, made = _reference_pass(run_reference, index), True
        label_sites = resolve_labels(reference, pending, deep)
    runtime = Interventions(label_sites, module_sites, index, keep_originals)
    runtime.reference, runtime.reference_made, runtime.deep = reference, made, deep
    return runtime


def _refuse_another_models(reference, index) -> None:
    """Refuse a reference traced from a model of another make, none of whose modules is one of this model's: its
    labels name that model's ops, and a site it lacks was refused as naming nothing "in this trace" (which the
    user's trace may well hold), one it holds as the forward taking another path.  A copy of this model (the same
    module classes at the same addresses) is left to the site-by-site checks of the path."""
    ours = index.modules if index is not None else {}
    theirs = {row.address: row.ref for row in reference._module_rows
              if row.ref is not None and not is_unregistered(row.address)}
    if not ours or not theirs or not {id(m) for m in ours.values()}.isdisjoint(id(m) for m in theirs.values()):
        return  # a loaded reference holds no modules to compare, and a module-less model none to compare them with
    other = next((address for address, module in theirs.items() if type(ours.get(address)) is not type(module)), None)
    if other is None:
        return
    raise InterventionError(f"reference= is a trace of another model ({reference.model_name}, whose {other} is a "
                            f"{type(theirs[other]).__name__}, which this model does not have there): its labels name "
                            "that model's ops; pass reference= a trace of this model, or none (a reference pass is "
                            "then made first)")


def _reference_pass(run_reference, index):
    """A metadata-only trace of the same inputs that leaves the model as it found it (``ForwardState``), so
    that the intervened run takes the path a plain trace would: the same random numbers, running statistics
    updated once, a cache or flag set by the first forward set by the intervened one.  A forward that writes
    a parameter in place is undone only once that parameter is known: the first time, it is refused, after the
    pass, and a later call keeps its value (``ForwardState``)."""
    modules = index.all_modules()
    state = ForwardState(modules, index.params, [b for b, _ in index.buffers.values()], modules[0] if modules else None)
    # A callable traced without root= names no modules: they are met as it runs.
    meeting = contextlib.nullcontext() if modules else FirstCalls(state.add)
    try:
        with meeting:
            reference = run_reference()
    except BaseException as exc:
        state.restore()
        add_note(exc, "torchlens: raised in the extra forward that resolves label sites, before the intervened run; "
                      "nothing is left installed, and the model and the random number generators are as before it")
        raise
    written = state.written_params()
    if written:
        state.rng.restore()  # the rest is left as after the forward: its parameter writes and their state agree
        cause, lazy = state.written_cause(written, ": a one-time rescale, a renormalization, an update")
        again = "they are made now (run one forward, model(x), before tracing a model with lazy modules)" if lazy \
            else "those parameters are now known, and the extra forward puts them back"
        raise InterventionError(
            f"{cause}, so the extra forward that resolves label sites changed the model the intervened run would "
            f"start from; the model has now run that forward once. Run the intervention again: {again}. Or pass "
            "reference= a trace of the model as it will run, or use module sites, which need no extra forward")
    state.restore()
    return reference
