"""``tl.extract`` under ``torch.distributed``: each rank extracts its share, rank 0 joins them in dataset order.

Each rank writes ``out/rank-{r}/``, an ordinary resumable, checksummed extraction folder whose rows also
carry their sample index (``sample_index.safetensors``).  Which rows a rank takes:

- a ``DataLoader`` over a ``DistributedSampler`` (its ``sampler=``, or the one its ``batch_sampler=`` batches): the
  loader's own batches; the sample indices are the ones its batch sampler yields (the sampler's padding
  duplicates are dropped when joining);
- anything else (a list of batches, a generator, a plain ``DataLoader``): every rank iterates all of it
  and takes batches ``r, r + world, r + 2 * world, ...``; a row's sample index is its position in the
  whole stream.

When a rank finishes it waits at a barrier with a timeout (``monitored_barrier`` on a gloo group), so a
rank that died or hung is named in the error instead of every other rank waiting forever.  Rank 0 then
copies the rows of every rank, in sample-index order and without duplicates, into ``out/layer_*.safetensors``,
writes ``out/manifest.json`` (the ordinary extraction format, so ``tl.load_extracted(out)`` memory-maps it
as for one process), and removes the rank folders; a second barrier lets every rank return only once the
result is readable.  Rerunning the same command after a kill resumes each rank from its own commits.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import sys
from datetime import timedelta

import torch

from ..io.extract import counted_rows, extract_folder, extraction_job, traced_module
from ..io.extract_job import check_same_job, layer_dims, recorded_job
from ..io.extract_progress import PROGRESS
from ..io.extract_shards import EXTRACT_FORMAT, EXTRACT_SCHEMA, SAMPLE_INDEX
from ..io.extracted import refuse_unfinished
from ..io.format import (MANIFEST, TraceFileError, atomic_file, checked_member, make_folder, read_json, verify_manifest,
                         write_manifest)
from ..io.identity import model_checksum
from ..io.tensorfile import header_bytes, mapped, read_header
from ..record.model_index import fsdp_params
from ..checks import check_path
from ..errors import RankFailedError, ResumeMismatchError, counted
from .arrival import ranks_named

RANK_FOLDER = "rank-{}"
_JOIN_CHUNK_BYTES = 64 << 20


def extract_ranks(model, inputs, layers, out, *, arguments_of, kwargs, shard_bytes, progress, barrier_timeout,
                  stop_after=None, grads=False, loss_fn=None, root=None, batch_dim=None,
                  input_batch_dim: int = 0, arrival) -> str:
    """``arrival``: this rank's call (``Arrival``), counted before any check, where a check this rank refuses
    tells the others at the meeting."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    with arrival.refusals():
        module = traced_module(root if root is not None else model)
        _refuse_tensor_parallel(module)
        _refuse_one_process_folder(out)
    with _barrier_group(dist, arrival, barrier_timeout) as barrier_group:
        make_folder(out, out, "extract")
        if _joined(out):
            _barrier(dist, barrier_group, barrier_timeout, "start")
            if rank == 0:
                _remove_rank_folders(out, world)  # a kill after the join, before its cleanup, leaves them
            _check_rerun(out, rank, world, _job(model, inputs, layers, kwargs, grads, root, rank, world, batch_dim,
                                                input_batch_dim))
            return out
        folder = os.path.join(out, RANK_FOLDER.format(rank))
        batches, indices_of, settings = _share(inputs, rank, world, arguments_of, barrier_group, input_batch_dim)
        fsdp = module is not None and bool(_fsdp_sharded_params(module))
        _same_model_everywhere(None if fsdp else module, barrier_group)  # an FSDP2 model's shards differ by design
        # An FSDP2 model's forwards are collectives: its ranks check, forward by forward, that they all run one.
        in_step = _InStep(dist, barrier_group, out) if fsdp else None
        # A rank that raises here never reaches the barrier, and the others name it there.
        extract_folder(model, batches, layers, folder, arguments_of=arguments_of, kwargs=kwargs,
                       shard_bytes=shard_bytes, progress=progress if rank == 0 else False, indices_of=indices_of,
                       arguments=dict(settings, rank=rank, world_size=world), stop_after=stop_after, grads=grads,
                       loss_fn=loss_fn, root=root, before_forward=in_step, batch_dim=batch_dim,
                       input_batch_dim=input_batch_dim)
        if in_step is not None:
            in_step.finish()
        _barrier(dist, barrier_group, barrier_timeout, "the end of its share", lambda: _unfinished(out, world))
        if settings["sharding"] != "DistributedSampler":
            _refuse_uncovered_stream(out, world)  # on every rank alike, before the join
            # the join removes the rank folders: every rank must have read them first
            _barrier(dist, barrier_group, barrier_timeout, "the check of the shares")
        if rank == 0:
            join_ranks(out, world)
        _barrier(dist, barrier_group, barrier_timeout, "the joined result")
        return out


