"""``tl.extract``: chosen layers' activations over a whole dataset, streamed to disk, resumable.

Each batch is traced with ``save=`` limited to the requested layers; their activations are moved to the
CPU and buffered until a shard's worth (``shard_bytes``) has accumulated, then written as one
safetensors shard.  Memory therefore stays bounded by one shard whatever the dataset's size.

Resuming: a shard is written to a temporary name, flushed to disk and renamed, and only then does
``progress.json`` (itself replaced atomically) count its batches.  A killed run loses at most the
batches after the last committed shard; the next call with the same ``out`` skips the committed batches
(checking that the input at the boundary is the same one as before) and carries on, so no batch is
written twice or missed.  When every batch is in, the shards are concatenated per layer into one file
each (``layer_000.safetensors`` ...), a manifest with their hashes is written, and the shards are
removed; ``tl.load_extracted`` reads those files as memory maps.
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch

from .format import (MANIFEST, TraceFileError, dump_json, read_json, require_safetensors, safe_member, write_atomic,
                     write_manifest)
from .extract_grads import backward_through, check_request, grad_columns, layer_grad
from .tensorfile import DTYPES, NAME_OF, copy_range, header_bytes, read_header

EXTRACT_FORMAT, EXTRACT_SCHEMA = "torchlens-extraction", 1
PROGRESS = "progress.json"


def extract(model, inputs, layers, out, *, args_of=None, kwargs=None, shard_bytes: int = 64 << 20,
            progress: bool = True, grads: bool = False, loss_fn=None) -> str:
    """Trace ``model`` on every batch of ``inputs`` and write ``layers``' activations under ``out``.

    Args:
        inputs: an iterable of batches (a list, a generator, a ``DataLoader``).  A batch is a tensor or a
            tuple/list of positional arguments; give ``args_of`` to pick them out of richer batches
            (``args_of=lambda batch: batch[0]`` drops the labels of an ``(x, y)`` loader).  The order must
            be the same on every run for a resume to be valid.
        layers: what to keep, each naming one op per batch: an op label (``linear_1_1:2``), a single-pass
            layer label, a module address called once per forward (``features.3``) or a module call
            (``encoder.layers.0:1``).  Activations are stacked along dim 0, which must be the batch dim.
        out: the folder to write; calling again with the same folder resumes or, when complete, returns.
        kwargs: keyword arguments passed to every forward.
        shard_bytes: buffer size before a shard is written: the bound on extra memory used.
        progress: show a progress bar on stderr (needs tqdm).
        grads: also write each layer's gradient, d loss / d activation, as ``grad:<layer>``; needs
            ``loss_fn(output, batch)`` returning the loss to backpropagate (see io/extract_grads.py).

    Returns the folder's path; read it with ``tl.load_extracted(out)``.  The model runs under
    ``torch.no_grad()`` with its own train/eval mode (call ``.eval()`` first for inference features).
    """
    out = os.fspath(out)
    layers = _check_layers(layers)
    check_request(grads, loss_fn)
    run = _Run(out, grad_columns(layers) if grads else layers, type(model).__name__, shard_bytes)
    if run.complete:
        return out
    resumed_from = run.batches_done
    bar = _progress_bar(inputs, resumed_from, progress)
    seen, args = 0, None
    try:
        for position, batch in enumerate(inputs):
            seen = position + 1
            args = _as_args(args_of(batch) if args_of is not None else batch)
            if position < resumed_from:
                if position == resumed_from - 1:
                    run.check_boundary(_fingerprint(args), position)
                continue
            with torch.enable_grad() if grads else torch.no_grad():
                request = (loss_fn, batch) if grads else None
                run.add(_extract_batch(model, args, kwargs, layers, run, position, request), _batch_rows(args),
                        position)
            if run.buffered_bytes >= run.shard_bytes:
                run.flush(_fingerprint(args))
            bar.update(1)
        if seen < resumed_from:
            raise ValueError(f"inputs yielded {seen} batches, but {out} already holds {resumed_from}: resuming needs "
                             f"the same inputs. Delete {out} to start over")
        if seen == 0:
            raise ValueError("inputs yielded no batches; nothing was extracted")
        if run.pending_batches:
            run.flush(_fingerprint(args))
        run.consolidate()
    finally:
        bar.close()
    return out


def _check_layers(layers) -> list:
    if isinstance(layers, str):
        layers = [layers]
    layers = list(layers)
    if not layers or not all(isinstance(name, str) and name for name in layers):
        raise ValueError("layers must be a non-empty list of op labels or module addresses, e.g. ['fc', "
                         "'relu_1_2']")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers lists a name twice: {layers}")
    return layers


def _as_args(batch) -> tuple:
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, (tuple, list)):
        return tuple(batch)
    raise TypeError(f"a batch must be a tensor or a tuple/list of forward arguments, got {type(batch).__name__}; "
                    "pass args_of= to turn your batches into forward arguments")


def _fingerprint(args) -> str:
    """A hash of a batch's tensors, used to check a resumed run sees the same inputs as before."""
    from ..record.finalize import tensor_leaves

    try:
        import numpy  # noqa: F401  (Tensor.numpy below needs it)
    except ImportError as exc:  # pragma: no cover - exercised only where numpy is absent
        raise ImportError("tl.extract needs numpy: pip install numpy") from exc
    digest = hashlib.sha256()
    for path, t in tensor_leaves(args, "args", []):
        t = t.detach().to("cpu").contiguous()
        digest.update(f"{path}{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _batch_rows(args):
    from ..record.finalize import tensor_leaves

    leaves = tensor_leaves(args, "args", [])
    return leaves[0][1].shape[0] if leaves and leaves[0][1].dim() else None


def _save_targets(model, layers) -> list:
    modules = dict(model.named_modules()) if isinstance(model, torch.nn.Module) else {}
    targets = []
    for name in layers:
        prefix = name.rsplit(":", 1)[0]
        targets.append(prefix if ":" in name and prefix in modules else name)
    return targets


def _extract_batch(model, args, kwargs, layers, run, position, grads=None) -> list:
    from ..capture.session import trace

    targets = _save_targets(model, layers)
    log = trace(model, args, kwargs, save=targets, grads=targets if grads is not None else False)
    try:
        if grads is not None:
            backward_through(log, *grads, position)
        acts = []
        ops = [_resolve(log, name, position) for name in layers]
        tensors = [op.activation for op in ops]
        if grads is not None:
            ops, tensors = ops + ops, tensors + [layer_grad(op, name, position) for op, name in zip(ops, layers)]
        for i, (name, op, t) in enumerate(zip(run.layers, ops, tensors)):
            if t is None:
                raise RuntimeError(f"batch {position}: {name} ({op.label}) was not saved")
            run.check_layer(i, name, op.label, t, position)
            t = t.detach().to("cpu")
            if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                t = t.clone()  # a view would keep its whole base alive in the buffer, past the shard bound
            acts.append(t)
        return acts
    finally:
        log.cleanup()


def _resolve(log, name, position):
    from ..record.modules import Module
    from ..record.op import Layer, Op

    try:
        found = log[name]
    except KeyError as exc:
        raise KeyError(f"batch {position}: {exc.args[0]}") from None
    if isinstance(found, Layer):
        if found.num_passes > 1:
            raise ValueError(f"{name} ran {found.num_passes} times per forward; name one pass: "
                             f"{', '.join(op.label for op in found.ops[:3])} ...")
        found = found.first
    if isinstance(found, Module):
        raise ValueError(f"module {name} is called {found.num_calls} times per forward; name one call: "
                         f"{', '.join(found.call_labels[:3])} ...")
    if not isinstance(found, Op):
        raise ValueError(f"{name} does not name one op")
    outputs = _module_outputs(log, name)
    if len(outputs) > 1:
        raise ValueError(f"module call {name} returns {len(outputs)} tensors ({', '.join(outputs)}); name the one "
                         "to extract by its op label")
    return found


def _module_outputs(log, name) -> list:
    """Distinct output op labels of the module call ``name`` names (an address or ``address:call``)."""
    for call in log.module_calls:
        if name in (call.label, call.address) or name in call.module.all_addresses:
            return list(dict.fromkeys(call.output_ops))
    return []


def _progress_bar(inputs, done, enabled):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:  # pragma: no cover - exercised only where tqdm is absent
        raise ImportError("the extraction progress bar needs tqdm: pip install tqdm (or pass progress=False)") \
            from exc
    total = len(inputs) if hasattr(inputs, "__len__") else None
    return tqdm(total=total, initial=done, unit="batch", desc="extracting", file=sys.stderr)


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


class _Run:
    """The extraction folder's state: committed shards, the buffer, and what each layer looks like."""

    def __init__(self, out, layers, model_name, shard_bytes):
        self.out, self.layers, self.shard_bytes = out, layers, max(int(shard_bytes), 1)
        self.buffer = [[] for _ in layers]
        self.buffered_bytes = 0
        self.pending_batches = 0
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, PROGRESS)
        self.state = read_json(path, "a resumed extraction") if os.path.exists(path) else None
        if self.state is not None and not self._nothing_committed():
            self._check_resumable(model_name)
        else:
            if self.state is None and os.listdir(out):
                raise TraceFileError(f"{out} is not empty and holds no extraction; choose an empty or new folder")
            self.state = {"format": EXTRACT_FORMAT, "schema_version": EXTRACT_SCHEMA, "layers": layers,
                          "model": model_name, "complete": False, "batches_done": 0, "rows": 0, "shards": [],
                          "layer_info": [None] * len(layers)}
            self._commit()
        self._remove_uncommitted()

    @property
    def complete(self) -> bool:
        return bool(self.state.get("complete"))

    @property
    def batches_done(self) -> int:
        return self.state["batches_done"]

    def _nothing_committed(self) -> bool:
        # A run that failed before its first shard (a mistyped layer name, say) leaves nothing to keep.
        s = self.state
        return isinstance(s, dict) and s.get("format") == EXTRACT_FORMAT and s.get("batches_done") == 0 \
            and not s.get("shards") and not s.get("complete")

    def _check_resumable(self, model_name):
        s = self.state
        if not isinstance(s, dict) or s.get("format") != EXTRACT_FORMAT or s.get("schema_version") != EXTRACT_SCHEMA:
            raise TraceFileError(f"{self.out}/{PROGRESS}: not a torchlens extraction of schema {EXTRACT_SCHEMA}")
        if s.get("layers") != self.layers or s.get("model") != model_name:
            raise ValueError(f"{self.out} holds an extraction of {s.get('model')} layers {s.get('layers')}; this call "
                             f"asks for {model_name} layers {self.layers}. Use another folder, or delete it to "
                             "start over")
        for shard in s["shards"]:
            path = safe_member(self.out, shard["file"])
            if not os.path.isfile(path) or os.path.getsize(path) != shard["bytes"]:
                raise TraceFileError(f"{path}: committed shard is missing or has the wrong size; delete {self.out} "
                                     "and extract again")

    def _remove_uncommitted(self):
        # Leftovers of a killed run: temporary files and a shard written but never counted.
        keep = {s["file"] for s in self.state["shards"]} | {PROGRESS, MANIFEST}
        keep |= {f"layer_{i:03d}.safetensors" for i in range(len(self.layers))} if self.complete else set()
        for name in os.listdir(self.out):
            if name not in keep and (name.endswith(".tmp") or name.startswith(("shard_", "layer_"))):
                os.remove(os.path.join(self.out, name))

    def check_boundary(self, fingerprint, position):
        shards = self.state["shards"]
        expected = shards[-1]["last_input_sha256"] if shards else None
        if expected is not None and fingerprint != expected:
            raise ValueError(f"input batch {position} differs from the one the interrupted run committed; resuming "
                             "needs the same inputs in the same order (a shuffling DataLoader cannot resume). "
                             f"Delete {self.out} to start over")

    def check_layer(self, i, name, label, t, position):
        info = {"name": name, "label": label, "dtype": NAME_OF.get(t.dtype), "row_shape": list(t.shape[1:])}
        if info["dtype"] is None or t.layout != torch.strided:
            raise TypeError(f"{name}: {t.dtype} {t.layout} activations cannot be stored in safetensors")
        if t.dim() == 0:
            raise ValueError(f"{name} ({label}) is a scalar; extraction stacks activations along dim 0 (the batch)")
        known = self.state["layer_info"][i]
        if known is None:
            self.state["layer_info"][i] = info
        elif known != info:
            raise ValueError(f"batch {position}: {name} is {label} {info['dtype']} rows of {info['row_shape']}, but "
                             f"earlier batches gave {known['label']} {known['dtype']} rows of {known['row_shape']}")

    def add(self, acts, rows, position):
        """Buffer one batch; ``rows`` is its first input's dim 0 (None when it has no tensor)."""
        n = acts[0].shape[0] if rows is None else rows
        for i, t in enumerate(acts):
            if t.shape[0] != n:
                raise ValueError(f"batch {position}: {self.layers[i]} has {t.shape[0]} rows along dim 0, but the batch "
                                 f"has {n}: extraction stacks along dim 0, which must be every layer's batch dimension")
            self.buffer[i].append(t)
            self.buffered_bytes += t.numel() * t.element_size()
        self.pending_batches += 1

    def flush(self, last_fingerprint):
        if not self.pending_batches:
            return
        index = len(self.state["shards"])
        name = f"shard_{index:06d}.safetensors"
        path = safe_member(self.out, name)
        tensors = {str(i): torch.cat(parts) for i, parts in enumerate(self.buffer)}
        tmp = path + ".tmp"
        require_safetensors().save_file(tensors, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        rows = tensors["0"].shape[0]
        start = self.batches_done
        self.state["shards"].append({"file": name, "bytes": os.path.getsize(path), "rows": rows,
                                     "batches": [start, start + self.pending_batches],
                                     "last_input_sha256": last_fingerprint})
        self.state["batches_done"] = start + self.pending_batches
        self.state["rows"] += rows
        self._commit()
        self.buffer = [[] for _ in self.layers]
        self.buffered_bytes = 0
        self.pending_batches = 0

    def _commit(self):
        write_atomic(os.path.join(self.out, PROGRESS), dump_json(self.state))

    def consolidate(self):
        """Concatenate the shards into one file per layer, write the manifest, drop the shards."""
        shards = [safe_member(self.out, s["file"]) for s in self.state["shards"]]
        headers = [read_header(p) for p in shards]
        names, described = [], []
        for i, info in enumerate(self.state["layer_info"]):
            name = f"layer_{i:03d}.safetensors"
            shape = [self.state["rows"]] + info["row_shape"]
            dtype = DTYPES[info["dtype"]]
            path = safe_member(self.out, name)
            with open(path + ".tmp", "wb") as f:
                f.write(header_bytes({"activations": (dtype, shape)}, {"layer": info["name"], "label": info["label"]}))
                for shard, (header, data_start) in zip(shards, headers):
                    start, end = header[str(i)]["data_offsets"]
                    copy_range(shard, data_start + start, data_start + end, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
            names.append(name)
            described.append(dict(info, file=name, shape=shape))
        write_manifest(self.out, EXTRACT_FORMAT, EXTRACT_SCHEMA, names,
                       {"layers": described, "rows": self.state["rows"], "batches": self.batches_done,
                        "model": self.state["model"]})
        self.state["complete"] = True
        self.state["shards"] = []
        self._commit()
        for shard in shards:
            os.remove(shard)
