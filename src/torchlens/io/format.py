"""The on-disk contract shared by saved traces and extraction folders: manifests, hashes, safe paths.

Every folder torchlens writes has a ``manifest.json`` naming its format, its schema version and, for
each file, its size and sha256.  Readers check all three before parsing anything, so a truncated copy,
a flipped byte or a file from a newer schema is refused with a message naming the file and the problem.
File names in a manifest are plain names inside the folder: anything that could point elsewhere (a
separator, ``..``, a drive, a symlink) is refused before it is opened.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from ..record.errors import TorchlensError

MANIFEST = "manifest.json"
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_CHUNK = 1 << 20


class TraceFileError(TorchlensError, ValueError):
    """A saved trace or extraction folder is missing, damaged, tampered with, or from another schema."""


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def safe_member(folder: str, name) -> str:
    """The path of file ``name`` inside ``folder``, refusing any name that could leave the folder."""
    if not isinstance(name, str) or not _PLAIN_NAME.match(name) or name in (".", ".."):
        raise TraceFileError(f"{folder}: refusing file name {name!r}: names in a manifest must be plain file "
                             "names inside the folder (no separators, no '..', no leading dot)")
    path = os.path.join(folder, name)
    if os.path.islink(path):
        raise TraceFileError(f"{path}: is a symbolic link; refusing to follow links out of the saved folder")
    root = os.path.realpath(folder)
    if os.path.dirname(os.path.realpath(path)) != root:
        raise TraceFileError(f"{path}: resolves outside {folder}; refusing it")
    return path


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` so that ``path`` holds either the old or the whole new content, never a part."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def dump_json(obj) -> bytes:
    # allow_nan=False keeps the files standard JSON; encoders tag non-finite floats themselves.
    return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()


def read_json(path: str, what: str):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise TraceFileError(f"{path}: missing; {what} needs it") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFileError(f"{path}: not valid JSON ({exc}); the file is damaged or was edited") from None


def write_manifest(folder: str, fmt: str, schema: int, names: list, extra: dict | None = None) -> None:
    from .. import __version__

    files = {}
    for name in names:
        path = safe_member(folder, name)
        files[name] = {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}
    manifest = {"format": fmt, "schema_version": schema, "torchlens_version": __version__, "files": files}
    manifest.update(extra or {})
    write_atomic(os.path.join(folder, MANIFEST), dump_json(manifest))


def verify_manifest(folder: str, fmt: str, schema: int, required: tuple = (), hashes: bool = True) -> dict:
    """Read and check ``folder``'s manifest: format, schema version, and every file's size and hash."""
    if not os.path.isdir(folder):
        raise TraceFileError(f"{folder}: not a folder; expected a folder written by torchlens")
    manifest = read_json(os.path.join(folder, MANIFEST), f"a {fmt} folder")
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise TraceFileError(f"{folder}: manifest says format {found!r}, expected {fmt!r}")
    version = manifest.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise TraceFileError(f"{folder}: manifest has no integer schema_version")
    if version != schema:
        newer = "a newer torchlens; upgrade torchlens" if version > schema else "an older, unsupported torchlens"
        raise TraceFileError(f"{folder}: schema version {version} was written by {newer} "
                             f"(this torchlens reads schema {schema})")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise TraceFileError(f"{folder}: manifest has no 'files' table")
    for name in required:
        if name not in files:
            raise TraceFileError(f"{folder}: manifest does not list {name!r}")
    for name, entry in files.items():
        _verify_file(folder, name, entry, hashes)
    return manifest


def _verify_file(folder: str, name, entry, hashes: bool) -> None:
    path = safe_member(folder, name)
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) \
            or not isinstance(entry.get("sha256"), str):
        raise TraceFileError(f"{folder}: manifest entry for {name!r} lacks its size and sha256")
    if not os.path.isfile(path):
        raise TraceFileError(f"{path}: listed in the manifest but missing")
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        raise TraceFileError(f"{path}: {size} bytes, the manifest says {entry['bytes']}: the file is truncated "
                             "or was replaced")
    if hashes and sha256_of(path) != entry["sha256"]:
        raise TraceFileError(f"{path}: content hash does not match the manifest: the file was corrupted "
                             "or edited after saving")


TRACE_FORMAT, TRACE_SCHEMA = "torchlens-trace", 1
TRACE_JSON, TRACE_TENSORS = "trace.json", "activations.safetensors"


def require_safetensors():
    try:
        import safetensors.torch
    except ImportError as exc:  # pragma: no cover - exercised only where safetensors is absent
        raise ImportError("saving and loading activations needs safetensors: pip install safetensors") from exc
    return safetensors.torch