def _job(model, inputs, layers, kwargs, grads, root, rank, world, batch_dim=None, input_batch_dim=0) -> dict:
    """The job this rank's extraction records (see ``io/extract_job.py``), as ``extract_folder`` builds it."""
    arguments = dict(_sharding(inputs), rank=rank, world_size=world)
    # A stream shared batch by batch reaches extract_folder as a _RoundRobin, which has no batch_size.
    given = inputs if arguments["sharding"] == "DistributedSampler" else None
    return extraction_job(model, layers, kwargs, given, grads, arguments, root, batch_dim, input_batch_dim)[3]


def _check_rerun(out, rank, world, job) -> None:
    """Refuse a call into a joined extraction that is not the call that made it (other layers, model, data or
    world size), as one process refuses a complete folder: returning it would hand back rows this call did not
    ask for.  Each rank checks its own job, after the ranks have met, so no rank waits for one that raised."""
    manifest = read_json(out, MANIFEST, "a distributed extraction")
    jobs = manifest.get("rank_jobs")
    if not isinstance(jobs, list):  # joined by a version that kept no record of its call
        return
    if len(jobs) != world:
        raise ResumeMismatchError(f"{out} was extracted by {len(jobs)} ranks, and this call runs {world}; use "
                                  f"another folder, or delete {out} to extract again")
    check_same_job(out, jobs[rank], job, layer_dims(manifest.get("layers")))


def _refuse_one_process_folder(out) -> None:
    """Refuse an ``out`` holding a one-process extraction (its ``progress.json``, which a distributed one keeps in
    the rank folders alone): the join would write over its layer files and leave its progress behind, and a
    one-process call into the folder would then return the joined rows as its own."""
    if os.path.lexists(os.path.join(out, PROGRESS)):
        raise TraceFileError(f"{out} holds a one-process extraction ({PROGRESS}); a distributed tl.extract writes its "
                             f"rank folders and the joined result into a folder of its own: use another folder, or "
                             f"delete {out}")


