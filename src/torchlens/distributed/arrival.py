"""Meeting points that name who did not come: every rank of a group marks its arrival in the process group's
store and waits for the others' marks, up to a timeout of the caller's choosing.

A collective's wait lasts the process group's timeout (30 minutes by default) and names no one, and gloo's
``monitored_barrier`` names the late ranks on rank 0 alone; a store wait names the absent ranks on each rank
that came, with any backend.  ``gather`` and a distributed ``tl.extract`` meet here before their collectives.

Each meeting ends in one verdict, set once in the store: ``met`` by the first rank that saw every mark, or
``abandoned`` by the first whose wait ran out first.  A rank that arrives after the others abandoned the meeting
is told so, instead of entering the collective after it alone and waiting there for the process group's timeout.
"""

from __future__ import annotations

from datetime import timedelta

from ..errors import RankFailedError

_calls: dict = {}  # (what, process group name) -> how many times this process has met the others there
_MET, _ABANDONED = "met", "abandoned by rank "


def absent_ranks(dist, group, ranks, what: str, timeout: float) -> list:
    """Mark this rank's arrival at its next ``what`` (the call, as a user writes it: ``tl.extract``) on ``group``
    (None: the world) and wait up to ``timeout`` seconds for every rank of ``ranks`` to mark theirs; returns the
    ranks that did not ([] when all came).  Raises ``RankFailedError`` when this rank comes after another one
    stopped waiting for it."""
    group = group if group is not None else dist.group.WORLD
    name = str(getattr(group, "group_name", ""))
    call = _calls[what, name] = _calls.get((what, name), 0) + 1  # the n-th call meets the others' n-th
    key = f"torchlens/{what}/{name}/{call}/rank-{{}}".format
    verdict = f"torchlens/{what}/{name}/{call}/verdict"
    store = dist.distributed_c10d._get_default_store()
    store.set(key(dist.get_rank()), "1")
    try:
        store.wait([key(r) for r in ranks], timedelta(seconds=timeout))
    except RuntimeError:  # a wait timeout (the TCP store raises DistStoreError, the file store RuntimeError)
        absent = [r for r in ranks if not store.check([key(r)])]  # [] when they all came just as the wait ended
        if absent and _settle(store, verdict, f"{_ABANDONED}{dist.get_rank()}") != _MET:
            return absent
    settled = _settle(store, verdict, _MET)  # every rank has come; has one already given up on this one?
    if settled != _MET:
        raise RankFailedError(
            f"this rank called {what} after rank {settled[len(_ABANDONED):]} had stopped waiting for it (its wait "
            f"passed first), so it does not wait for ranks that have moved on: every rank must call {what} within the "
            "others' wait. If a rank is only slower to get there, give every rank a longer one (gather's timeout=, "
            "tl.extract's barrier_timeout=)")
    return []


def _settle(store, key: str, verdict: str) -> str:
    """Set the meeting's verdict unless a rank set it first; the verdict that stands."""
    return store.compare_set(key, "", verdict).decode()


def ranks_named(ranks) -> str:
    """``rank 1`` or ``ranks 1, 3``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
