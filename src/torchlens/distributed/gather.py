"""``gather``: every rank's trace, as plain picklable metadata (and chosen activations), on one rank.

A ``Trace`` holds the live model and references to its tensors; what travels between ranks is a
``RankTrace``: the rank, the world size and one row per op (label, function, module, shape, dtype,
parents), plus the activations asked for, moved to the CPU.  ``compare`` accepts either kind.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..checks import LONGEST_WAIT_S, check_int, check_number
from ..errors import ActivationUnavailable, RankFailedError, closest_hint, refusing_unknown_keywords
from ..io.identity import own_values
from ..record.trace import checked_trace
from ..record.columns import uninitialized_ops
from ..record.layouts import holds_more_than_itself
from .arrival import Arrival, ranks_named

# How long the ranks of a gather wait for each other to call it: ranks that traced the same forward arrive
# within moments, and a rank that never calls it (``if rank == 0: gather(log)``) should be named soon, not
# after the process group's timeout (30 minutes by default).
ARRIVAL_TIMEOUT_S = 120.0
_SHORTEST_WAIT_S = 0.001  # the process group's store waits in whole milliseconds


@dataclass
class RankTrace:
    """One rank's trace metadata, small enough to send: ``ops`` rows in execution order."""

    rank: int | None
    world_size: int | None
    model_name: str
    ops: list
    activations: dict = field(default_factory=dict)  # label -> CPU tensor, for the labels asked for

    @classmethod
    def of(cls, trace, activations=False, strict: bool = True) -> "RankTrace":
        """This trace's metadata, with the activations asked for; ``strict``: a label the trace lacks raises
        KeyError (``gather`` passes False: a label one rank lacks is a graph difference, not a mistake)."""
        wanted = _wanted(trace, activations, strict)
        ops, acts = [], {}
        undefined = uninitialized_ops(trace, through_writes=False)  # a write into one is compared: it may fill it
        for op in trace.ops:
            ops.append({"label": op.label, "func": op.func_name, "module": op.module, "shape": tuple(op.shape),
                        "dtype": str(op.dtype), "parents": list(op.parents), "uninitialized": op.index in undefined})
            if op.label in wanted:
                try:
                    value = op.activation  # None where not saved
                except ActivationUnavailable:
                    value = None
                if value is not None:  # dropped or never saved: compare reports it as not compared
                    # A DTensor travels as this rank's shard: compared as one (compare runs on one rank), it would
                    # wait at a collective for the other ranks.
                    acts[op.label] = _sent_alone(own_values(value).detach().to("cpu"))
        return cls(trace.rank, trace.world_size, trace.model_name, ops, acts)

    def __len__(self) -> int:
        return len(self.ops)


def _sent_alone(t):
    """``t``, or a copy of its elements alone where it views part of a larger tensor (a slice, a split head):
    a tensor is pickled with its whole storage, so the view of one row of a matrix would send the matrix."""
    return t.clone() if holds_more_than_itself(t) else t


def _wanted(trace, activations, strict: bool = True) -> set:
    asked = _asked_labels(activations)
    if asked is None:
        return {op.label for op in trace.ops if op.has_activation}
    labels = {op.label for op in trace.ops}
    missing = [a for a in asked if a not in labels]
    if missing and strict:
        raise KeyError(f"gather: no op labelled {missing[0]!r} in this trace")
    return set(asked) & labels


def _asked_labels(activations):
    """The op labels ``activations`` names: a list (empty for False or None), or None for all of them."""
    if activations is False or activations is None:
        return []
    if activations is True or activations == "all":
        return None
    labels = [activations] if isinstance(activations, str) else \
        list(activations) if isinstance(activations, (list, tuple, set, frozenset)) else None
    if labels is None or not all(isinstance(label, str) for label in labels):
        raise TypeError(f"gather: activations={activations!r:.60} is not understood; give False (metadata only), "
                        "True (every saved activation) or a list of op labels")
    return labels


@refusing_unknown_keywords("tl.distributed.gather")
def gather(trace, dst: int = 0, *, activations=False, group=None, timeout: float = ARRIVAL_TIMEOUT_S):
    """Collect every rank's ``RankTrace`` on rank ``dst`` (a list indexed by rank there, None elsewhere).

    Args:
        activations: False (metadata only), True (every saved activation), or a list of op labels.
        group: the process group to gather over (default: the world).
        timeout: seconds every rank of ``group`` has to call ``gather`` once one has; past it, each rank
            that did raises ``RankFailedError`` naming those that did not.

    Every rank of ``group`` must call it, like any collective.  A label some ranks lack (their graphs
    differ) is gathered from the ranks that have it; one that no rank has raises KeyError on ``dst``,
    after the gather, so that no rank is left waiting for another that raised.
    """
    import torch.distributed as dist

    arrival = Arrival.begun(group, "tl.distributed.gather")  # counted before any check, on every rank alike
    with arrival.refusals() if arrival is not None else contextlib.nullcontext():
        ranks = _checked_call(dist, trace, dst, activations, group, timeout)
    absent = arrival.absent_ranks(ranks, timeout)
    if absent:
        raise RankFailedError(
            f"{ranks_named(absent)} did not call tl.distributed.gather within {timeout:g}s of this rank: every rank of "
            "the process group must call it, like any collective (not only the rank that reads the result, dst). If a "
            "rank is only slower to get there, pass a longer timeout=")
    mine = RankTrace.of(trace, activations, strict=False)
    everyone = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    with torch.no_grad():
        dist.gather_object(mine, everyone, dst=dst, group=group)
    if everyone is not None:
        _check_known(everyone, _asked_labels(activations) or [])
    return everyone


def _checked_call(dist, trace, dst, activations, group, timeout) -> list:
    """The ranks of ``group``, once gather's arguments are checked: a rank refusing its own tells the others at
    the meeting (``Arrival.refusals``), instead of leaving them waiting there."""
    checked_trace(trace, "gather")
    _asked_labels(activations)
    check_int(dst, "dst", "give the rank that receives every trace, 0 or more", who="gather", at_least=0)
    # NaN or a negative wait would time out at once (or never, for inf) on every rank; the store counts whole
    # milliseconds and waits forever on 0, so a wait shorter than one would never end either.
    check_number(timeout, "timeout", "give the seconds every rank has to arrive, a finite number of 0.001 or more "
                 "(120)", who="gather", at_least=_SHORTEST_WAIT_S, finite=True, at_most=LONGEST_WAIT_S)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tl.distributed.gather needs an initialised torch.distributed process group "
                           "(run under torchrun, or call torch.distributed.init_process_group first)")
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if dst not in ranks:
        raise ValueError(f"gather: dst={dst} is not a rank of the process group gathered over (ranks "
                         f"{', '.join(map(str, ranks))}); give the rank, in the world's numbering, that receives "
                         "every trace")
    return ranks


def _check_known(traces, asked) -> None:
    """Raise KeyError for an asked label that no rank's trace has (a mistyped label)."""
    known = {row["label"] for t in traces for row in t.ops}
    unknown = [a for a in asked if a not in known]
    if unknown:
        raise KeyError(f"gather: no rank has an op labelled {unknown[0]!r}{closest_hint(unknown[0], known)}")
