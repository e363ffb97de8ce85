"""Why a record holds no activation where its op made one: the reasons a trace gives, in ``op.dropped_reason``
and ``log.dropped_activations``, for a saved tensor it let go, so that every reader (validate, the debug
readers, the gradient readers) can tell the causes apart; and ``drop_written``, which lets go of the saved tensors
written or freed since their op ran.
"""

from __future__ import annotations

from ..checks import as_position, check_int, is_a
from ..tree import without_values
from .layouts import holds_unknown_memory, memory_freed

# Why ``drop_written`` dropped a saved tensor (validate reads it as a mismatch: the record no longer holds it).
WRITTEN_AFTER_TRACE = ("written in place after the trace ended (a later forward updating a buffer the trace holds "
                       "by reference, or code changing an input or the output); read activations, or .clone() "
                       "them, before running the model again")
# Why ``drop_written`` dropped a saved tensor whose memory is a parameter's (the op returned the parameter or a
# view of it: ``w.t()``, ``w[:k]``) written since: an optimizer step, not a wrong value, so validate skips it.
PARAM_WRITTEN_AFTER_TRACE = ("its memory is parameter {}'s (the op returned the parameter or a view of it), which "
                             "was written in place after the trace ended (an optimizer step?); read activations, "
                             "or .clone() them, before updating the parameters")


def is_param_written(reason) -> bool:
    """Whether a dropped activation's reason is ``PARAM_WRITTEN_AFTER_TRACE``."""
    head, _, tail = PARAM_WRITTEN_AFTER_TRACE.partition("{}")
    return isinstance(reason, str) and reason.startswith(head) and reason.endswith(tail)


# Why ``drop_written`` dropped a saved tensor whose memory is gone: reading it would read freed memory.
MEMORY_FREED = ("its memory was freed after the op made it (its storage resized down: FSDP2 frees each module's "
                "unsharded parameters after its forward, fully_shard(..., reshard_after_forward=False) keeps them)")

# Why capture dropped a saved tensor whose version moved with no write it saw.  Writes through ``.data`` are
# ops capture sees, and NumPy views do not move a version: neither is a cause here.
WRITTEN_UNSEEN = ("mutated after capture saved it, by a write capture could not see (one made on another thread, "
                  "code running with torch function handling disabled, TorchScript, a custom autograd.Function's "
                  "ctx.mark_dirty, which counts as a write of the tensor it marks, or Tensor.set_, which puts the "
                  "tensor on other memory)")
# Why capture dropped a saved tensor of a wrapper subclass that has no memory of its own and does not say which
# tensor it wraps: capture relates its views to it through their base, but not a copy detached from it (which is
# what is saved of a tensor that requires grad), so a write it saw may be the one that moved its version.
WRITTEN_THROUGH_UNKNOWN_ALIAS = (
    "mutated after capture saved it, through an alias capture could not relate to it, or by a write capture could not "
    "see: a {} tensor subclass has no memory of its own, and this one does not say which tensor it wraps; define "
    "__tensor_flatten__ (a traceable wrapper subclass), so that its views and detached copies share that tensor's "
    "memory and a write through them is followed")
# Why capture dropped a saved tensor made inside a torch.func transform.
MADE_IN_TRANSFORM = ("made inside a torch.func transform (vmap, grad, ...): what was saved is the transform's "
                     "internal wrapper, which cannot be read outside it")


def all_made_in_transform(trace) -> bool:
    """Whether every activation the trace dropped was a torch.func transform's wrapper, and it dropped some: a
    trace taken inside ``vmap`` or ``grad``, whose values no reader can have."""
    return bool(trace._dropped) and all(reason == MADE_IN_TRANSFORM for reason in trace._dropped.values())


def why_stale(t) -> str:
    """Why capture drops a saved tensor whose version moved with no write it related to that tensor."""
    if memory_freed(t):  # FSDP2's resharding: the write that matters is the free
        return MEMORY_FREED
    if holds_unknown_memory(t):
        return WRITTEN_THROUGH_UNKNOWN_ALIAS.format(type(t).__name__)
    return WRITTEN_UNSEEN


def drop_written(trace, indices=None) -> None:
    """Drop the saved tensors (of ``indices``, or all) written in place, or freed, since their op ran.

    Activations are kept by reference, so a later forward that updates a buffer the trace holds, or
    code that changes an input or the output, would otherwise show a value the op never made, and
    memory the model freed (FSDP2's unsharded parameters) would be read after it is gone: each reads
    as dropped, with the reason, instead.  Readers of the activations call this first."""
    versions = trace._saved_versions
    if not versions:
        return
    activations = trace._activations
    owners: dict = {}  # the parameters' memory, read only when a saved tensor was written
    for i in list(versions) if indices is None else indices:
        version, t = versions.get(i), activations.get(i)
        if version is None or t is None:
            continue  # not held by reference (a private copy), or not saved
        reason = MEMORY_FREED if memory_freed(t) else _written_reason(trace, t, owners) if t._version != version \
            else _counted_since(trace, t)
        if reason is not None:
            del activations[i]
            trace._dropped[i] = reason


def op_indices(trace, indices) -> list:
    """``indices`` as a list of the trace's op indices (a negative one counted from the end, as a list's): a
    string was read letter by letter, and an index past the trace, a bool or a float was looked for, not found, and
    passed over, so ``drop_written`` seemed to have looked where it never did."""
    count = len(trace)
    advice = f"give a list of op indices below {count} (log[label].index), or None for every op"
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
        raise TypeError(f"drop_written: indices={indices!r:.60} {is_a(indices)}, not a list of op indices; {advice}")
    positions = [as_position(i) for i in indices]
    for i in positions:
        check_int(i, "index", advice, who="drop_written")
        if not -count <= i < count:
            raise ValueError(f"drop_written: index={i} is not an op of this trace; {advice}")
    return [i % count for i in positions]


def _written_reason(trace, t, owners: dict) -> str:
    """Why ``t``, whose version moved since its op ran, is dropped: a parameter's memory written (named, so
    that an optimizer step reads as one), else any other write after the trace.  ``owners``: filled on
    first use with each parameter's ``(device, storage address) -> address``, once per ``drop_written``."""
    if not t.untyped_storage().nbytes() or without_values(t):  # no memory to tell apart (a fake one's is at 0)
        return WRITTEN_AFTER_TRACE
    if not owners:
        owners.update(((p.device, p.untyped_storage().data_ptr()), address)
                      for address, p in reversed(trace._model_params or ()))  # reversed: the first name wins
    address = owners.get((t.device, t.untyped_storage().data_ptr()))
    return WRITTEN_AFTER_TRACE if address is None else PARAM_WRITTEN_AFTER_TRACE.format(address)


def _counted_since(trace, t):
    """Why ``t``, if it is a BatchNorm's running statistic, is stale: its layer counted a batch since the
    trace (a training forward, whose kernel updated the statistic without moving its version counter);
    None if not."""
    if trace._batch_counted is None:
        return None
    slot_of, counters, versions = trace._batch_counted
    k = slot_of.get(id(t))  # t is held, so its id is its own
    return WRITTEN_AFTER_TRACE if k is not None and counters[k]._version != versions[k] else None
