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
removed; ``tl.load_extracted`` reads those files as memory maps.  The folder's state, its shards and the
join are ``extract_shards.py``'s.

A resume must continue the same job: ``progress.json`` records a checksum of the model (see
``identity.py``) and the call's arguments (layers, keyword arguments, batch settings), and a resume that
differs in any of them is refused with ``ResumeMismatchError`` rather than mixing rows of two models.
Every write is atomic (temporary file, fsync, rename), so a kill at any instant, the very first
``progress.json`` included, leaves a folder the next call resumes from.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect

import torch

from ..checks import check_model, check_path
from ..errors import (ResumeMismatchError, add_note, closest_hint, counted, first_few,  # noqa: F401 (re-exported)
                      warn_user)
from ..progress import QUIET, bar as progress_bar
from ..labels.naming import folded
from ..record.layouts import holds_more_than_itself, shape_of, shape_text, storage_holders
from ..capture.collectives import process_rank
from ..capture.restore import module_run_by
from ..capture.teardown import restore_grad_mode
from ..tree import path_text, strip, tensor_leaves, without_values
from .format import TraceFileError, require_numpy
from .encode import has_no_storage
from .identity import model_checksum
from .extract_job import stable_repr
from .extract_shards import ExtractionRun
from .extracted import refuse_unfinished
from .extract_args import (UNBATCHED_NOTE, batch_count, batch_reader, check_inputs, check_layers, check_options,
                           unbatched_loader)
from .extract_rows import batch_dimension, check_batch_dim, check_input_batch_dim, rows_first
from .extract_grads import backward_through, check_request, grad_columns, layer_grad
from .tensorfile import NAME_OF, fake_mode_active, hash_values