def _refuse_tensor_parallel(module) -> None:
    """Refuse a model with tensor-parallel parameters: its ranks compute each batch together, from one input,
    whereas a distributed extraction gives each rank its own batches (their rows would be wrong, silently).
    FSDP2's sharded parameters are DTensors too, but each rank computes its own batch with them."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if module is None or dtensor is None:
        return
    data_parallel = _fsdp_sharded_params(module)
    for address, p in module.named_parameters():
        if isinstance(p, dtensor.DTensor) and id(p) not in data_parallel:
            raise ValueError(
                f"tl.extract under torch.distributed gives each rank its own batches, but {address} is a tensor-"
                f"parallel DTensor parameter ({', '.join(map(repr, p.placements))} over a {tuple(p.device_mesh.shape)} "
                "mesh): its ranks compute each batch together from the same input, so they would be given different "
                "samples and store wrong rows. Extract the model before parallelize_module, or trace each batch "
                "with tl.trace on every rank")


class _InStep:
    """Before each forward of an FSDP2 model, every rank says whether it has one to run (one all-reduce of a
    flag per rank); when some have and some have not, every rank raises.  Without it a rank with a batch more
    waits at that forward's all-gather, and the others at the join's barrier, until their timeouts."""

    def __init__(self, dist, group, out):
        self.dist, self.group, self.out = dist, group, out
        self.steps = 0  # forwards agreed on so far, plus this one

    def __call__(self) -> None:
        self._agree(more=True)

    def finish(self) -> None:
        self._agree(more=False)

    def _agree(self, more: bool) -> None:
        self.steps += 1
        flags = torch.zeros(self.dist.get_world_size(), dtype=torch.int32)
        flags[self.dist.get_rank()] = int(more)
        self.dist.all_reduce(flags, group=self.group)
        if 0 < int(flags.sum()) < len(flags):
            flags = flags.tolist()
            have, lack = [r for r, f in enumerate(flags) if f], [r for r, f in enumerate(flags) if not f]
            raise ValueError(
                "tl.extract of an FSDP2 model needs every rank to run the same number of forwards (each one "
                f"all-gathers its parameters with the other ranks), but {_ranks_have(have)} forward number "
                f"{self.steps} to run and {_ranks_have(lack)} none. Give a DataLoader with a DistributedSampler (it "
                "pads the shares to one length), or a stream whose batch count is a multiple of the world size "
                f"({len(flags)}). A resume whose ranks had committed different numbers of batches meets this too: "
                f"delete {self.out} and extract again")


def _ranks_have(ranks) -> str:
    return f"{ranks_named(ranks)} {'has' if len(ranks) == 1 else 'have'}"


def _fsdp_sharded_params(module) -> set:
    """ids of the parameters ``fully_shard`` sharded over data-parallel ranks alone (not ones it sharded further
    on top of tensor parallelism)."""
    return {id(param.sharded_param) for param in fsdp_params(module.modules()) if not param.is_dtensor}


def _share(inputs, rank, world, arguments_of, group, input_batch_dim=0):
    """``(batches for this rank, position -> sample indices, settings a resume must match)``."""
    settings = _sharding(inputs)
    if settings["sharding"] == "DistributedSampler":
        sampler = _distributed_sampler(inputs)
        if sampler.num_replicas != world or sampler.rank != rank:
            raise ValueError(f"the DistributedSampler is set for rank {sampler.rank} of {sampler.num_replicas}, but "
                             f"this process is rank {rank} of {world}")
        sampling = dict(settings, drop_last=sampler.drop_last)
        if not sampler.shuffle:  # the seed and the epoch order a shuffled dataset alone
            del sampling["seed"], sampling["epoch"]
        _same_sharding_everywhere(sampling, group)
        plan = [torch.as_tensor(list(b), dtype=torch.int64) for b in inputs.batch_sampler]
        return inputs, plan.__getitem__, settings
    inputs, first = _first_batch(inputs, arguments_of)
    _same_sharding_everywhere(dict(settings, first_batch=first), group)
    share = _RoundRobin(inputs, rank, world, arguments_of, input_batch_dim)
    return share, share.indices.__getitem__, settings


def _sharding(inputs) -> dict:
    """How the ranks share ``inputs``, as a resume (or a call into the joined result) must find it again."""
    sampler = _distributed_sampler(inputs)
    if sampler is not None:
        return {"sharding": "DistributedSampler", "shuffle": sampler.shuffle, "seed": sampler.seed,
                "epoch": sampler.epoch, "dataset_rows": len(sampler.dataset)}
    return {"sharding": "round-robin batches"}


def _distributed_sampler(inputs):
    """The ``DistributedSampler`` that picks this rank's samples of a batching ``DataLoader``: its ``sampler=``, or the
    sampler its ``batch_sampler=`` batches (``BatchSampler(DistributedSampler(ds), 32, False)``, where the loader's
    own ``sampler`` is a default one); None for anything else."""
    batch_sampler = getattr(inputs, "batch_sampler", None)
    if batch_sampler is None:  # not a DataLoader, or one that batches nothing (batch_size=None)
        return None
    for sampler in (getattr(inputs, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(sampler, torch.utils.data.DistributedSampler):
            return sampler
    return None


def _same_model_everywhere(module, group) -> None:
    """Refuse, on every rank alike, ranks whose models differ (weights initialised with each rank's own seed, another
    checkpoint): the join would put their rows together as one model's.  ``module`` None: nothing to compare."""
    import torch.distributed as dist

    mine = None if module is None else model_checksum(module)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    if len(set(everyone)) > 1:
        differ = ", ".join(f"{str(checksum)[:12]} on rank {r}" for r, checksum in enumerate(everyone))
        raise ValueError(f"the ranks' {type(module).__name__} models differ (their parameters or buffers: checksums "
                         f"{differ}), and their rows would be joined as one model's. Give every rank the same weights: "
                         "the same seed before building the model, the same checkpoint, or DDP(model), which copies "
                         "rank 0's")


