"""The on-disk contract shared by saved traces and extraction folders: manifests, hashes, safe paths.

Every folder torchlens writes has a ``manifest.json`` naming its format, its schema version and, for
each file, its size and sha256.  Readers check all three before parsing anything, so a truncated copy,
a flipped byte or a file from a newer schema is refused with a message naming the file and the problem.
File names in a manifest are plain names inside the folder: anything that could point elsewhere (a
separator, ``..``, a drive, a symlink) is refused before it is opened.  The checks of the values read from a
saved trace's ``trace.json`` (an op index, a string) live here too, so that every reader refuses a
damaged value in the same words.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import stat

from ..checks import overlong_name
from ..errors import MissingPackage, TraceFileError, UnsafeMemberError

MANIFEST = "manifest.json"
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_CHUNK = 1 << 20
MAX_SMALL_JSON = 64 << 20  # manifest.json and progress.json: far above any real one, far below memory
MAX_JSON_DEPTH = 256  # deeper than any file torchlens writes; bounds the parser's recursion


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
        raise UnsafeMemberError(f"{path}: is a symbolic link; refusing to follow links out of the saved folder")
    root = os.path.realpath(folder)
    if os.path.dirname(os.path.realpath(path)) != root:
        raise UnsafeMemberError(f"{path}: resolves outside {folder}; refusing it")
    return path


def checked_member(folder: str, name) -> str:
    """``safe_member`` plus the file itself: it must exist as a regular file.

    Used for files read by other libraries (safetensors, memory maps); ``read_member`` does the same
    checks on the open descriptor for the files torchlens reads itself.
    """
    path = safe_member(folder, name)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise TraceFileError(f"{path}: missing") from None
    _check_regular(path, info, None)
    return path


def is_regular_file(path: str) -> bool:
    """Whether ``path`` is a regular file itself, not a link to one (``os.path.isfile`` follows links)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _check_regular(path: str, info, max_bytes) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = ("a symbolic link" if stat.S_ISLNK(info.st_mode) else "a directory" if stat.S_ISDIR(info.st_mode)
                else "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a device or socket")
        raise UnsafeMemberError(f"{path}: is {kind}, not a regular file; torchlens reads only the regular files "
                                "it wrote (replace it with the file the folder was written with)")
    if max_bytes is not None and info.st_size > max_bytes:
        raise UnsafeMemberError(f"{path}: {info.st_size} bytes, more than the {max_bytes} this file may hold; "
                                "refusing to read it")


def read_member(folder: str, name, max_bytes: int) -> bytes:
    """The bytes of regular file ``name`` inside ``folder``, refusing links, FIFOs, devices, directories and
    files over ``max_bytes``.  The checks are made on the opened descriptor (``O_NOFOLLOW``, and
    ``O_NONBLOCK`` so that opening a FIFO cannot hang), so the file cannot be swapped in between."""
    path = safe_member(folder, name)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a link swapped in after safe_member; EISDIR and the like
        try:
            _check_regular(path, os.lstat(path), max_bytes)
        except FileNotFoundError:
            pass
        raise UnsafeMemberError(f"{path}: cannot be opened as a regular file ({exc.strerror})") from None
    try:
        _check_regular(path, os.fstat(fd), max_bytes)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafeMemberError(f"{path}: grew past {max_bytes} bytes while being read; refusing it")
    return data


