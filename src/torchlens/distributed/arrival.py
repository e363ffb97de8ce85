"""Meeting points that name who did not come: every rank of a group marks its arrival in the process group's
store and waits for the others' marks, up to a timeout of the caller's choosing.

A collective's wait lasts the process group's timeout (30 minutes by default) and names no one, and gloo's
``monitored_barrier`` names the late ranks on rank 0 alone; a store wait names the absent ranks on each rank
that came, with any backend.  ``gather`` and a distributed ``tl.extract`` meet here before their collectives.
"""

from __future__ import annotations

from datetime import timedelta

_calls: dict = {}  # (what, process group name) -> how many times this process has met the others there


def absent_ranks(dist, group, ranks, what: str, timeout: float) -> list:
    """Mark this rank's arrival at its next ``what`` on ``group`` (None: the world) and wait up to ``timeout``
    seconds for every rank of ``ranks`` to mark theirs; returns the ranks that did not ([] when all came)."""
    group = group if group is not None else dist.group.WORLD
    name = str(getattr(group, "group_name", ""))
    call = _calls[what, name] = _calls.get((what, name), 0) + 1  # the n-th call meets the others' n-th
    key = f"torchlens/{what}/{name}/{call}/rank-{{}}".format
    store = dist.distributed_c10d._get_default_store()
    store.set(key(dist.get_rank()), "1")
    try:
        store.wait([key(r) for r in ranks], timedelta(seconds=timeout))
    except RuntimeError:  # a wait timeout (the TCP store raises DistStoreError, the file store RuntimeError)
        return [r for r in ranks if not store.check([key(r)])]  # [] when they all came just as the wait ended
    return []


def ranks_named(ranks) -> str:
    """``rank 1`` or ``ranks 1, 3``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
