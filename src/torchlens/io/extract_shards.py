"""The folder of an extraction in progress: its committed shards, the buffer of the next one, what each layer
looks like, and the final join into one file per layer (``io/extract.py`` runs the batches into it).

A shard is written to a temporary name, flushed and renamed before ``progress.json`` (replaced atomically)
counts its batches, so a killed run loses at most the batches after the last committed shard.  A resume is
checked against the job that made the folder (``extract_job.py``) and its progress file
(``extract_progress.py``) before it trusts either.
"""

from __future__ import annotations

import os
import re

import torch

from ..errors import ResumeMismatchError
from .format import (MANIFEST, TraceFileError, atomic_file, check_schema, checked_member, dump_json, make_folder,
                     read_json, remove_made_folders, safe_member, write_atomic, write_manifest)
from .identity import model_checksum
from .extract_job import check_same_job, layer_dims
from .extract_progress import PROGRESS, check_progress, check_shard_columns
from .tensorfile import DTYPES, NAME_OF, copy_range, header_bytes, read_header, write_stacked

EXTRACT_FORMAT, EXTRACT_SCHEMA = "torchlens-extraction", 1
SAMPLE_INDEX = "sample_index.safetensors"  # the dataset index of every row, where the rows carry one


class ExtractionRun:
    """The extraction folder's state: committed shards, the buffer, and what each layer looks like."""

    def __init__(self, out, shard_bytes, job, batch_dims):
        self.out, self.layers, self.shard_bytes = out, job["layers"], max(int(shard_bytes), 1)
        self.batch_dims = batch_dims  # each column's batch dim in the model's activation
        self.buffer = [[] for _ in self.layers]
        self.index_buffer = []
        self.buffered_bytes = 0
        self.pending_batches = 0
        self.first_fingerprint = None
        self.made_folder = make_folder(out, out, "extract")  # removed again by ``discard_if_empty``
        has_progress = os.path.lexists(os.path.join(out, PROGRESS))
        self.state = read_json(out, PROGRESS, "a resumed extraction") if has_progress else None
        if self.state is not None and not self._nothing_committed():
            self._check_resumable(job)
        else:
            leftovers = [n for n in os.listdir(out) if not _is_leftover(n)]
            if self.state is None and leftovers:
                raise TraceFileError(f"{out} is not empty and holds no extraction; choose an empty or new folder")
            self.state = {"format": EXTRACT_FORMAT, "schema_version": EXTRACT_SCHEMA, **job, "complete": False,
                          "batches_done": 0, "rows": 0, "shards": [], "layer_info": [None] * len(self.layers)}
            self._commit()
        self._remove_uncommitted()

    @property
    def complete(self) -> bool:
        return bool(self.state.get("complete"))

    @property
    def batches_done(self) -> int:
        return self.state["batches_done"]

    @property
    def rows_source(self):
        """``(root, path)`` of the input the batches' sizes are read from (``batch_dimension``), kept in the progress
        file so that a resumed run counts its batches by the same input; None before the first batch."""
        kept = self.state.get("rows_source")
        valid = isinstance(kept, list) and len(kept) == 2 and isinstance(kept[1], list)
        return (kept[0], tuple(kept[1])) if valid else None

    @rows_source.setter
    def rows_source(self, source) -> None:
        # Written with the next commit; a path through keys JSON cannot hold as they are (a tuple key) is not kept.
        if source is not None and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in source[1]):
            self.state["rows_source"] = [source[0], list(source[1])]

    def _nothing_committed(self) -> bool:
        # A run that failed before its first shard (a mistyped layer name, say) leaves nothing to keep.
        s = self.state
        return isinstance(s, dict) and s.get("format") == EXTRACT_FORMAT and s.get("batches_done") == 0 \
            and not s.get("shards") and not s.get("complete")

    def discard_if_empty(self) -> None:
        """Remove what a run that stopped before committing a batch wrote (a mistyped layer, a model failing on its
        first batch, inputs yielding none): its progress file, counting no batches, and the folder it made.  Left
        there, the folder was an extraction that tl.load_extracted said to finish "with the same arguments", which
        stop the same way.  A folder that was there before keeps its other files (a killed run's temporary files
        aside)."""
        if not self._nothing_committed():
            return
        self._remove_uncommitted()
        os.remove(os.path.join(self.out, PROGRESS))
        remove_made_folders(self.out, self.made_folder)

    def _check_resumable(self, job):
        s = self.state
        if not isinstance(s, dict) or s.get("format") != EXTRACT_FORMAT:
            raise TraceFileError(f"{self.out}/{PROGRESS}: not the progress file of a torchlens extraction")
        check_schema(f"{self.out}/{PROGRESS}", "the progress file", s.get("schema_version"), EXTRACT_SCHEMA)
        check_same_job(self.out, s, job, layer_dims(s.get("layer_info")))
        check_progress(self.out, s, self.layers)  # io/extract_progress.py
        for shard in s["shards"]:
            path = safe_member(self.out, shard.get("file"))
            if not os.path.lexists(path) or os.path.getsize(checked_member(self.out, shard["file"])) != shard["bytes"]:
                raise TraceFileError(f"{path}: committed shard is missing or has the wrong size; delete {self.out} "
                                     "and extract again")
            check_shard_columns(self.out, shard, read_header(path)[0], s["layer_info"])

    def note_stop(self, model) -> None:
        """Record ``model``'s checksum as the stopped run leaves it (its forwards may update buffers), which a resume
        with the same object then matches.  Best effort: the error that stopped the run is what the caller sees."""
        if self.batches_done and not self.complete:  # else nothing a resume would check
            try:
                state = read_json(self.out, PROGRESS, "a resumed extraction")
                write_atomic(os.path.join(self.out, PROGRESS), dump_json({**state, "model_sha256_at_stop":
                                                                          model_checksum(model)}))
            except Exception:  # noqa: BLE001 - a full disk must not hide why the run stopped
                pass

    def _remove_uncommitted(self):
        # Leftovers of a killed run: temporary files and a shard written but never counted.
        keep = {s["file"] for s in self.state["shards"]} | {PROGRESS, MANIFEST}
        keep |= {f"layer_{i:03d}.safetensors" for i in range(len(self.layers))} | {SAMPLE_INDEX} if self.complete \
            else set()
        for name in os.listdir(self.out):
            if name not in keep and (name.endswith(".tmp") or name.startswith(("shard_", "layer_"))):
                os.remove(os.path.join(self.out, name))

    def check_boundary(self, fingerprint, position):
        shards = self.state["shards"]
        if position == 0:
            expected = self.state.get("first_input_sha256")
        else:
            expected = shards[-1]["last_input_sha256"] if shards else None
        if expected is not None and fingerprint != expected:
            raise ResumeMismatchError(f"input batch {position} differs from the one the interrupted run committed; "
                                      "resuming needs the same inputs in the same order (a shuffling DataLoader "
                                      f"cannot resume). Delete {self.out} to start over")

    def check_layer(self, i, name, label, t, position, by_module=False):
        """Check that batch ``position``'s activation ``t`` (batch dim first) is the op, dtype and row shape that
        earlier batches gave for column ``i``; the first batch sets them."""
        info = {"name": name, "label": label, "dtype": NAME_OF.get(t.dtype), "row_shape": list(t.shape[1:])}
        known = self.state["layer_info"][i]
        if known is None:
            self.state["layer_info"][i] = info
        elif not _same_layer(known, info, by_module):
            raise ValueError(f"batch {position}: {name} is {label} {info['dtype']} rows of {info['row_shape']}, but "
                             f"earlier batches gave {known['label']} {known['dtype']} rows of {known['row_shape']}"
                             f"{_ragged_rows_hint(known, info, by_module)}")

    def add(self, acts, rows, position, sample_index=None):
        """Buffer one batch; ``rows`` is its batch size (``batch_dimension``; None when it has no tensor)."""
        n = acts[0].shape[0] if rows is None else rows
        if sample_index is not None:
            if sample_index.shape != (n,):
                raise ValueError(f"batch {position} has {n} rows but {tuple(sample_index.shape)} sample indices")
            self.index_buffer.append(sample_index.to(torch.int64))
        for i, t in enumerate(acts):
            if t.shape[0] != n:  # rows_first checked every layer against a batch size read from an input
                raise ValueError(f"batch {position}: {self.layers[i]} has {t.shape[0]} rows along its batch dim, but "
                                 f"{self.layers[0]} has {n}: the batch has no input tensor to read its size from, so "
                                 "every layer's batch dim must have the first layer's size; name the batch dim of a "
                                 "layer whose is not dim 0 in batch_dim=")
            self.buffer[i].append(t)
            self.buffered_bytes += t.numel() * t.element_size()
        self.pending_batches += 1

    def flush(self, last_fingerprint):
        if not self.pending_batches:
            return
        index = len(self.state["shards"])
        name = f"shard_{index:06d}.safetensors"
        path = safe_member(self.out, name)
        columns = {str(i): parts for i, parts in enumerate(self.buffer)}
        if self.index_buffer:
            columns["index"] = self.index_buffer
        tmp = path + ".tmp"
        write_stacked(tmp, columns)  # part by part: memory stays bounded by the one shard buffered
        os.replace(tmp, path)
        rows = sum(part.shape[0] for part in self.buffer[0])
        start = self.batches_done
        self.state["shards"].append({"file": name, "bytes": os.path.getsize(path), "rows": rows,
                                     "batches": [start, start + self.pending_batches],
                                     "last_input_sha256": last_fingerprint})
        self.state["batches_done"] = start + self.pending_batches
        if start == 0:
            self.state["first_input_sha256"] = self.first_fingerprint
        self.state["rows"] += rows
        self._commit()
        self.buffer = [[] for _ in self.layers]
        self.index_buffer = []
        self.buffered_bytes = 0
        self.pending_batches = 0

    def _commit(self):
        write_atomic(os.path.join(self.out, PROGRESS), dump_json(self.state))

    def consolidate(self):
        """Concatenate the shards into one file per layer, write the manifest, drop the shards."""
        shards = [checked_member(self.out, s["file"]) for s in self.state["shards"]]
        headers = [read_header(p) for p in shards]
        names, described = [], []
        columns = [(f"layer_{i:03d}.safetensors", str(i), info) for i, info in enumerate(self.state["layer_info"])]
        indexed = bool(headers) and "index" in headers[0][0]
        if indexed:
            columns.append((SAMPLE_INDEX, "index", {"name": "sample_index", "label": "", "dtype": "I64",
                                                     "row_shape": []}))
        for name, key, info in columns:
            shape = [self.state["rows"]] + info["row_shape"]
            dtype = DTYPES[info["dtype"]]
            path = safe_member(self.out, name)
            with atomic_file(path) as f:
                f.write(header_bytes({"activations": (dtype, shape)}, {"layer": info["name"], "label": info["label"]}))
                for shard, (header, data_start) in zip(shards, headers):
                    start, end = header[key]["data_offsets"]
                    copy_range(shard, data_start + start, data_start + end, f)
            names.append(name)
            if key != "index":
                described.append(dict(info, file=name, shape=shape))
        extra = {"layers": described, "rows": self.state["rows"], "batches": self.batches_done,
                 "model": self.state["model"]}
        if indexed:
            extra["sample_index"] = SAMPLE_INDEX
        write_manifest(self.out, EXTRACT_FORMAT, EXTRACT_SCHEMA, names, extra)
        self.state["complete"] = True
        self.state["shards"] = []
        self._commit()
        for shard in shards:
            os.remove(shard)


