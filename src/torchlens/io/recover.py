"""Finish, or undo, a save over a trace that was killed between its renames.

``log.save(path, overwrite=True)`` writes the new trace in a hidden folder beside ``path``, moves the old trace
aside into a second one (the first's name and ``-old``), moves the new one in and only then deletes the old one.
A Ctrl-C cannot stop it half way (``save._uninterrupted``), but a kill (SIGKILL, a lost machine) can, and left
the old trace in the hidden folder with nothing at ``path`` saying so.  Both folders name the path they were
for, so the next ``save`` or ``tl.load`` of that path finds them: a trace whole at ``path`` means the new one
was in place, and the old one's files are deleted, as the save would have done; otherwise the old trace is put
back where it was, since the save that was to replace it never finished.  Either way a warning says so.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import uuid

from ..checks import folder_of
from ..errors import TraceFileError, warn_user
from .format import MANIFEST, read_json

_PREFIX = ".torchlens-save-"
_RETIRED = "-old"
_ID_LENGTH = 12


def staging_path(path: str) -> str:
    """A fresh hidden folder beside ``path`` to write its trace in, named after ``path``; ``-old`` added, the
    folder the old trace is moved aside into."""
    return os.path.join(folder_of(path), f"{_PREFIX}{_tag(path)}-{uuid.uuid4().hex[:_ID_LENGTH]}")


def _tag(path: str) -> str:
    """``path``'s last part, as the hidden folders' names carry it; a long one by its hash (a name has a limit)."""
    name = os.path.basename(path.rstrip(os.sep + (os.altsep or "")))
    return name if len(name) <= 64 else hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def left_behind(path: str) -> list:
    """The folders the old trace of ``path`` was moved aside into by saves killed before they finished."""
    parent, start = folder_of(path), f"{_PREFIX}{_tag(path)}-"
    try:
        names = os.listdir(parent)
    except OSError:  # no parent: nothing was saved there
        return []
    found = []
    for name in sorted(names):
        middle = name[len(start):-len(_RETIRED)]
        full = os.path.join(parent, name)
        if name.startswith(start) and name.endswith(_RETIRED) and len(middle) == _ID_LENGTH \
                and all(c in "0123456789abcdef" for c in middle) and _is_folder(full):
            found.append(full)
    return found


def recover_killed_save(path: str) -> None:
    """Finish or undo each save over ``path`` that was killed part way (see the module's docstring)."""
    for retired in left_behind(path):
        try:
            _recover(path, retired)
        except (OSError, TraceFileError) as exc:
            raise TraceFileError(f"{path}: a save over the trace there did not finish, and the old trace's "
                                 f"files it moved aside into {retired} could not be put back or deleted ({exc}); "
                                 f"move them back into {path} to keep the old trace, or delete the folder") from None


def _recover(path: str, retired: str) -> None:
    staging = retired[: -len(_RETIRED)]
    if _is_regular(os.path.join(path, MANIFEST)):  # a whole trace is at path: the new one, or the old left in place
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _delete_moved_aside(retired)
        except OSError as exc:  # the trace at path is whole: say where the rest is, as a finished save does
            warn_user(f"{path}: a save over this trace did not finish (it was killed, or failed to delete the old "
                      f"trace); the trace there is whole, and the old trace's files it moved aside are left in "
                      f"{retired} ({exc.strerror or exc}): delete it")
            return
        warn_user(f"{path}: a save over this trace did not finish (it was killed, or failed to delete the old trace); "
                  f"the trace there is whole, and the old trace's files it had moved aside into {retired} are now "
                  "deleted")
        return
    if not _is_regular(os.path.join(retired, MANIFEST)):
        raise TraceFileError(f"neither {path} nor {retired} holds a manifest.json")
    if os.path.lexists(path):  # foreign files shared the folder: the trace files were moved one by one
        _undo_file_moves(path, staging, retired)
    else:
        os.replace(retired, path)
    shutil.rmtree(staging, ignore_errors=True)
    warn_user(f"{path}: a save over this trace was killed before the new trace was in place; the old trace, "
              f"left in {retired}, is put back at {path}")


def _undo_file_moves(path: str, staging: str, retired: str) -> None:
    """Take out of ``path`` the new trace's files moved in so far (those its manifest, still in ``staging`` since
    it moves last, lists and ``staging`` no longer holds), then move the old trace's files back, manifest last."""
    new_files = _listed(staging) if _is_regular(os.path.join(staging, MANIFEST)) else []
    for name in new_files:
        moved_in = os.path.join(path, name)
        if not os.path.lexists(os.path.join(retired, name)) and not os.path.lexists(os.path.join(staging, name)) \
                and _is_regular(moved_in):
            os.remove(moved_in)
    old = sorted(os.listdir(retired), key=lambda n: n == MANIFEST)
    for name in old:
        os.replace(os.path.join(retired, name), os.path.join(path, name))
    os.rmdir(retired)


def _delete_moved_aside(retired: str) -> None:
    """Delete the old trace's files from ``retired``, then the folder.  Every file there is one the save moved
    aside (only the old trace's files go there), and the save deletes the manifest first, so a kill while it
    deleted them leaves files no manifest lists: all of them go.  Anything not a plain file stays, and so does
    the folder then."""
    for name in sorted(os.listdir(retired), key=lambda n: n != MANIFEST):
        if _is_regular(os.path.join(retired, name)):
            os.remove(os.path.join(retired, name))
    os.rmdir(retired)


def _listed(folder: str) -> list:
    files = read_json(folder, MANIFEST, "a saved trace's manifest").get("files", {})
    return [name for name in files if isinstance(name, str) and os.path.basename(name) == name]


def _is_folder(path: str) -> bool:
    """A real folder, not a link to one: a save makes its hidden folders itself, never links."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False
