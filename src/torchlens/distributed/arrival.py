"""Meeting points that name who did not come: every rank of a group marks its arrival in the process group's
store and waits for the others' marks, up to a timeout of the caller's choosing.

A collective's wait lasts the process group's timeout (30 minutes by default) and names no one, and gloo's
``monitored_barrier`` names the late ranks on rank 0 alone; a store wait names the absent ranks on each rank
that came, with any backend.  ``gather`` and a distributed ``tl.extract`` meet here before their collectives.

Each meeting ends in one verdict, set once in the store: ``met`` by the first rank that saw every mark, or
``abandoned`` by the first whose wait ran out first.  A rank that arrives after the others abandoned the meeting
is told so, instead of entering the collective after it alone and waiting there for the process group's timeout.

A call is numbered as it begins, before its arguments are checked, and a rank that refuses its own arguments
(a ``dst`` outside the group, a layer list of its own) marks its arrival as refused, settling the verdict
``refused``: the others are told at once which rank refused and why, and every rank's next call meets the
others' next.  Numbered only at the meeting, a call one rank refused left that rank's count behind the others',
and no later call on that group met again (each rank waited for another call number).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

from ..errors import RankFailedError

_calls: dict = {}  # (what, process group name) -> how many times this process has begun ``what`` there
_MET, _ABANDONED, _REFUSED = "met", "abandoned by rank ", "refused by rank "


class Arrival:
    """This rank's next call of ``what`` (the call, as a user writes it: ``tl.extract``) on ``group`` (None: the
    world), numbered when made: the n-th call meets the others' n-th, whether it reaches the meeting or this rank
    refuses its arguments first (``refusals``)."""

    def __init__(self, dist, group, what: str):
        group = group if group is not None else dist.group.WORLD
        name = str(getattr(group, "group_name", ""))
        call = _calls[what, name] = _calls.get((what, name), 0) + 1
        self.dist, self.what = dist, what
        self.key = f"torchlens/{what}/{name}/{call}/{{}}".format  # rank-{r}, verdict

    @classmethod
    def begun(cls, group, what: str):
        """The call's ``Arrival`` under an initialised ``torch.distributed`` process group, else None."""
        import torch.distributed as dist

        return cls(dist, group, what) if dist.is_available() and dist.is_initialized() else None

    @contextlib.contextmanager
    def refusals(self):
        """Checks this rank makes before the meeting: one that raises marks this rank's arrival as refused,
        naming the error, so that the others raise at the meeting instead of waiting there for this rank."""
        try:
            yield
        except Exception as exc:
            said = str(exc).splitlines()[0] if str(exc) else ""
            reason = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
            store = self._store()
            # The verdict first: a rank that saw every mark could otherwise settle ``met`` and enter the collective.
            _settle(store, self.key("verdict"), f"{_REFUSED}{self.dist.get_rank()}: {reason}")
            store.set(self.key(f"rank-{self.dist.get_rank()}"), "refused")
            raise

    def absent_ranks(self, ranks, timeout: float) -> list:
        """Mark this rank's arrival and wait up to ``timeout`` seconds for every rank of ``ranks`` to mark theirs;
        returns the ranks that did not ([] when all came).  Raises ``RankFailedError`` when this rank comes after
        another one stopped waiting for it, or when another one refused its arguments."""
        store, verdict = self._store(), self.key("verdict")
        store.set(self.key(f"rank-{self.dist.get_rank()}"), "1")
        try:
            store.wait([self.key(f"rank-{r}") for r in ranks], timedelta(seconds=timeout))
        except RuntimeError:  # a wait timeout (the TCP store raises DistStoreError, the file store RuntimeError)
            absent = [r for r in ranks if not store.check([self.key(f"rank-{r}")])]  # [] when all came as it ended
            if absent and _settle(store, verdict, f"{_ABANDONED}{self.dist.get_rank()}").startswith(_ABANDONED):
                return absent
        settled = _settle(store, verdict, _MET)  # every rank has come; has one refused, or given up on this one?
        if settled.startswith(_REFUSED):
            rank, _, reason = settled[len(_REFUSED):].partition(": ")
            raise RankFailedError(f"rank {rank} refused its arguments to {self.what} ({reason}), so no rank goes on "
                                  "with this call; every rank's next call meets the others' next")
        if settled != _MET:
            raise RankFailedError(
                f"this rank called {self.what} after rank {settled[len(_ABANDONED):]} had stopped waiting for it (its "
                f"wait passed first), so it does not wait for ranks that have moved on: every rank must call "
                f"{self.what} within the others' wait. If a rank is only slower to get there, give every rank a longer "
                "one (gather's timeout=, tl.extract's barrier_timeout=)")
        return []

    def _store(self):
        return self.dist.distributed_c10d._get_default_store()


def _settle(store, key: str, verdict: str) -> str:
    """Set the meeting's verdict unless a rank set it first; the verdict that stands."""
    return store.compare_set(key, "", verdict).decode()


def ranks_named(ranks) -> str:
    """``rank 1`` or ``ranks 1, 3``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