def _is_leftover(name: str) -> bool:
    # Temporary files a killed run may leave before its first progress.json is in place.
    return name.endswith(".tmp") and name.startswith(("shard_", "layer_", PROGRESS))


def _same_layer(known: dict, info: dict, by_module: bool) -> bool:
    """Whether a batch's op for a layer is the one earlier batches gave: the same name, dtype and row shape, and
    the same op up to its layer number (``linear_1_14:1`` and ``linear_1_9:1`` are both the first linear), which
    moves when a forward runs ops before it that another did not (FSDP2's first forward makes the unsharded
    parameters that later forwards reuse).  A layer named by its module call (``by_module``) is that call's
    output whichever op made it: a padded batch runs more ops before it than an unpadded one (transformers
    builds the attention mask only when some position is masked), so its label may differ in any number."""
    if by_module:
        return (known["dtype"], known["row_shape"]) == (info["dtype"], info["row_shape"])
    return {**known, "label": _without_layer_number(known["label"])} == \
        {**info, "label": _without_layer_number(info["label"])}


def _ragged_rows_hint(known: dict, info: dict, by_module: bool) -> str:
    """What to do when only the rows' shape changed between batches (inputs of another sequence length): a
    layer is one array, so every row needs one shape."""
    same_op = known["dtype"] == info["dtype"] and \
        (by_module or _without_layer_number(known["label"]) == _without_layer_number(info["label"]))
    if not same_op or len(known["row_shape"]) != len(info["row_shape"]):
        return ""
    return ("; a layer is stored as one array, so its rows need one shape in every batch: pad every input to one "
            "length (a tokenizer's padding='max_length', with the attention mask), extract a layer whose shape does "
            "not depend on the length (a pooled output), or run tl.extract once per length")


def _without_layer_number(label: str) -> str:
    """``linear_1_14:1`` -> ``linear_1:1``; a label without a layer number (``input_1:1``) as it is."""
    found = re.fullmatch(r"(.+_\d+)_\d+(:\d+)", label)
    return found.group(1) + found.group(2) if found else label