def _first_batch(inputs, arguments_of):
    """``(an iterable of all of inputs' batches, a hash of the first one)``: the ranks compare the hashes, since a
    stream that differs between ranks (each rank's own share already) cannot be shared batch by batch."""
    import itertools

    from ..io.extract import inputs_fingerprint

    iterator = iter(inputs)
    first = next(iterator, None)
    if first is None:
        return [], None
    return itertools.chain([first], iterator), inputs_fingerprint(*arguments_of(first, 0))


def _same_sharding_everywhere(sharding: dict, group) -> None:
    """Refuse, on every rank alike, ranks that would not take their shares of one dataset: some sharding it with a
    DistributedSampler and others batch by batch; DistributedSamplers that order it differently (a seed or an epoch of
    each rank's own), whose shares would overlap and miss samples (and the join, dropping the overlap as the sampler's
    padding, would silently lose those rows); streams whose first batches differ, whose taking every ``world``-th
    batch would silently drop rows."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sharding, group=group)
    for name in sharding:
        values = [s.get(name) for s in everyone]  # a rank that does not shuffle has no seed to compare
        if len(set(values)) == 1:
            continue
        if name == "first_batch":
            raise ValueError("the ranks were given different inputs (their first batches differ). Under "
                             "torch.distributed, tl.extract shards either a DataLoader with a DistributedSampler or "
                             "one stream that every rank iterates identically; it cannot tell where the rows of "
                             "per-rank streams belong in the dataset")
        differ = ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values))
        raise ValueError(f"the ranks shard the dataset differently ({name}: {differ}): each rank would take its share "
                         "of another order of it, and the shares would overlap and miss samples. Give every rank a "
                         "DataLoader with a DistributedSampler of the same dataset, shuffle, seed, drop_last and epoch "
                         "(set_epoch), or every rank the same stream")


class _RoundRobin:
    """Batches ``rank, rank + world, ...`` of a stream every rank iterates; ``indices`` fills as it goes."""

    def __init__(self, inputs, rank, world, arguments_of, input_batch_dim=0):
        self.inputs, self.rank, self.world, self.arguments_of = inputs, rank, world, arguments_of
        self.input_batch_dim = input_batch_dim  # where each batch's row count is read (batch_dimension)
        self.rows_source = None  # the input that counted the first batch: counted_rows reads the others' there
        self.indices: dict = {}  # this rank's batch position -> sample index of each row

    def __iter__(self):
        offset, mine = 0, 0
        for position, batch in enumerate(self._at_least_one_batch_a_rank()):
            rows = counted_rows(*self.arguments_of(batch, position), self.input_batch_dim, self)[0]
            if rows is None:
                raise ValueError(f"batch {position} holds no tensor with a batch dimension; sharding a stream "
                                 "across ranks needs each batch's row count (use a DataLoader with a "
                                 "DistributedSampler)")
            if position % self.world == self.rank:
                self.indices[mine] = torch.arange(offset, offset + rows, dtype=torch.int64)
                yield batch
                mine += 1
            offset += rows

    def _at_least_one_batch_a_rank(self):
        """The stream's batches, once its first ``world`` have been read: a stream with fewer is refused before
        any forward, on every rank alike (every rank iterates the same stream).  Found at its end instead, it
        left an FSDP2 model's ranks that had a batch waiting in that forward's all-gather for those that raised,
        to fail there with gloo's "connection closed"."""
        stream = iter(self.inputs)
        first = list(itertools.islice(stream, self.world))
        if 0 < len(first) < self.world:
            idle = ranks_named(range(len(first), self.world))
            raise ValueError(f"the stream holds {counted(len(first), 'batch', 'batches')}, fewer than the "
                             f"{self.world} ranks that share it batch by batch: {idle} would have none to extract. "
                             f"Split it into at least {self.world} batches, or give a DataLoader with a "
                             "DistributedSampler, which gives every rank a share")
        return itertools.chain(first, stream)


