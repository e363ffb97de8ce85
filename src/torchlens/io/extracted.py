"""``tl.load_extracted``: read a finished extraction folder as one array per layer, memory-mapped.

Each layer lives in one safetensors file whose single tensor is every input's activation stacked along
dim 0, so a layer maps straight onto an array without reading it into memory.  numpy arrays are
read-only maps; ``as_torch=True`` gives copy-on-write maps (writes stay private) and also covers dtypes
numpy lacks (bfloat16, float8).
"""

from __future__ import annotations

import os

from ..checks import check_flag, check_path
from ..errors import counted, refusing_unknown_keywords
from .extract_progress import PROGRESS
from .extract_shards import EXTRACT_FORMAT, EXTRACT_SCHEMA
from .format import MANIFEST, TraceFileError, checked_member, read_json, require_numpy, verify_manifest
from .tensorfile import mapped


@refusing_unknown_keywords("tl.load_extracted")
def load_extracted(path, *, as_torch: bool = False, verify: bool = True) -> dict:
    """``{layer name: array of shape (inputs, ...)}`` for an extraction written by ``tl.extract``.

    Args:
        as_torch: return torch tensors instead of numpy arrays.
        verify: check each file's sha256 against the manifest first (reads every byte once; pass False
            to skip on very large extractions, sizes are still checked).
    """
    check_flag(as_torch, "as_torch", "give True for torch tensors, False for numpy arrays", who="load_extracted")
    check_flag(verify, "verify", "give True to check every file's sha256 first, False to check sizes alone",
               who="load_extracted")
    folder = check_path(path, "path", "give the folder tl.extract wrote (a str or a pathlib.Path)",
                        who="load_extracted")
    if not as_torch:  # the arrays are numpy memory maps; without numpy, the import error names no remedy
        require_numpy("tl.load_extracted (it returns numpy arrays unless as_torch=True, which needs no numpy)")
    refuse_unfinished(folder)
    manifest = verify_manifest(folder, EXTRACT_FORMAT, EXTRACT_SCHEMA, hashes=verify)
    layers = manifest.get("layers")
    if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
        raise TraceFileError(f"{folder}/{MANIFEST}: no 'layers' table")
    arrays = {}
    for info in layers:
        name, file = info.get("name"), info.get("file")
        if not isinstance(name, str) or not isinstance(file, str) or file not in manifest["files"]:
            raise TraceFileError(f"{folder}/{MANIFEST}: layer entry {info!r} names no listed file")
        arrays[name] = mapped(checked_member(folder, file), "activations", as_torch, info.get("dtype"))
        if list(arrays[name].shape) != info.get("shape"):
            raise TraceFileError(f"{folder}/{file}: holds shape {list(arrays[name].shape)}, the manifest says "
                                 f"{info.get('shape')}")
    return arrays


def refuse_unfinished(folder) -> None:
    """Raise ``TraceFileError`` saying what to do when ``folder`` holds an extraction that has not finished, or a
    finished one without its manifest."""
    if os.path.lexists(os.path.join(folder, MANIFEST)):
        return
    if os.path.lexists(os.path.join(folder, PROGRESS)):
        progress = read_json(folder, PROGRESS, "an extraction")
        if isinstance(progress, dict) and progress.get("complete") is True:
            # tl.extract writes the manifest before it marks the run complete: the manifest was lost since, and a
            # call to finish the run finds nothing to do
            raise TraceFileError(f"{folder}: the extraction finished, but its {MANIFEST} is missing (the folder was "
                                 "copied in part, or the file deleted), so its layer files cannot be checked; copy "
                                 "the whole folder again from where tl.extract wrote it, or delete it and extract "
                                 "again")
        done = progress.get("batches_done") if isinstance(progress, dict) else "?"
        done = counted(done, "batch", "batches") if isinstance(done, int) else done
        raise TraceFileError(f"{folder}: the extraction is incomplete ({done} committed); call tl.extract "
                             "again with the same arguments to finish it")
    if os.path.isdir(os.path.join(folder, "rank-0")):
        raise TraceFileError(f"{folder}: the distributed extraction is incomplete (its ranks' shares were not joined "
                             "yet); run the same torchrun command again to finish it")
