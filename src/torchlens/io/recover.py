"""Finish, or undo, a save over a trace that was killed between its renames.

``log.save(path, overwrite=True)`` writes the new trace in a hidden folder beside ``path``, moves the old trace
aside into a second one (the first's name and ``-old``), moves the new one in and only then deletes the old one.
A Ctrl-C cannot stop it half way (``save._uninterrupted``), but a kill (SIGKILL, a lost machine) can, and left
the old trace in the hidden folder with nothing at ``path`` saying so.  Both folders name the path they were
for, so the next ``save`` or ``tl.load`` of that path finds them: a trace whole at ``path`` means the new one
was in place, and the old one's files are deleted, as the save would have done; otherwise the old trace is put
back where it was, since the save that was to replace it never finished.  Either way a warning says so.
A save still running (another process or thread) holds its staging folder locked until the old trace's folder
is gone, so a ``tl.load`` meanwhile waits for it instead.

A kill before the renames leaves only the new trace's half-written hidden folder.  A save holds a lock on that
folder while it writes (``claim_staging``), and the kernel drops the lock when the process dies, so a folder no
process holds is a dead save's: the next ``save`` or ``tl.load`` of the path deletes it.  One still held is a
save running now (another process), and stays.  Where the system has no such locks (Windows), a warning names it.
Folders from before they carried the path's name (``.torchlens-save-<id>-old``) do not say which trace they
belong to, so they are named in a warning, never moved.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import uuid

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, so a left staging folder is named in a warning, not deleted
    fcntl = None

from ..checks import folder_of
from ..errors import TraceFileError, warn_user
from .format import MANIFEST, is_regular_file, read_json

_PREFIX = ".torchlens-save-"
_RETIRED = "-old"
_ID_LENGTH = 12
_BUSY = "busy"  # _lock's answer for a folder another open of it holds: a save writing it now


def staging_path(path: str) -> str:
    """A fresh hidden folder beside ``path`` to write its trace in, named after ``path``; ``-old`` added, the
    folder the old trace is moved aside into."""
    return os.path.join(folder_of(path), f"{_PREFIX}{_tag(path)}-{uuid.uuid4().hex[:_ID_LENGTH]}")


def _tag(path: str) -> str:
    """``path``'s last part, as the hidden folders' names carry it; a long one by its hash (a name has a limit)."""
    name = os.path.basename(path.rstrip(os.sep + (os.altsep or "")))
    return name if len(name) <= 64 else hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def claim_staging(path: str):
    """Make a fresh staging folder for ``path`` and lock it for as long as the save writes: returns the folder and
    the lock (``release_staging`` ends it), None where the system has no locks."""
    for _ in range(3):
        staging = staging_path(path)
        os.mkdir(staging)  # (not mkdtemp: the folder keeps the user's usual permissions once renamed)
        # A save or load of path (another process) may take the folder for a dead save's until it is locked,
        # and delete it: before it is opened, or while the lock waits.  Then another is made.
        try:
            lock = _lock(staging, wait=True)  # (waiting, never _BUSY)
        except FileNotFoundError:
            continue
        if lock is None or _still_at(lock, staging):
            return staging, lock
        os.close(lock)
    raise TraceFileError(f"{path}: the folder to write the trace in beside it was deleted three times as it was "
                         "made; is another program deleting hidden folders there? Save again, or to another path")


def release_staging(lock) -> None:
    if lock is not None:
        os.close(lock)


def _lock(folder: str, wait: bool):
    """An open of ``folder`` holding an exclusive lock on it; ``_BUSY`` when another open holds it (not waiting),
    None when the system or file system has no such locks."""
    if fcntl is None:
        return None
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return _BUSY
    except OSError:  # a file system without locks (some network ones)
        os.close(fd)
        return None
    except BaseException:  # a Ctrl-C while waiting: the folder is left unlocked, as a dead save's
        os.close(fd)
        raise
    return fd


def _still_at(fd: int, folder: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(folder))
    except FileNotFoundError:
        return False


def left_behind(path: str) -> list:
    """The folders the old trace of ``path`` was moved aside into by saves killed before they finished."""
    return [full for full, retired in _hidden_of(path) if retired]


def _hidden_of(path: str) -> list:
    """Each hidden folder a save of ``path`` made, ``(folder, moved aside)``: its staging folders and those the
    old trace was moved aside into."""
    start = f"{_PREFIX}{_tag(path)}-"
    found = []
    for name, full in _hidden_names(folder_of(path)):
        if not name.startswith(start):
            continue
        retired = name.endswith(_RETIRED)
        if _is_id(name[len(start):len(name) - len(_RETIRED) * retired]):
            found.append((full, retired))
    return found


def _hidden_names(parent: str) -> list:
    """``(name, path)`` of each real folder in ``parent`` named like a save's hidden folder."""
    try:
        names = os.listdir(parent)
    except OSError:  # no parent: nothing was saved there
        return []
    return [(name, os.path.join(parent, name)) for name in sorted(names)
            if name.startswith(_PREFIX) and _is_folder(os.path.join(parent, name))]


def _is_id(text: str) -> bool:
    return len(text) == _ID_LENGTH and all(c in "0123456789abcdef" for c in text)