def extract(model, inputs, layers, out, *, args_of=None, kwargs=None, kwargs_of=None,
            shard_bytes: int = 64 << 20, progress: bool | None = None, barrier_timeout: float = 1800.0, stop_after=None,
            grads: bool = False, loss_fn=None, root=None, batch_dim=None, input_batch_dim: int = 0, **unknown) -> str:
    """Trace ``model`` on every batch of ``inputs`` and write ``layers``' activations under ``out``.

    Args:
        inputs: an iterable of batches (a list, a generator, a ``DataLoader``).  A batch follows
            ``tl.trace``'s rule: a tuple is the positional arguments, any other value (a tensor, a
            list, a dict) the single positional argument; give ``args_of`` to pick them out of richer batches
            (``args_of=lambda batch: batch[0]`` drops the labels of an ``(x, y)`` loader).  The order must
            be the same on every run for a resume to be valid.
        layers: what to keep, each naming one op per batch: an op label (``linear_1_1:2``), a single-pass
            layer label, a module address called once per forward (``features.3``), a module call
            (``encoder.layers.0:1``) or an input's or output's path (``input.attention_mask``).  Activations are
            stacked along their batch dim, dim 0 unless ``batch_dim`` names another.  A batch's size is dim 0 of
            its first input tensor whose dim 0 is not 1, and a layer's batch dim that does not have it is refused;
            one that has it by coincidence in every batch cannot be told from a batch dim (transformers' gemma3n
            altup layers are ``(altup_num_inputs, B, S, H)``: at a batch size of ``altup_num_inputs`` their dim 0
            passes) and its rows would not be examples: name such a layer's batch dim in ``batch_dim``.
        out: the folder to write; calling again with the same folder resumes or, when complete, returns.
        kwargs: keyword arguments passed to every forward.
        kwargs_of: a function giving a batch's own keyword arguments, as a dict (``kwargs_of=dict`` for the
            dict batches of a tokenized ``transformers`` dataset, which the model takes as ``model(**batch)``).
            With ``kwargs_of`` and no ``args_of``, the forward gets no positional arguments.
        shard_bytes: buffer size before a shard is written: the bound on extra memory used.
        progress: a bar over the batches on stderr: None (automatic) on an interactive terminal or in a notebook
            when tqdm is installed, True anywhere (needs tqdm), False never.
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
    arrival = _distributed_arrival()
    with arrival.refusals() if arrival is not None else contextlib.nullcontext():
        if unknown:
            _refuse_unknown_options(unknown)
        check_model(model, "tl.extract")
        _refuse_fake_mode()
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
    if arrival is not None:
        from ..distributed.extraction import extract_ranks

        return extract_ranks(model, inputs, layers, out, arguments_of=arguments_of, kwargs=kwargs,
                             shard_bytes=shard_bytes, progress=progress, barrier_timeout=barrier_timeout,
                             stop_after=stop_after, grads=grads, loss_fn=loss_fn, root=root, batch_dim=batch_dim,
                             input_batch_dim=input_batch_dim, arrival=arrival)
    return extract_folder(model, inputs, layers, out, arguments_of=arguments_of, kwargs=kwargs,
                          shard_bytes=shard_bytes, progress=progress, stop_after=stop_after, grads=grads,
                          loss_fn=loss_fn, root=root, batch_dim=batch_dim, input_batch_dim=input_batch_dim)


def _refuse_fake_mode() -> None:
    """Refuse an extraction under ``FakeTensorMode``, which makes every activation a tensor without values: with
    a model made outside the mode, reading its weights for the resume check failed inside torch (".numpy() is
    not supported for tensor subclasses")."""
    if fake_mode_active():
        raise TypeError("tl.extract stores activations' values, and it is called under FakeTensorMode, whose tensors "
                        "have a shape and no values; call tl.extract outside the FakeTensorMode block")


def _distributed_arrival():
    """Under ``torch.distributed``, this rank's call, counted before its arguments are checked (see
    distributed/arrival.py: a rank refusing its own must still meet the others at their next call); else None."""
    if process_rank()[0] is None:
        return None
    from ..distributed.arrival import Arrival

    return Arrival.begun(None, "tl.extract")


# help(tl.extract) shows the options it takes: **unknown is there only to refuse the others in its own words.
extract.__signature__ = inspect.signature(extract).replace(
    parameters=[p for p in inspect.signature(extract).parameters.values() if p.kind != p.VAR_KEYWORD])
OPTIONS = tuple(name for name, p in inspect.signature(extract).parameters.items() if p.kind == p.KEYWORD_ONLY)


def _refuse_unknown_options(unknown: dict) -> None:
    """A keyword tl.extract does not take, named with the option meant or with where a forward's keyword goes
    (``kwargs=``, for every batch): Python's own refusal named neither."""
    name = next(iter(unknown))
    meant = "; tl.extract saves what layers names, and nothing else" if name == "save" else \
        closest_hint(name, OPTIONS)
    raise TypeError(f"tl.extract() got an unexpected keyword argument {name!r}{meant}; if {name!r} is a keyword "
                    f"argument of the forward, give it in kwargs, for every batch: kwargs={{{name!r}: ...}}")


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
    dims = [(batch_dim or {}).get(name, 0) for name in layers]
    run = ExtractionRun(out, shard_bytes, job, dims * (2 if grads else 1))
    if root is None and (run.complete or run.batches_done):
        warn_user(f"{out} was extracted with a callable that names no model, so whether its weights have changed "
                  "since cannot be checked; pass root= the model it runs")
    if run.complete:
        refuse_unfinished(out)  # returned without its manifest, the folder is one tl.load_extracted refuses
        return out
    resumed_from = run.batches_done
    seen, last, bar, grad = 0, None, QUIET, torch.is_grad_enabled()
    try:
        bar = progress_bar(progress, "extracting", batch_count(inputs), "batch",  # progress=True needs tqdm
                           initial=resumed_from, delay=0, leave=True)
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
            rows = counted_rows(args, named, input_batch_dim, run)
            request = (loss_fn, batch) if grads else None
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
    except BaseException as exc:
        restore_grad_mode(grad)  # an interrupt as a batch's no_grad() block ended leaves gradients off
        run.note_stop(checked)
        with contextlib.suppress(OSError):  # best effort: the error that stopped the run is what the caller sees
            run.discard_if_empty()
        if seen <= 1 and unbatched_loader(inputs):  # a loader of single examples fails at its first batch
            add_note(exc, UNBATCHED_NOTE)
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


def counted_rows(args, named, input_batch_dim: int, counter) -> tuple:
    """``batch_dimension`` of a batch, read from the input that counted the batches before it
    (``counter.rows_source``, an ``ExtractionRun``'s or a rank's share's), which it notes on the first batch:
    a last batch of one example is counted by that input, not by another whose dim happens to be larger."""
    rows = batch_dimension(args, named, input_batch_dim, counter.rows_source)
    counter.rows_source = counter.rows_source or rows[3]
    return rows


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


def _kept(run) -> str:
    """What a run stopped by an error leaves: the batches a call with the same arguments resumes after, or nothing
    (``ExtractionRun.discard_if_empty`` removes a run's files when no batch was committed)."""
    done = run.batches_done
    if not done:
        return f"no batch was committed yet, so nothing is kept in {run.out}"
    return (f"{counted(done, 'batch', 'batches')} {'is' if done == 1 else 'are'} committed in {run.out}, and "
            "calling tl.extract again with the same arguments resumes after them")


def _extract_batch(model, args, kwargs, layers, run, position, stop_after=None, grads=None, root=None,
                   rows=(None, None, "", None)) -> list:
    from ..capture.session import trace

    from ..errors import AmbiguousKey, UnmatchedSelection

    targets = _save_targets(root if root is not None else model, layers)
    try:
        log = trace(model, args, kwargs, save=targets, stop_after=stop_after,
                    grads=targets if grads is not None else False, root=root)
    except (UnmatchedSelection, AmbiguousKey) as exc:  # (a LayerSelection's refusals name layers=)
        raise type(exc)(f"batch {position}: {exc}") from None
    except Exception as exc:  # the model's own error: which of thousands of batches, and what is kept
        add_note(exc, f"tl.extract: raised while tracing batch {position} (counting from 0); {_kept(run)}")
        raise
    try:
        if grads is not None:
            backward_through(log, *grads, position, root if root is not None else model)
        acts = _layer_values(log, layers, run, position, grads is not None, rows)
    finally:
        log.cleanup()
    del log  # the trace is released: what still holds an activation's memory now is not this batch's trace
    return [_buffered(t) for t in acts]


def _layer_values(log, layers, run, position, with_grads: bool, rows=(None, None, "", None)) -> list:
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
                       earlier_rows=_row_shape(run.state["layer_info"][i]))
        run.check_layer(i, name, op.label, t, position, by_module=by_module[i])
        acts.append(t.to("cpu"))
    return acts


def _row_shape(info):
    """The shape of one row of a layer in the earlier batches (``check_layer``'s record), None before the first."""
    return None if info is None else info["row_shape"]


def _buffered(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the shard buffer keeps it until the shard is written, batches later: ``t`` itself when only it
    holds its memory, else a copy.  A view would keep its whole base alive in the buffer, past the shard
    bound; and memory the model keeps (a buffer updated in place, a key/value cache, a view of either) is
    written again by the next batches' forwards, which would leave this batch's rows holding their values."""
    if holds_more_than_itself(t) or storage_holders(t) > 2:
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
