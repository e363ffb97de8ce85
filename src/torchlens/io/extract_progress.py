"""The checks on an unfinished extraction's ``progress.json`` before a resume trusts it.

``progress.json`` is rewritten as shards are committed, so no manifest hash covers it: a resume reads what it
says about the committed shards (their files, sizes, rows and batches) and each layer's dtype and row shape,
and the final join writes the layer files from it.  A damaged or edited file is refused here, naming the
field, instead of failing later with a Python error or joining the shards into layer files of the wrong shape.
"""

from __future__ import annotations

from .format import TraceFileError, safe_member
from .tensorfile import DTYPES

PROGRESS = "progress.json"


def check_progress(out, state: dict, layers: list) -> None:
    """Raise ``TraceFileError`` unless ``state`` (``out``'s progress, of the job ``check_same_job`` matched, which
    extracts ``layers``) describes committed shards and layers consistently."""
    for name in ("batches_done", "rows"):
        _count(out, state.get(name), name)
    shards = state.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        _refuse(out, "'shards' is not a list of shard records")
    end = 0
    for shard in shards:
        end = _check_shard(out, shard, end)
    if not state.get("complete") and end != state["batches_done"]:
        _refuse(out, f"the shards hold batches [0, {end}), but 'batches_done' says {state['batches_done']}")
    if not state.get("complete") and sum(s["rows"] for s in shards) != state["rows"]:
        _refuse(out, f"the shards hold {sum(s['rows'] for s in shards)} rows, but 'rows' says {state['rows']}")
    infos = state.get("layer_info")
    if not isinstance(infos, list) or len(infos) != len(layers):
        _refuse(out, f"'layer_info' is not a list of {len(layers)} entries, one per layer")
    for layer, info in zip(layers, infos):
        if info is not None or shards:  # every layer is described once a batch is committed
            _check_layer_info(out, layer, info)


def check_shard_columns(out, shard: dict, header: dict, infos: list) -> None:
    """Refuse a committed shard whose columns (one per layer, named by position) are not ``shard["rows"]`` rows of
    each layer's dtype and row shape, which joining it into the layers' files needs."""
    for i, info in enumerate(infos):
        entry = header.get(str(i))
        expected = [shard["rows"], *info["row_shape"]]
        if not isinstance(entry, dict) or entry.get("dtype") != info["dtype"] or entry.get("shape") != expected:
            raise TraceFileError(f"{out}/{shard['file']}: its column {i} is not {info['dtype']} of shape {expected}, "
                                 f"as {PROGRESS} says; the folder was damaged or edited: delete {out} and extract "
                                 "again")


def _check_shard(out, shard: dict, start: int) -> int:
    """Check one shard record, whose batches must start at ``start``; return where they end."""
    safe_member(out, shard.get("file"))
    _count(out, shard.get("bytes"), "shards: bytes")
    _count(out, shard.get("rows"), "shards: rows")
    batches = shard.get("batches")
    if not (isinstance(batches, list) and len(batches) == 2 and _is_count(batches[1]) and batches[0] == start
            and batches[1] > start):
        _refuse(out, f"shard {shard.get('file')!r} holds batches {batches!r}, where [{start}, <end>) follows the "
                     "shards before it")
    if not isinstance(shard.get("last_input_sha256"), (str, type(None))):
        _refuse(out, f"shard {shard.get('file')!r} has no input checksum")
    return batches[1]


def _check_layer_info(out, layer: str, info) -> None:
    if not (isinstance(info, dict) and info.get("name") == layer and isinstance(info.get("label"), str)
            and isinstance(info.get("dtype"), str) and info["dtype"] in DTYPES
            and isinstance(info.get("row_shape"), list) and all(_is_count(d) for d in info["row_shape"])):
        _refuse(out, f"layer entry {info!r} is not the layer {layer!r}'s name, label, dtype and row shape")


def _count(out, value, name: str) -> None:
    if not _is_count(value):
        _refuse(out, f"{name!r} is {value!r}, not a count")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _refuse(out, problem: str):
    raise TraceFileError(f"{out}/{PROGRESS}: {problem}; the file was damaged or edited: delete {out} and "
                         "extract again")