def recover_killed_save(path: str) -> None:
    """Finish or undo each save over ``path`` that was killed part way, delete the half-written trace of each one
    killed before, and name the folders of older saves (see the module's docstring)."""
    _recover_retired(path)
    for staging, retired in _hidden_of(path):
        if not retired and not os.path.lexists(staging + _RETIRED):
            _discard_staging(path, staging)
    _name_unattributed(path)


def _recover_retired(path: str) -> None:
    for retired in left_behind(path):
        _wait_for_running_save(path, retired[: -len(_RETIRED)])
        if not os.path.lexists(retired):
            continue  # its save was running, not killed, and has deleted it
        try:
            _recover(path, retired)
        except (OSError, TraceFileError) as exc:
            raise TraceFileError(f"{path}: a save over the trace there did not finish, and the old trace's "
                                 f"files it moved aside into {retired} could not be put back or deleted ({exc}); "
                                 f"move them back into {path} to keep the old trace, or delete the folder") from None


def _wait_for_running_save(path: str, staging: str) -> None:
    """Wait for the save that moved the old trace of ``path`` aside into ``staging``'s ``-old`` folder, if it is
    running (another process or thread), not killed: it holds ``staging`` locked until it has deleted that folder,
    and ``staging`` is ``path`` once the new trace is moved in whole.  Taken for a killed save's, its old trace was
    put back over the new one being moved in, or its files deleted as the save deleted them, and both failed."""
    for folder in (staging, path):
        if not _is_folder(folder):
            continue
        try:
            release_staging(_lock(folder, wait=True))
        except FileNotFoundError:  # renamed or deleted since: that save has moved on
            pass


def _recover(path: str, retired: str) -> None:
    staging = retired[: -len(_RETIRED)]
    if is_regular_file(os.path.join(path, MANIFEST)):  # a whole trace is at path: the new one, or the old left in place
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
    if not is_regular_file(os.path.join(retired, MANIFEST)):
        raise TraceFileError(f"neither {path} nor {retired} holds a manifest.json")
    if os.path.lexists(path):  # foreign files shared the folder: the trace files were moved one by one
        _undo_file_moves(path, staging, retired)
    else:
        os.replace(retired, path)
    shutil.rmtree(staging, ignore_errors=True)
    warn_user(f"{path}: a save over this trace was killed before the new trace was in place; the old trace, "
              f"left in {retired}, is put back at {path}")


def _discard_staging(path: str, staging: str) -> None:
    """Delete the half-written trace of a save of ``path`` killed before its renames, unless a save holds it."""
    try:
        lock = _lock(staging, wait=False)
    except FileNotFoundError:
        return  # moved into place or deleted since it was listed: a save running now, not a killed one
    if lock == _BUSY:
        return  # a save of path writing now, in another process
    if lock is None:
        warn_user(f"{path}: {staging} holds the half-written trace of a save of this path that was killed, or of "
                  "one running now; delete it once no save of this path is running")
        return
    try:
        _delete_moved_aside(staging)  # a save writes plain files only: anything else there is no save's, and stays
    except OSError as exc:
        warn_user(f"{path}: {staging} holds the half-written trace of a save of this path that was killed, and "
                  f"could not be deleted ({exc.strerror or exc}); delete it")
    finally:
        os.close(lock)


def _name_unattributed(path: str) -> None:
    """Warn of each folder an older save moved a trace aside into, named without its path: which trace it was
    is unknown, so nothing is moved; the user, who knows which trace is missing, can put it back."""
    for name, full in _hidden_names(folder_of(path)):
        if name.endswith(_RETIRED) and _is_id(name[len(_PREFIX):-len(_RETIRED)]):
            warn_user(f"{full} holds the files of a saved trace that a save over it moved aside and did not "
                      "finish (killed, or unable to delete them), from a version of torchlens whose hidden folders "
                      "did not name their trace; if a saved trace in "
                      f"{os.path.abspath(folder_of(path))} is missing or damaged, move these files back into its "
                      "folder (tl.load the folder to check them), otherwise delete the folder")


def _undo_file_moves(path: str, staging: str, retired: str) -> None:
    """Take out of ``path`` the new trace's files moved in so far (those its manifest, still in ``staging`` since
    it moves last, lists and ``staging`` no longer holds), then move the old trace's files back, manifest last."""
    new_files = _listed(staging) if is_regular_file(os.path.join(staging, MANIFEST)) else []
    for name in new_files:
        moved_in = os.path.join(path, name)
        if not os.path.lexists(os.path.join(retired, name)) and not os.path.lexists(os.path.join(staging, name)) \
                and is_regular_file(moved_in):
            os.remove(moved_in)
    old = sorted(os.listdir(retired), key=lambda n: n == MANIFEST)
    for name in old:
        os.replace(os.path.join(retired, name), os.path.join(path, name))
    os.rmdir(retired)


def _delete_moved_aside(retired: str) -> None:
    """Delete the old trace's files from ``retired``, then the folder.  Every file there is one the save moved
    aside (only the old trace's files go there), and the save deletes the manifest first, so a kill while it
    deleted them leaves files no manifest lists: all of them go.  Anything not a plain file stays, and so does
    the folder then.  (A dead save's staging folder goes the same way: it holds only the files it wrote.)"""
    for name in sorted(os.listdir(retired), key=lambda n: n != MANIFEST):
        if is_regular_file(os.path.join(retired, name)):
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
