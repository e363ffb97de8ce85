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

A resume must continue the same job: ``progress.json`` records a checksum of the model (see
``identity.py``) and the call's arguments (layers, keyword arguments, batch settings), and a resume that
differs in any of them is refused with ``ResumeMismatchError`` rather than mixing rows of two models.
Every write is atomic (temporary file, fsync, rename), so a kill at any instant, the very first
``progress.json`` included, leaves a folder the next call resumes from.
"""

from __future__ import annotations

import hashlib
import os
import re

import torch

from ..checks import check_path
from ..errors import ResumeMismatchError, add_note, counted, first_few, warn_user
from ..progress import bar as progress_bar
from ..labels.naming import folded
from ..record.layouts import shape_of, shape_text, storage_holders
from ..capture.collectives import process_rank
from ..capture.restore import module_run_by
from ..tree import path_text, strip, tensor_leaves, without_values
from .format import (MANIFEST, TraceFileError, atomic_file, check_schema, checked_member, dump_json, make_folder,
                     read_json, require_numpy, safe_member, write_atomic, write_manifest)
from .encode import has_no_storage
from .identity import model_checksum
from .extract_job import check_same_job, stable_repr
from .extract_progress import PROGRESS, check_progress, check_shard_columns
from .extract_args import batch_count, batch_reader, check_inputs, check_layers, check_options
from .extract_rows import batch_dimension, check_batch_dim, check_input_batch_dim, rows_first
from .extract_grads import backward_through, check_request, grad_columns, layer_grad
from .tensorfile import DTYPES, NAME_OF, copy_range, hash_values, header_bytes, read_header, write_stacked

EXTRACT_FORMAT, EXTRACT_SCHEMA = "torchlens-extraction", 1
SAMPLE_INDEX = "sample_index.safetensors"  # the dataset index of every row, where the rows carry one


def extract(model, inputs, layers, out, *, args_of=None, kwargs=None, kwargs_of=None,
            shard_bytes: int = 64 << 20, progress: bool = True, barrier_timeout: float = 1800.0, stop_after=None,
            grads: bool = False, loss_fn=None, root=None, batch_dim=None, input_batch_dim: int = 0) -> str:
    """Trace ``model`` on every batch of ``inputs`` and write ``layers``' activations under ``out``.

    Args:
        inputs: an iterable of batches (a list, a generator, a ``DataLoader``).  A batch follows
            ``tl.trace``'s rule: a tuple is the positional arguments, any other value (a tensor, a
            list, a dict) the single positional argument; give ``args_of`` to pick them out of richer batches
            (``args_of=lambda batch: batch[0]`` drops the labels of an ``(x, y)`` loader).  The order must
            be the same on every run for a resume to be valid.
        layers: what to keep, each naming one op per batch: an op label (``linear_1_1:2``), a single-pass
            layer label, a module address called once per forward (``features.3``) or a module call
            (``encoder.layers.0:1``).  Activations are stacked along their batch dim, dim 0 unless ``batch_dim``
            names another.  A batch's size is dim 0 of its first input tensor whose dim 0 is not 1, and a layer's
            batch dim that does not have it is refused; one that has it by coincidence in every batch cannot be
            told from a batch dim (transformers' gemma3n altup layers are ``(altup_num_inputs, B, S, H)``: at a
            batch size of ``altup_num_inputs`` their dim 0 passes) and its rows would not be examples: name such
            a layer's batch dim in ``batch_dim``.
        out: the folder to write; calling again with the same folder resumes or, when complete, returns.
        kwargs: keyword arguments passed to every forward.
        kwargs_of: a function giving a batch's own keyword arguments, as a dict (``kwargs_of=dict`` for the
            dict batches of a tokenized ``transformers`` dataset, which the model takes as ``model(**batch)``).
            With ``kwargs_of`` and no ``args_of``, the forward gets no positional arguments.
        shard_bytes: buffer size before a shard is written: the bound on extra memory used.
        progress: show a progress bar on stderr (needs tqdm).
        barrier_timeout: under ``torch.distributed``, how long (seconds) a rank that finished waits for the
            others before naming the ones that did not arrive.
        stop_after: stop each forward once this site (a module address or call, or an op label) is produced,
            as ``tl.trace(stop_after=...)``: the cheap way to extract early layers.
        grads: also write each layer's gradient, d loss / d activation, as ``grad:<layer>``; needs
            ``loss_fn(output, batch)`` returning the loss to backpropagate (see io/extract_grads.py).
        root: for a callable that is not a module, a bound method or a partial of one (a lambda), the module it
            runs, as for ``tl.trace``: its modules are named by address, and its weights are what a resume checks.
        batch_dim: ``{layer: dim}`` for the layers whose batch dim is not dim 0 (``{"layers.0": 1}`` for a gemma3n
            decoder layer); that dim is moved first, so each row is one example (its gradient's too).
        input_batch_dim: the dim of the inputs that counts the batch's examples, read from the first input tensor
            whose size there is not 1: 0, or 1 for a sequence-first model (``nn.TransformerEncoderLayer``,
            ``nn.LSTM``, ``nn.MultiheadAttention`` without ``batch_first=True``) taking ``(S, B, E)`` inputs, whose
            sequence length would otherwise be read as the batch size.  It does not move the layers' batch dim:
            name a sequence-first layer's (1) in ``batch_dim``.

    Returns the folder's path; read it with ``tl.load_extracted(out)``.  The model runs under
    ``torch.no_grad()`` with its own train/eval mode (call ``.eval()`` first for inference features).

    Inside an initialised ``torch.distributed`` process group (``torchrun``), each rank extracts its share
    into ``out/rank-{r}/`` and the shares are joined in dataset order when all ranks are done; see
    docs/distributed.md.
    """
    out = check_path(out, "out", "give the folder to write (a str or a pathlib.Path)", who="tl.extract")
    if not out:
        raise TraceFileError("tl.extract: out is an empty path; give the folder to write the activations to "
                             "(out='features')")
    layers = check_layers(layers)
    check_options(kwargs, shard_bytes, progress, barrier_timeout, root)
    check_inputs(inputs)
    check_request(grads, loss_fn, stop_after)
    batch_dim = check_batch_dim(batch_dim, layers)
    input_batch_dim = check_input_batch_dim(input_batch_dim)
    arguments_of = batch_reader(args_of, kwargs_of, kwargs)
    if process_rank()[0] is not None:
        from ..distributed.extraction import extract_ranks

        return extract_ranks(model, inputs, layers, out, arguments_of=arguments_of, kwargs=kwargs,
                             shard_bytes=shard_bytes, progress=progress, barrier_timeout=barrier_timeout,
                             stop_after=stop_after, grads=grads, loss_fn=loss_fn, root=root, batch_dim=batch_dim,
                             input_batch_dim=input_batch_dim)
    return extract_folder(model, inputs, layers, out, arguments_of=arguments_of, kwargs=kwargs,
                          shard_bytes=shard_bytes, progress=progress, stop_after=stop_after, grads=grads,
                          loss_fn=loss_fn, root=root, batch_dim=batch_dim, input_batch_dim=input_batch_dim)


def extract_folder(model, inputs, layers, out, *, arguments_of, kwargs, shard_bytes, progress, indices_of=None,
                   arguments=None, stop_after=None, grads=False, loss_fn=None, root=None, before_forward=None,
                   batch_dim=None, input_batch_dim: int = 0) -> str:
    """One process's extraction into ``out``.  ``indices_of(position)`` gives the sample index of each row of
    batch ``position`` (stored with the rows); ``arguments`` are extra settings a resume must match;
    ``before_forward()``, when given, is called before each forward (ranks that must run forwards in step);
    ``batch_dim``: ``{layer: its batch dim}`` where that is not dim 0 (``check_batch_dim``); ``input_batch_dim``:
    the inputs' batch dim, which the batch size is read from (``batch_dimension``)."""
    require_numpy("tl.extract")  # the model checksum and the written shards read tensors' bytes through it
    model, root, checked, job = extraction_job(model, layers, kwargs, inputs, grads, arguments, root, batch_dim,
                                               input_batch_dim)
    run = _Run(out, shard_bytes, job, [(batch_dim or {}).get(name, 0) for name in layers] * (2 if grads else 1))
    if root is None and (run.complete or run.batches_done):
        warn_user(f"{out} was extracted with a callable that names no model, so whether its weights have changed "
                  "since cannot be checked; pass root= the model it runs")
    if run.complete:
        return out
    resumed_from = run.batches_done
    bar = progress_bar(progress, "extracting", batch_count(inputs), "batch",
                       initial=resumed_from, delay=0, leave=True)
    seen, last = 0, None
    try:
        for position, batch in enumerate(inputs):
            seen = position + 1
            args, named = arguments_of(batch, position)
            if position < resumed_from:
                if position in (0, resumed_from - 1):
                    run.check_boundary(inputs_fingerprint(args, named), position)
                continue
            last = args, named  # hashed only where a shard is committed
            if position == 0:
                run.first_fingerprint = inputs_fingerprint(args, named)
            if before_forward is not None:
                before_forward()
            rows, request = batch_dimension(args, named, input_batch_dim), (loss_fn, batch) if grads else None
            with torch.enable_grad() if grads else torch.no_grad():
                run.add(_extract_batch(model, args, {**(kwargs or {}), **named}, layers, run, position, stop_after,
                                       request, root, rows),
                        rows[0], position, None if indices_of is None else indices_of(position))
            if run.buffered_bytes >= run.shard_bytes:
                run.flush(inputs_fingerprint(*last))
            bar.update(1)
        if seen < resumed_from:
            raise ValueError(f"inputs yielded {seen} batches, but {out} already holds {resumed_from}: resuming needs "
                             f"the same inputs. Delete {out} to start over")
        if seen == 0:
            raise ValueError("inputs yielded no batches; nothing was extracted")
        if run.pending_batches:
            run.flush(inputs_fingerprint(*last))
        run.consolidate()
    except BaseException:
        run.note_stop(checked)
        raise
    finally:
        bar.close()
    return out


def extraction_job(model, layers, kwargs, inputs, grads, arguments=None, root=None, batch_dim=None,
                   input_batch_dim: int = 0) -> tuple:
    """``(the callable to run, the module it runs or None, what a rerun's checksum reads, the job)``: the job is
    what a resume, or a call into a complete folder, must match (see ``extract_job.py``)."""
    # The module the callable runs (itself, a bound method's, a partial's, or root=): what a resume checks.
    root = traced_module(root if root is not None else model)
    if isinstance(model, torch.nn.Module) and traced_module(model) is root:
        model = root  # not its DDP wrapper: the backward of grads= leaves the parameters' .grad as they were
    checked = root if root is not None else model
    job = {"layers": grad_columns(layers) if grads else layers, "model": type(checked).__name__,
           "model_sha256": model_checksum(checked),
           "arguments": dict(_arguments(layers, kwargs, inputs), grads=bool(grads), **(arguments or {}))}
    # None when every layer is batch-major, as a folder made before batch_dim= existed records it (by its absence)
    job["arguments"]["batch_dim"] = dict(batch_dim) if batch_dim else None
    job["arguments"]["input_batch_dim"] = input_batch_dim or None  # likewise absent from older folders when 0
    return model, root, checked, job


def _arguments(layers, kwargs, inputs) -> dict:
    """What must match for a resume to continue the same job (the model is checked by its checksum)."""
    kwargs_sha256 = None
    if kwargs:  # tensors by value, everything else by its repr
        kwargs_sha256 = hashlib.sha256(f"{inputs_fingerprint(kwargs)}{stable_repr(strip(kwargs))}".encode()).hexdigest()
    return {"layers": layers, "kwargs_sha256": kwargs_sha256,
            "batch_size": getattr(inputs, "batch_size", None), "drop_last": getattr(inputs, "drop_last", None)}


def inputs_fingerprint(args, named=None) -> str:
    """A hash of a batch's tensors (its positional arguments, then its own keyword arguments), used to
    check a resumed run sees the same inputs as before."""
    require_numpy("tl.extract")  # Tensor.numpy below
    digest = hashlib.sha256()
    for root, value in (("args", args), ("kwargs", named)):
        for path, t in tensor_leaves(value) if value else ():
            if without_values(t):
                raise TypeError(f"tl.extract stores activations' values, and the input {path_text(root, path)} is a "
                                f"{'meta' if t.is_meta else 'fake (FakeTensorMode)'} tensor, with a shape and no "
                                "values; run the model on a real device")
            if has_no_storage(t) and not t.is_nested:  # a jagged nested tensor is hashed by its parts
                raise TypeError(f"tl.extract hashes its inputs' values to check a resumed run, and the input "
                                f"{path_text(root, path)} is a {type(t).__name__} tensor subclass with no storage "
                                "of its own; pass the plain tensor it wraps")
            hash_values(digest, path_text(root, path), t.detach())
    return digest.hexdigest()


def batch_rows(args, named=None, input_batch_dim: int = 0):
    """The batch's row count (see ``batch_dimension``), or None when it has no tensor of a dimension or more."""
    return batch_dimension(args, named, input_batch_dim)[0]


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


def traced_module(model):
    """The module a callable runs, as ``tl.trace`` traces it: behind a DDP, DataParallel or ``torch.compile``
    wrapper, the module it wraps, whose addresses the layers name (``fc1``, not ``module.fc1``)."""
    from ..capture.wrappers import unwrap

    module = module_run_by(model)
    return None if module is None else unwrap(module)


def _save_targets(model, layers) -> list:
    modules = dict(model.named_modules()) if isinstance(model, torch.nn.Module) else {}
    from ..capture.saving import LayerSelection

    targets = LayerSelection()  # labels and modules: a module named relu is no op type here
    for name in layers:
        prefix = name.rsplit(":", 1)[0]
        # "fc:2" is saved as fc's outputs; ":1" names no module (the model's own address, "", would be refused as one)
        targets.append(prefix if ":" in name and prefix and prefix in modules else name)
    return targets


def _extract_batch(model, args, kwargs, layers, run, position, stop_after=None, grads=None, root=None,
                   rows=(None, None, "")) -> list:
    from ..capture.session import trace

    from ..errors import AmbiguousKey, UnmatchedSelection

    targets = _save_targets(root if root is not None else model, layers)
    try:
        log = trace(model, args, kwargs, save=targets, stop_after=stop_after,
                    grads=targets if grads is not None else False, root=root)
    except (UnmatchedSelection, AmbiguousKey) as exc:  # (a LayerSelection's refusals name layers=)
        raise type(exc)(f"batch {position}: {exc}") from None
    except Exception as exc:  # the model's own error: which of thousands of batches, and what is kept
        add_note(exc, f"tl.extract: raised while tracing batch {position} (counting from 0); "
                 f"{counted(run.batches_done, 'batch', 'batches')} {'is' if run.batches_done == 1 else 'are'} "
                 f"committed in {run.out}, and calling tl.extract again with the same arguments resumes after them")
        raise
    try:
        if grads is not None:
            backward_through(log, *grads, position, root if root is not None else model)
        acts = _layer_values(log, layers, run, position, grads is not None, rows)
    finally:
        log.cleanup()
    del log  # the trace is released: what still holds an activation's memory now is not this batch's trace
    return [_buffered(t) for t in acts]


def _layer_values(log, layers, run, position, with_grads: bool, rows=(None, None, "")) -> list:
    """Each layer's activation (then, ``with_grads``, its gradient) in this batch, detached, on the CPU, its batch
    dim first; ``rows``: the batch's size and the input it was read from (``batch_dimension``)."""
    calls = _module_calls_by_name(log)
    ops = [_resolve(log, name, position, calls) for name in layers]
    tensors = [op.activation for op in ops]
    by_module = [name in calls for name in layers]  # a module's output, whichever op made it
    if with_grads:
        ops, tensors = ops + ops, tensors + [layer_grad(op, name, position) for op, name in zip(ops, layers)]
        by_module += by_module
    acts = []
    for i, (name, op, t) in enumerate(zip(run.layers, ops, tensors)):
        if t is None:
            raise RuntimeError(f"batch {position}: {name} ({op.label}) was not saved")
        check_storable(name, op.label, t)
        t = rows_first(name, op.label, t.detach(), run.batch_dims[i], rows, position,
                       matched_before=run.state["layer_info"][i] is not None)
        run.check_layer(i, name, op.label, t, position, by_module=by_module[i])
        acts.append(t.to("cpu"))
    return acts


def _buffered(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the shard buffer keeps it until the shard is written, batches later: ``t`` itself when only it
    holds its memory, else a copy.  A view would keep its whole base alive in the buffer, past the shard
    bound; and memory the model keeps (a buffer updated in place, a key/value cache, a view of either) is
    written again by the next batches' forwards, which would leave this batch's rows holding their values."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size() or storage_holders(t) > 2:
        return t.clone()
    return t


def _resolve(log, name, position, calls: dict):
    from ..record.modules import Module
    from ..record.op import Layer, Op

    try:
        found = log[name]
    except KeyError as exc:
        raise KeyError(f"batch {position}: {exc.args[0]}{_op_type_note(log, name)}") from None
    if isinstance(found, Layer):
        if found.num_passes > 1:
            raise ValueError(f"{name} ran {found.num_passes} times per forward; name one pass: "
                             f"{', '.join(op.label for op in found.ops[:3])} ...")
        found = found.first
    if isinstance(found, Module) and found.num_calls > 1:
        raise ValueError(f"module {name} is called {found.num_calls} times per forward; name one call: "
                         f"{', '.join(found.call_labels[:3])} ...")
    if not isinstance(found, Op):  # a module call returning no tensor, or whose first tensor no op holds
        raise ValueError(f"{name} does not name one op: its call returned no tensor, or one written through a view "
                         "after the op that made it, which no op holds (see tracing); name an op by its label")
    call = calls.get(name)
    outputs = list(dict.fromkeys(call.output_ops)) if call is not None else []
    if len(outputs) > 1:
        raise ValueError(f"module call {name} returns {len(outputs)} tensors ({', '.join(outputs)}); name the one "
                         "to extract by its op label")
    return found


def _op_type_note(log, name) -> str:
    """What to give instead when a layers= entry is an op type (``relu``): a type names every op of it, and a
    layer must be one op per forward."""
    op_type = folded(name)
    typed = [op.label for op in log.ops if op.type == op_type and op.kind == "op"]
    if not typed:
        return ""
    return (f". layers= takes no op types: {name!r} is the type of {len(typed)} op(s) ({first_few(typed)}), and each "
            "layer must be one op per forward; give one op's label, or the address of the module that makes it")


def _module_calls_by_name(log) -> dict:
    """Each name of a module call (its label, its address, its module's other addresses) -> the first call it
    names, in one pass over the calls: looking each layer up by scanning the calls made extracting n layers
    of an n-module model n * n work per batch."""
    named: dict = {}
    for call in log.module_calls:
        for name in (call.label, call.address, *call.module.all_addresses):
            named.setdefault(name, call)
    return named


def refuse_nested(name: str, label: str, t: torch.Tensor) -> None:
    """Refuse a nested (ragged) activation: it has no single shape, so it can neither be stacked along dim 0
    nor held by safetensors (asked for its shape, torch raises an internal error instead)."""
    if t.is_nested:
        shape = shape_text(shape_of(t))
        raise TypeError(f"{name} ({label}) is a nested tensor of shape {shape} ('?': sizes differ between "
                        "its components), which cannot be stored in safetensors or stacked along dim 0; choose a "
                        "layer after it is converted back to a padded tensor (to_padded_tensor)")


def check_storable(name: str, label: str, t: torch.Tensor) -> None:
    """Refuse an activation a safetensors file cannot hold, saying which layer to choose instead."""
    refuse_nested(name, label, t)
    if without_values(t):
        raise TypeError(f"{name} ({label}) is a {'meta' if t.is_meta else 'fake (FakeTensorMode)'} tensor, with a "
                        "shape and no values to store; run the model on a real device")
    if has_no_storage(t):
        raise TypeError(f"{name} ({label}) is a {type(t).__name__} tensor subclass with no storage of its own, "
                        "whose values tl.extract cannot store; select a layer that makes a plain tensor")
    if NAME_OF.get(t.dtype) is None or t.layout != torch.strided:
        instead = ("extract the layer that dequantizes it" if t.is_quantized
                   else "select a layer that makes a dense tensor of a dtype safetensors stores")
        raise TypeError(f"{name} ({label}): {t.dtype} {t.layout} activations cannot be stored in safetensors; "
                        f"{instead}")


class _Run:
    """The extraction folder's state: committed shards, the buffer, and what each layer looks like."""

    def __init__(self, out, shard_bytes, job, batch_dims):
        self.out, self.layers, self.shard_bytes = out, job["layers"], max(int(shard_bytes), 1)
        self.batch_dims = batch_dims  # each column's batch dim in the model's activation
        self.buffer = [[] for _ in self.layers]
        self.index_buffer = []
        self.buffered_bytes = 0
        self.pending_batches = 0
        self.first_fingerprint = None
        make_folder(out, out, "extract")
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

    def _nothing_committed(self) -> bool:
        # A run that failed before its first shard (a mistyped layer name, say) leaves nothing to keep.
        s = self.state
        return isinstance(s, dict) and s.get("format") == EXTRACT_FORMAT and s.get("batches_done") == 0 \
            and not s.get("shards") and not s.get("complete")

    def _check_resumable(self, job):
        s = self.state
        if not isinstance(s, dict) or s.get("format") != EXTRACT_FORMAT:
            raise TraceFileError(f"{self.out}/{PROGRESS}: not the progress file of a torchlens extraction")
        check_schema(f"{self.out}/{PROGRESS}", "the progress file", s.get("schema_version"), EXTRACT_SCHEMA)
        check_same_job(self.out, s, job)
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
