"""torchlens on ``torch.distributed``: per-rank traces compared across ranks, and sharded extraction.

``tl.trace`` works on each rank as in one process (DDP is traced through its wrapped module, FSDP2
modules in place) and records the rank, the world size and the collectives that interposition sees;
``gather`` brings every rank's trace to one rank and ``compare`` names the first op where replicas
diverge.  ``tl.extract`` inside a process group shards the dataset over the ranks (see
``extraction.py``).  ``torch.distributed`` is imported only when one of these is used.
"""

from .collectives import collectives
from .compare import compare
from .extraction import RankFailedError, sample_index
from .gather import RankTrace, gather

__all__ = ["gather", "compare", "collectives", "sample_index", "RankTrace", "RankFailedError"]