def make_folder(folder: str, path: str, verb: str) -> str | None:
    """Create ``folder`` (``path``, or the folder ``path`` goes in) and its parents, naming the part of it that is
    a file when one is in the way: ``os.makedirs`` says only "File exists" or "Not a directory".  Returns the
    outermost folder it made (None when ``folder`` was there), for ``remove_made_folders`` if the write fails."""
    problem = overlong_name(path)
    if problem:
        raise TraceFileError(f"cannot {verb} to {path}: it {problem}; choose a shorter name")
    made = _outermost_missing(folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise TraceFileError(f"cannot {verb} to {path}: {_first_file_on(folder)} is a file, not a folder; choose "
                             "another path") from None
    return made


def remove_made_folders(folder: str, made: str | None) -> None:
    """Remove ``folder`` and its parents up to ``made`` (what ``make_folder`` made), each only while empty: a
    write that failed leaves the folders as it found them, and a folder something else wrote into stays."""
    if made is None:
        return
    folder, made = os.path.abspath(folder), os.path.abspath(made)
    while folder == made or folder.startswith(made + os.sep):
        try:
            os.rmdir(folder)
        except OSError:
            return
        folder = os.path.dirname(folder)


def _outermost_missing(folder: str) -> str | None:
    """The outermost part of the absolute path ``folder`` that does not exist yet (None: all of it does)."""
    folder, missing = os.path.abspath(folder), None
    while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
        folder, missing = os.path.dirname(folder), folder
    return missing


def _first_file_on(folder: str) -> str:
    """The outermost part of the absolute path ``folder`` that exists but is not a folder."""
    folder = os.path.abspath(folder)
    parts = []
    while os.path.dirname(folder) != folder:
        parts.append(folder)
        folder = os.path.dirname(folder)
    return next((p for p in reversed(parts) if os.path.lexists(p) and not os.path.isdir(p)), parts[0])


@contextlib.contextmanager
def atomic_file(path: str):
    """A binary file open for writing whose content replaces ``path`` whole once the block ends (it is
    written to ``path.tmp``, synced and renamed), so that ``path`` holds the old or the new, never a part."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` so that ``path`` holds either the old or the whole new content, never a part."""
    with atomic_file(path) as f:
        f.write(data)


def dump_json(obj) -> bytes:
    # allow_nan=False keeps the files standard JSON; encoders tag non-finite floats themselves.
    return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()


def read_json(folder: str, name: str, what: str, max_bytes: int = MAX_SMALL_JSON):
    """Parse member ``name`` of ``folder`` as standard JSON: bounded size and nesting, finite numbers only."""
    path = os.path.join(folder, name)
    try:
        text = read_member(folder, name, max_bytes).decode("utf-8")
    except FileNotFoundError:
        raise TraceFileError(f"{path}: missing; {what} needs it") from None
    except UnicodeDecodeError as exc:
        raise TraceFileError(f"{path}: not valid JSON ({exc}); the file is damaged or was edited") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise TraceFileError(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels; refusing it") from None
    except (json.JSONDecodeError, ValueError) as exc:
        raise TraceFileError(f"{path}: not valid JSON ({exc}); the file is damaged or was edited") from None
    if _depth_exceeds(value, MAX_JSON_DEPTH):
        raise TraceFileError(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels; refusing it")
    return value


def _refuse_constant(name: str):
    raise ValueError(f"non-standard constant {name} (torchlens writes non-finite numbers as tagged values)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows to {value}; torchlens never writes one")
    return value


def _depth_exceeds(value, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def write_manifest(folder: str, fmt: str, schema: int, names: list, extra: dict | None = None) -> None:
    from .. import __version__

    files = {}
    for name in names:
        path = safe_member(folder, name)
        files[name] = {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}
    manifest = {"format": fmt, "schema_version": schema, "torchlens_version": __version__, "files": files}
    manifest.update(extra or {})
    write_atomic(os.path.join(folder, MANIFEST), dump_json(manifest))


def check_schema(where: str, what: str, version, schema: int) -> None:
    """Refuse a file whose ``schema_version`` is missing or another than ``schema``, saying which torchlens wrote it."""
    if not isinstance(version, int) or isinstance(version, bool):
        raise TraceFileError(f"{where}: {what} has no integer schema_version")
    if version != schema:
        newer = "a newer torchlens; upgrade torchlens" if version > schema else "an older, unsupported torchlens"
        raise TraceFileError(f"{where}: schema version {version} was written by {newer} "
                             f"(this torchlens reads schema {schema})")


# What reads each folder torchlens writes, named when a folder of one is given to the other's reader.
_READERS = {"torchlens-trace": "tl.load (or torchlens show)", "torchlens-extraction": "tl.load_extracted"}


def verify_manifest(folder: str, fmt: str, schema: int, required: tuple = (), hashes: bool = True) -> dict:
    """Read and check ``folder``'s manifest: format, schema version, and every file's size and hash."""
    if not os.path.isdir(folder):
        raise TraceFileError(f"{folder}: not a folder; expected a folder written by torchlens")
    manifest = read_json(folder, MANIFEST, f"a {fmt} folder")
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        reader = _READERS.get(found) if isinstance(found, str) else None
        hint = f": a {found} folder is read with {reader}" if reader else ""
        raise TraceFileError(f"{folder}: manifest says format {found!r}, expected {fmt!r}{hint}")
    check_schema(folder, "manifest", manifest.get("schema_version"), schema)
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
    if not os.path.lexists(path):
        raise TraceFileError(f"{path}: listed in the manifest but missing")
    checked_member(folder, name)
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        raise TraceFileError(f"{path}: {size} bytes, the manifest says {entry['bytes']}: the file is truncated "
                             "or was replaced")
    if hashes and sha256_of(path) != entry["sha256"]:
        raise TraceFileError(f"{path}: content hash does not match the manifest: the file was corrupted "
                             "or edited after saving")


TRACE_FORMAT, TRACE_SCHEMA = "torchlens-trace", 1
TRACE_JSON, TRACE_TENSORS = "trace.json", "activations.safetensors"


def is_int(v) -> bool:
    """An integer as JSON reads one: ``true`` reads as a bool, which Python counts among the ints."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_index(v, lo, hi, what) -> int:
    """``v``, an integer in ``[lo, hi)`` read from ``trace.json``'s record ``what``; else a TraceFileError."""
    if not is_int(v) or not lo <= v < hi:
        raise TraceFileError(f"{TRACE_JSON}: {what}: {v!r} is not an integer in [{lo}, {hi})")
    return v


def check_string(v, what) -> str:
    """``v``, a string read from ``trace.json``'s record ``what``; else a TraceFileError."""
    if not isinstance(v, str):
        raise TraceFileError(f"{TRACE_JSON}: {what}: expected a string, got {type(v).__name__}")
    return v


@contextlib.contextmanager
def reading_record(folder: str, name: str):
    """Errors reading ``trace.json``'s record ``name`` (``grads``, ``interventions``) as TraceFileErrors naming
    the folder: a check's own, and any other a damaged record makes its reader raise, as that record being
    malformed."""
    try:
        yield
    except TraceFileError as exc:  # column checks name the file; add the folder
        raise exc if str(exc).startswith(folder) else TraceFileError(f"{folder}/{exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise TraceFileError(f"{folder}/{TRACE_JSON}: its {name!r} record is malformed ({type(exc).__name__}: "
                             f"{exc}); the file was edited or written by other software") from None


def require_numpy(what: str):
    """numpy, through which ``what`` reads a tensor's bytes (``Tensor.numpy()``): without it torch says only
    "Numpy is not available", so the message names the package and the task needing it."""
    try:
        import numpy
    except ImportError as exc:
        raise MissingPackage(f"{what} needs numpy: pip install numpy") from exc
    return numpy


def require_safetensors():
    """The safetensors library, which reading a saved trace's tensors needs (writing streams the format itself,
    io/tensorfile.py, so a trace saved where it is missing says so only when loaded)."""
    try:
        import safetensors.torch
    except ImportError as exc:
        raise MissingPackage("reading a saved trace's tensors needs safetensors: pip install safetensors (saving "
                          "does not, so save where it is missing, load where it is installed)") from exc
    return safetensors.torch
