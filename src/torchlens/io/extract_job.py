"""What an extraction folder was made by, and the check that a later call into it is the same job.

A job is the layers as stored, the model's class name, a checksum of its weights and the call's arguments
(``io/extract.py`` builds it).  A resume must continue the same job, and a call into a complete folder must
ask for what the folder holds, or it would be handed rows another call asked for: both are refused with
``ResumeMismatchError``, in one process (against ``progress.json``) and after a distributed join (against
each rank's job, kept in the joined manifest).
"""

from __future__ import annotations

import re

from ..errors import ResumeMismatchError

JOB_KEYS = ("layers", "model", "model_sha256", "model_sha256_at_stop", "arguments")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def stable_repr(value) -> str:
    """``repr(value)`` without the memory addresses of Python's default reprs (``<function gelu at 0x7f...>``): they
    differ from one process to the next, so that the same call, made again after a kill, read as another job."""
    return _ADDRESS.sub("", repr(value))


def recorded_job(state: dict) -> dict:
    """The part of a folder's progress state that says which job made it."""
    return {k: state.get(k) for k in JOB_KEYS if k in state}


def layer_dims(layer_info) -> dict:
    """``{layer: its activation's dim count}`` from a folder's layer records (``progress.json``'s ``layer_info``, a
    joined manifest's ``layers``): a row shape and the batch dim."""
    infos = layer_info if isinstance(layer_info, list) else []
    return {info["name"]: len(info["row_shape"]) + 1 for info in infos
            if isinstance(info, dict) and isinstance(info.get("row_shape"), list) and "name" in info}


def _counted_from_the_front(batch_dim, dims: dict):
    """``batch_dim=`` as a job compares it: each layer's dim counted from the front, where its dim count is known
    (-1 of a 2-d layer is 1, the same extraction), dim 0 dropped as the default; None when none is left."""
    if not isinstance(batch_dim, dict):
        return batch_dim
    counted = {name: dim % dims[name] if isinstance(dim, int) and -dims.get(name, 0) <= dim < dims.get(name, 0)
               else dim for name, dim in batch_dim.items()}
    return {name: dim for name, dim in counted.items() if dim != 0} or None


def check_same_job(out, recorded: dict, job: dict, dims: dict | None = None) -> None:
    """Raise ``ResumeMismatchError`` when ``job`` (this call's) is not the ``recorded`` one that made ``out``.
    ``dims``: each layer's dim count in the rows ``out`` holds (``layer_dims``), by which a batch dim counted from
    the end is the same as one counted from the front."""
    model_name = job["model"]
    if recorded.get("layers") != job["layers"] or recorded.get("model") != model_name:
        raise ResumeMismatchError(f"{out} holds an extraction of {recorded.get('model')} layers "
                                  f"{recorded.get('layers')}; this call asks for {model_name} layers {job['layers']}. "
                                  "Use another folder, or delete it to start over")
    if "model_sha256" not in recorded:  # the first torchlens to extract recorded the layers and the model's class alone
        raise ResumeMismatchError(f"{out} was started by an earlier torchlens, which recorded neither a checksum of "
                                  "the model nor the call's arguments, so whether this call continues the same job "
                                  f"cannot be checked; delete {out} and extract again (a finished one loads with "
                                  "tl.load_extracted as it is)")
    # The model as the run started (rebuilt after a kill), or as its own forwards left it when the run stopped (a
    # train-mode BatchNorm updates its running statistics): either is the model that wrote the committed rows.
    if job["model_sha256"] not in (recorded.get("model_sha256"), recorded.get("model_sha256_at_stop")):
        raise ResumeMismatchError(
            f"{out} was extracted with another {model_name} (its parameters or buffers differ: checksum "
            f"{str(recorded.get('model_sha256'))[:12]} vs {job['model_sha256'][:12]}); resuming would mix rows of two "
            f"models. Resume with the model that started it, or use another folder / delete {out}")
    before = recorded.get("arguments") if isinstance(recorded.get("arguments"), dict) else {}
    changed = {k: (before.get(k), v) for k, v in job["arguments"].items()
               if before.get(k) != v and (k != "batch_dim" or _counted_from_the_front(before.get(k), dims or {})
                                          != _counted_from_the_front(v, dims or {}))}
    if changed:
        what = "; ".join(f"{k}: {old!r} then, {new!r} now" for k, (old, new) in changed.items())
        raise ResumeMismatchError(f"{out} was started with other arguments ({what}); resume with the same "
                                  f"call, or use another folder / delete {out}")