@contextlib.contextmanager
def _barrier_group(dist, arrival, timeout):
    """A gloo group whose collectives wait ``timeout`` seconds, made once every rank has called ``tl.extract`` and
    destroyed when the call ends (calls in a loop must not pile up groups, each holding its connections).
    gloo, since ``monitored_barrier`` (which names the ranks that did not arrive) exists on gloo alone; a group of
    its own, since ranks other than 0 wait in it for the group's timeout, not the barrier's: on the world's group
    a rank 0 slower than the process group's timeout failed every rank, however long ``barrier_timeout``."""
    absent = arrival.absent_ranks(range(dist.get_world_size()), timeout)
    if absent:  # new_group would wait for them, then fail naming no one
        raise RankFailedError(f"{ranks_named(absent)} did not call tl.extract within {timeout:g}s of this rank: under "
                              "torch.distributed every rank must call it, like a collective")
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    try:
        yield group
    finally:  # a rank still waiting in it on another rank then fails at once, and names no one wrongly
        dist.destroy_process_group(group)


def _barrier(dist, group, timeout, what, missing=None) -> None:
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as exc:
        # gloo names late ranks, but a rank that died outright shows as a closed connection: then the
        # rank folders say who has not finished.
        found = re.search(r"[Rr]anks? ([\d, ]+?) failed", str(exc))
        late = missing() if missing is not None else []
        torch_said = f"(torch.distributed: {str(exc).splitlines()[0]})"
        if missing is not None and not late:  # every share is complete: another rank gave up on this one
            raise RankFailedError(f"every rank has finished its share, but another rank stopped waiting at {what} "
                                  f"before this one arrived (its {timeout:g}s passed first, or it died since). Nothing "
                                  f"is lost: rerun the same command to join the shares. {torch_said}") from None
        who = (ranks_named(late) if late else f"rank {found.group(1)}" if found
               else "a rank (see the torch.distributed message)")
        raise RankFailedError(f"{who} did not reach {what} within {timeout:g}s: it died, hung or raised. Every rank "
                              f"keeps its committed shards; rerun the same command to resume. {torch_said}") from None


def _unfinished(out, world) -> list:
    """Ranks whose folder under ``out`` holds no complete extraction."""
    late = []
    for r in range(world):
        folder = os.path.join(out, RANK_FOLDER.format(r))
        try:
            state = read_json(folder, PROGRESS, "a rank's extraction")
        except TraceFileError:
            state = None
        if not (isinstance(state, dict) and state.get("complete")):
            late.append(r)
    return late


def _refuse_uncovered_stream(out, world) -> None:
    """Refuse to join round-robin shares whose rows do not cover the stream once each: ranks that iterated streams of
    different lengths (or batch sizes) took batches at positions the others' streams lacked, or counted rows at other
    offsets, and the join would leave a gap where no rank had the batch, or hold a row twice."""
    import numpy as np

    folders = [os.path.join(out, RANK_FOLDER.format(r)) for r in range(world)]
    indices = np.sort(np.concatenate([mapped(checked_member(f, SAMPLE_INDEX), "activations", as_torch=False)
                                      for f in folders]))
    wrong = np.flatnonzero(indices != np.arange(len(indices)))
    if not len(wrong):
        return
    missing = np.setdiff1d(np.arange(int(indices[-1]) + 1), indices)
    found = (f"rows {', '.join(map(str, missing[:3].tolist()))}{' ...' if len(missing) > 3 else ''} of the stream "
             "were extracted by no rank" if len(missing) else
             f"row {int(indices[wrong[0]])} of the stream was extracted twice")
    raise ValueError(f"the ranks iterated streams of different lengths or batch sizes: {found}. A stream shared batch "
                     "by batch (batches rank, rank + world, ...) must be the same on every rank; give every rank the "
                     f"same batches, or a DataLoader with a DistributedSampler. Delete {out} and extract again")


def _joined(out) -> bool:
    if not os.path.lexists(os.path.join(out, MANIFEST)):
        return False
    manifest = read_json(out, MANIFEST, "a distributed extraction")
    return isinstance(manifest, dict) and manifest.get("format") == EXTRACT_FORMAT and "world_size" in manifest


def join_ranks(out, world) -> None:
    """Copy every rank's rows into ``out``'s layer files in sample-index order, duplicates dropped, then remove
    the rank folders: only once ``_join_rows`` has returned, which lets go of its memory maps of their files
    (Windows refuses to delete a file that is mapped)."""
    _join_rows(out, world)
    _remove_rank_folders(out, world)


def _join_rows(out, world) -> None:
    import numpy as np

    folders = [os.path.join(out, RANK_FOLDER.format(r)) for r in range(world)]
    manifests = [verify_manifest(f, EXTRACT_FORMAT, EXTRACT_SCHEMA) for f in folders]
    jobs = [recorded_job(read_json(f, PROGRESS, "a rank's extraction")) for f in folders]  # what a rerun must match
    indices = [mapped(checked_member(f, SAMPLE_INDEX), "activations", as_torch=False) for f in folders]
    rank_of = np.concatenate([np.full(len(ix), r, dtype=np.int64) for r, ix in enumerate(indices)])
    row_of = np.concatenate([np.arange(len(ix), dtype=np.int64) for ix in indices])
    order = np.argsort(np.concatenate(indices), kind="stable")  # stable: a duplicate keeps the lowest rank's row
    merged = np.concatenate(indices)[order]
    first = np.ones(len(merged), dtype=bool)
    first[1:] = merged[1:] != merged[:-1]
    order, merged = order[first], merged[first]
    names, described = [], []
    for i, info in enumerate(manifests[0]["layers"]):
        name = info["file"]
        sources = [_rows_as_bytes(checked_member(f, name)) for f in folders]
        row_bytes = sources[0].shape[1]
        _write_rows(os.path.join(out, name), info, len(merged), row_bytes,
                    lambda lo, hi: _gather_rows(sources, rank_of[order[lo:hi]], row_of[order[lo:hi]]))
        names.append(name)
        described.append(dict(info, shape=[len(merged)] + info["row_shape"]))
    index_info = {"name": "sample_index", "label": "", "dtype": "I64", "row_shape": []}
    _write_rows(os.path.join(out, SAMPLE_INDEX), index_info, len(merged), 8,
                lambda lo, hi: merged[lo:hi].astype("<i8").view(np.uint8).reshape(hi - lo, 8))
    write_manifest(out, EXTRACT_FORMAT, EXTRACT_SCHEMA, names + [SAMPLE_INDEX],
                   {"layers": described, "rows": int(len(merged)), "batches": sum(m["batches"] for m in manifests),
                    "model": manifests[0]["model"], "world_size": world, "sample_index": SAMPLE_INDEX,
                    "rank_rows": [len(ix) for ix in indices], "rank_jobs": jobs})


def _remove_rank_folders(out, world) -> None:
    for r in range(world):
        folder = os.path.join(out, RANK_FOLDER.format(r))
        if os.path.isdir(folder) and not os.path.islink(folder):
            shutil.rmtree(folder)


def _rows_as_bytes(path):
    """A layer file's rows as a ``(rows, bytes per row)`` uint8 memory map, whatever its dtype."""
    import numpy as np

    header, data_start = read_header(path)
    entry = header["activations"]
    start, end = entry["data_offsets"]
    rows = entry["shape"][0]
    if rows == 0 or end == start:
        return np.zeros((rows, 0), dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=data_start + start, shape=(rows, (end - start) // rows))


def _gather_rows(sources, ranks, rows):
    import numpy as np

    out = np.empty((len(ranks), sources[0].shape[1]), dtype=np.uint8)
    for r, source in enumerate(sources):
        take = ranks == r
        if take.any():
            out[take] = source[rows[take]]
    return out


def _write_rows(path, info, n_rows, row_bytes, rows_between) -> None:
    """Write a one-tensor safetensors file of ``n_rows`` rows, filled chunk by chunk, atomically."""
    from ..io.tensorfile import DTYPES

    shape = [n_rows] + info["row_shape"]
    with atomic_file(path) as f:
        f.write(header_bytes({"activations": (DTYPES[info["dtype"]], shape)},
                             {"layer": info["name"], "label": info["label"]}))
        step = max(1, _JOIN_CHUNK_BYTES // max(row_bytes, 1))
        for lo in range(0, n_rows, step):
            f.write(rows_between(lo, min(lo + step, n_rows)).tobytes())


def sample_index(out):
    """The dataset index of every row of a distributed extraction (rows are in this order)."""
    folder = check_path(out, "out", "give the folder tl.extract wrote (a str or a pathlib.Path)", who="sample_index")
    refuse_unfinished(folder)
    manifest = verify_manifest(folder, EXTRACT_FORMAT, EXTRACT_SCHEMA, hashes=False)
    if manifest.get("sample_index") != SAMPLE_INDEX:
        raise TraceFileError(f"{folder}: this extraction's rows carry no sample index (it was not distributed)")
    return mapped(checked_member(folder, SAMPLE_INDEX), "activations", as_torch=False)
