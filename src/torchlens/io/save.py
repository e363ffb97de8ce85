"""``log.save(path)``: a trace as a folder of plain data that anyone can load without running code.

Layout (schema 1)::

    path/manifest.json             format, schema version, size and sha256 of each file
    path/trace.json                every record column (labels, parents, modules, timings, ...)
    path/activations.safetensors   the saved activations, one tensor per distinct saved tensor

No pickle anywhere: torch callables are stored by name (a loaded op's ``func`` is None), non-data
argument values by type and repr.  The folder is written next to ``path`` and renamed into place, so an
interrupted save never leaves a half-written trace under ``path``.

``overwrite=True`` replaces only a folder whose manifest says it is a saved trace, and removes only the
files that manifest lists: anything else found there is left in place, with a warning naming it.  The old
trace's files are moved aside, not deleted, until the new trace is in place, so a save over a trace that
fails or is interrupted part way leaves the old one whole.
"""

from __future__ import annotations

import errno
import os
import shutil

from ..checks import check_flag, check_path, folder_of
from ..errors import counted, listed, warn_user
from ..record.layouts import alias_key
from ..record.trace import checked_trace
from .encode import WITHOUT_ACTIVATIONS, encode_value, torch_constant_name, unsavable
from .grads import write_grads
from .interventions import write_interventions
from .params import write_module_param_counts, write_params
from .recover import claim_staging, recover_killed_save, release_staging
from .tensorfile import layouts_of, write_tensors
from .trace_state import write_trace_state
from .format import (MANIFEST, TRACE_FORMAT, TRACE_JSON, TRACE_SCHEMA, TRACE_TENSORS, TraceFileError, dump_json,
                     is_regular_file, make_folder, read_json, remove_made_folders, require_numpy, safe_member,
                     write_atomic, write_manifest)


def save(trace, path, *, activations: bool = True, overwrite: bool = False) -> str:
    """Write ``trace`` to the folder ``path`` and return the folder's path.

    Args:
        activations: also write the saved activations (metadata alone is much smaller).
        overwrite: replace an existing saved trace at ``path``: only a folder whose manifest names the
            trace format, and only the files that manifest lists (other files are kept, with a warning).
            Any other existing folder is refused.
    """
    checked_trace(trace, "save")
    # A string such as "no" is true: activations="no" would write them, overwrite="no" replace a saved trace.
    check_flag(activations, "activations", "give True to write the saved activations, False for metadata alone",
               who="save")
    check_flag(overwrite, "overwrite", "give True to replace a trace saved at the path, False to refuse", who="save")
    path = check_path(path, "path", "give the folder to write the trace to (a str or a pathlib.Path)", who="save")
    _refuse_empty(path)
    if activations:
        require_numpy("saving a trace's tensors")  # they are written through Tensor.numpy() (io/tensorfile.py)
    recover_killed_save(path)
    old_files = check_save_target(path, overwrite, trace.rank)
    parent = folder_of(path)
    made = make_folder(parent, path, "save")
    try:
        _write(trace, path, activations, old_files)
    except BaseException:
        remove_made_folders(parent, made)  # a failed save leaves no empty folders behind
        raise
    return path


def _write(trace, path: str, activations: bool, old_files) -> None:
    """Write the trace into a staging folder beside ``path``, then move it in (or swap it for ``old_files``)."""
    # Named after path and locked while written, so that a save killed part way is found (io/recover.py).
    staging, lock = claim_staging(path)
    try:
        tensors, keys, unsaved = _activation_tensors(trace) if activations else ({}, {}, {})
        names = [TRACE_JSON]
        if activations:
            write_tensors(os.path.join(staging, TRACE_TENSORS), tensors, metadata={"format": TRACE_FORMAT})
            names.append(TRACE_TENSORS)
        record = trace_columns(trace, keys, unsaved, activations)
        record["activation_strides"] = layouts_of(tensors)
        grad_files, record["grads"] = write_grads(trace, staging, activations)  # io/grads.py
        names += grad_files
        original_files, record["interventions"] = write_interventions(trace, staging, activations)
        names += original_files
        write_atomic(os.path.join(staging, TRACE_JSON), dump_json(record))
        write_manifest(staging, TRACE_FORMAT, TRACE_SCHEMA, names, _saved_by(trace))
        if old_files is None:
            _move_in(staging, path, trace.rank)
        else:
            _replace_saved(path, staging, old_files)
    finally:
        try:
            shutil.rmtree(staging, ignore_errors=True)
        finally:
            release_staging(lock)  # only once it is gone: a load meanwhile would take it for a dead save's


def _saved_by(trace) -> dict:
    """The rank that saves, in the manifest, so that another rank saving to the same path is refused."""
    return {} if trace.rank is None else {"rank": trace.rank, "world_size": trace.world_size}


def _one_folder_per_rank(path: str, rank) -> str:
    return "" if rank is None else (f"; under torch.distributed every rank needs its own folder, e.g. "
                                    f"log.save(f\"{path}-rank{{log.rank}}\")")


def _move_in(staging: str, path: str, rank=None) -> None:
    """Rename the written trace to ``path``, replacing the empty folder ``check_save_target`` found there, if any:
    removed only now, so that a save that failed earlier leaves the user's folder where it was."""
    try:
        _uninterrupted(lambda: _rename_in(staging, path))
    except OSError as exc:  # another process (another rank, saving to the same path) got there first
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise TraceFileError(f"{path} was written by another process while this trace was being saved, so this "
                             f"trace was not saved{_one_folder_per_rank(path, rank)}") from None


def _rename_in(staging: str, path: str) -> None:
    """Rename ``staging`` to ``path``, an empty folder first removed; run again after an interrupt, it goes on."""
    if not os.path.lexists(staging):
        return  # renamed by an earlier try
    if os.path.isdir(path) and not os.path.islink(path):
        os.rmdir(path)  # refuses a folder something was written into since the check
    os.replace(staging, path)


def _uninterrupted(step) -> None:
    """Run ``step`` until it returns, and only then raise a KeyboardInterrupt that landed meanwhile: ``step``
    goes on from where the folders are, so an interrupt cannot stop a save half way through putting its trace in
    place and deleting the old one's files (which left the old trace in a hidden folder beside ``path``).  An
    error ends it at once, ``step`` having put back what it moved."""
    interrupted = None
    while True:
        try:
            step()
            break
        except KeyboardInterrupt as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


def check_save_target(path: str, overwrite: bool, rank=None):
    """The files of the saved trace at ``path`` that saving over it will remove; None when nothing (or an empty
    folder) is there.  ``rank``: the saving trace's, refused over another rank's trace even with ``overwrite``."""
    _refuse_empty(path)  # here too for the command line's --save, which checks its folder before tracing
    _refuse_dot_ending(path)
    if not os.path.lexists(path):
        return None
    if os.path.islink(path):
        raise TraceFileError(f"{path} is a symbolic link; torchlens does not save through links (a link may "
                             "point anywhere): save to the folder it points to, or choose another path")
    if not os.path.isdir(path):
        raise TraceFileError(f"{path} exists and is a file, not a saved trace; choose another path")
    if os.path.samefile(path, os.curdir):  # a save swaps folders: this process would be left in a deleted one
        raise TraceFileError(f"{path} is the current working directory; save the trace to a folder inside it "
                             "(run1, not .)")
    if not os.listdir(path):
        return None  # an empty folder: replaced only once the new trace is written (``_move_in``)
    if not os.path.lexists(os.path.join(path, MANIFEST)):
        raise TraceFileError(f"{path} exists and is not a saved trace; choose another path")
    try:
        manifest = read_json(path, MANIFEST, "overwriting a saved trace")
    except TraceFileError as exc:
        raise TraceFileError(f"{path} exists and is not a saved trace (its manifest is unreadable: {exc}); "
                             "choose another path") from None
    if not isinstance(manifest, dict) or manifest.get("format") != TRACE_FORMAT \
            or not isinstance(manifest.get("schema_version"), int) or not isinstance(manifest.get("files"), dict):
        raise TraceFileError(f"{path} exists and is not a saved trace (its manifest.json does not name the "
                             f"{TRACE_FORMAT!r} format and a schema version); choose another path")
    saved_rank = manifest.get("rank")
    if rank is not None and saved_rank is not None and saved_rank != rank:
        raise TraceFileError(f"{path} holds the trace rank {saved_rank} saved, and this is rank {rank}'s: saving "
                             f"it there would replace that rank's trace{_one_folder_per_rank(path, rank)}")
    if not overwrite:
        raise TraceFileError(f"{path} already holds a saved trace; pass overwrite=True to replace it")
    for name in manifest["files"]:
        safe_member(path, name)  # a manifest naming a path outside the folder is refused, not obeyed
    return [MANIFEST, *manifest["files"]]


def _refuse_empty(path: str) -> None:
    if not path:
        raise TraceFileError("the save path is empty; give the folder to write the trace to (log.save('run1'))")


def _refuse_dot_ending(path: str) -> None:
    """Refuse a path whose last part is ``.`` or ``..`` (``run1/.``, ``runs/a/..``), the current folder aside (which
    ``check_save_target`` refuses saying so).  A save writes the trace in a folder beside ``path`` and renames it
    into place: beside such a path is inside the folder it names, and the system renames no ``.`` or ``..``, so
    the save failed with a bare OSError, left an empty folder behind, or moved its own working folder around."""
    last = os.path.basename(path.rstrip(os.sep + (os.altsep or "")))
    if last not in (os.curdir, os.pardir) or os.path.isdir(path) and os.path.samefile(path, os.curdir):
        return
    raise TraceFileError(f"{path} ends in {last!r}; name the folder to save the trace to without it (e.g. "
                         f"{os.path.abspath(path)!r})")


def _replace_saved(path: str, staging: str, old_files: list) -> None:
    """Replace the saved trace at ``path`` by the one in ``staging``, deleting only ``old_files``."""
    others = sorted(n for n in os.listdir(path) if n not in old_files or not is_regular_file(os.path.join(path, n)))
    blocked = [n for n in os.listdir(staging)
               if n in others and n != MANIFEST and os.path.lexists(os.path.join(path, n))]
    if blocked or not is_regular_file(os.path.join(path, MANIFEST)):
        raise TraceFileError(f"{path}: {', '.join(blocked) or MANIFEST} exists but is not a regular file the old "
                             "trace's manifest lists, so saving would overwrite it; remove it or choose another path")
    retired = f"{staging}-old"
    try:
        _uninterrupted(lambda: _swap_in(path, staging, retired, old_files, whole_folder=not others))
    except PermissionError as exc:  # on Windows, most often a file of the old trace held open
        raise TraceFileError(f"cannot save over {path}: {exc.filename or path} could not be moved ({exc.strerror}); "
                             "the saved trace there is left as it was. A file in the folder may be in use (a trace "
                             "tl.load read from it holds its activations file until deleted, e.g. del loaded; or "
                             "another program holds one), or the folder may not be writable; release it, or save "
                             "to another path") from None
    if not others:
        return
    kept = [n for n in others if os.path.lexists(os.path.join(path, n))]
    warn_user(f"{path}: kept {counted(len(kept), 'entry', 'entries')} the old trace's manifest did not "
              f"list ({listed(kept, 5)}); saving over a trace removes only "
              "the files its manifest names")


def _swap_in(path: str, staging: str, retired: str, old_files: list, whole_folder: bool) -> None:
    """Put the new trace in ``staging`` at ``path``, the old one's files moved aside into ``retired``, then delete
    those.  Run again after an interrupt (``_uninterrupted``), it goes on from where the files are; on an error
    before the new trace is in place, the old trace is back at ``path`` as it was."""
    if os.path.isdir(staging) and os.listdir(staging):  # the new trace is not in place yet
        if whole_folder:
            _swap_folders(path, staging, retired)
        else:
            _swap_trace_files(path, staging, retired, old_files)
    if os.path.lexists(retired):
        _discard_retired(retired, old_files, path)
    if os.path.isdir(staging):
        # Emptied by _swap_trace_files: removed here, so that no interrupt can leave it, and only now, since its lock
        # tells a tl.load of path meanwhile that the old trace's files are being deleted by a save, not left by a
        # killed one (io/recover.py)
        os.rmdir(staging)


def _swap_folders(path: str, staging: str, retired: str) -> None:
    """The usual case: swap whole folders, so the old trace stays whole until the new one is in place."""
    if not os.path.lexists(retired):  # (moved aside by an earlier, interrupted, try)
        os.replace(path, retired)
    try:
        os.replace(staging, path)
    except OSError:
        os.replace(retired, path)  # put the old trace back where it was
        raise


def _swap_trace_files(path: str, staging: str, retired: str, old_files: list) -> None:
    """Foreign files share the folder: the old trace's files are moved aside (its manifest first, so the folder
    stops claiming to be a trace), the new ones moved in (their manifest last), and the old ones deleted only
    then.  A step that fails (Ctrl-C; on Windows a file another program holds open) moves everything back."""
    os.makedirs(retired, exist_ok=True)
    try:
        _swap_files(path, staging, retired, [n for n in dict.fromkeys([MANIFEST, *old_files])
                                             if is_regular_file(os.path.join(path, n))])
    except BaseException:
        os.rmdir(retired)  # empty again: every file went back where it was
        raise


def _swap_files(path: str, staging: str, retired: str, old_names: list) -> None:
    """Move the old trace's files ``old_names`` (its manifest first) from ``path`` into ``retired``, then the new
    trace's from ``staging`` into ``path`` (its manifest last); if either fails, every file goes back."""
    try:
        _move_all(path, retired, old_names, undo=True)
        _move_all(staging, path, sorted(os.listdir(staging), key=lambda n: n == MANIFEST), undo=True)
    except BaseException:  # the old files moved aside go back, the manifest last: whole before it claims a trace
        _move_all(retired, path, [n for n in old_names[::-1] if os.path.lexists(os.path.join(retired, n))],
                  undo=False)
        raise


def _move_all(source: str, target: str, names: list, undo: bool) -> None:
    """Move the files ``names`` from ``source`` into ``target`` in order; if a move fails, those already moved
    go back, in reverse order, when ``undo``."""
    moved = []
    try:
        for name in names:
            moved.append(name)  # before the move: an interrupt landing just after it must find it listed
            os.replace(os.path.join(source, name), os.path.join(target, name))
    except BaseException:
        if undo:
            for name in reversed(moved):
                if os.path.lexists(os.path.join(target, name)):  # (the last listed may not have moved)
                    os.replace(os.path.join(target, name), os.path.join(source, name))
        raise


def _discard_retired(retired: str, old_files: list, path: str) -> None:
    """Delete the old trace's files, moved aside into ``retired``, once the new trace is in place: a file that
    cannot be deleted (read-only, or held open, on Windows) leaves the folder behind, with a warning, since the
    save itself has succeeded."""
    try:
        _remove_files(retired, old_files)
        os.rmdir(retired)
    except OSError as exc:
        warn_user(f"{path}: the new trace is saved, but the old trace's files could not all be deleted "
                  f"({exc.strerror or exc}); they are left in {retired}, which you can delete")


def _remove_files(folder: str, names: list) -> None:
    """Delete the regular files ``names`` from ``folder``; anything else under those names stays."""
    for name in [MANIFEST, *[n for n in names if n != MANIFEST]]:
        member = os.path.join(folder, name)
        if is_regular_file(member):
            os.remove(member)


def _activation_tensors(trace):
    """Distinct saved tensors (as held: ``write_tensors`` streams their values); ``index -> key``; unsavable
    reasons."""
    tensors, keys, unsaved = {}, {}, {}
    key_of_tensor: dict = {}
    if trace.is_cleaned_up:
        return tensors, keys, unsaved
    trace.drop_written()  # a tensor written since the trace is not what its op made
    for index, t in sorted(trace.saved_activations.items()):
        same = alias_key(t)  # each op's detach of one tensor is written once, as log.saved_bytes counts it
        key = key_of_tensor.get(same)
        if key is None:
            problem = unsavable(t)
            if problem:
                unsaved[index] = problem
                continue
            key = key_of_tensor[same] = f"a{index}"
            tensors[key] = t
        keys[index] = key
    return tensors, keys, unsaved


def trace_columns(trace, keys: dict, unsaved: dict, with_activations: bool) -> dict:
    """Every column of ``trace`` as JSON-ready data (see load.py for the reverse)."""
    funcs, func_index = [], {}
    codes, code_index = [], {}
    saved_paths = trace.saved_func_paths  # a loaded trace holds no functions: their paths as first saved

    def func_id(func, position: int) -> int:
        key = id(func) if func is not None or saved_paths is None else saved_paths[position]
        i = func_index.get(key)
        if i is None:
            i = func_index[key] = len(funcs)
            funcs.append(_qualified_name(func) if func is not None or saved_paths is None else key)
        return i

    def code_id(code) -> int:
        if code is None:
            return -1
        i = code_index.get(id(code))
        if i is None:
            i = code_index[id(code)] = len(codes)
            codes.append([code.co_filename, getattr(code, "co_qualname", code.co_name)])
        return i

    calls = [[func_id(c.func, position), encode_value(c.args), encode_value(c.kwargs),
              [[encode_value(pos), p] for pos, p in c.parents], c.module_call, code_id(c.code), _line(c.code, c.line),
              c.t0_ns, c.t1_ns, c.first_record, c.num_outputs, bool(c.wrote_arguments),
              [[encode_value(pos), [int(d) for d in p.shape]] for pos, p in c.params]]
             for position, c in enumerate(trace.calls)]
    dropped = dict(trace.dropped_activations)
    if not with_activations and not trace.is_cleaned_up:
        dropped.update({i: WITHOUT_ACTIVATIONS for i in trace.saved_activations if i not in dropped})
    dropped.update(unsaved)
    return {
        "model_name": trace.model_name,
        "rank": trace.rank,
        "world_size": trace.world_size,
        "n_ops": len(trace.kinds),
        "cleaned_up": trace.is_cleaned_up,
        "kind": [int(k) for k in trace.kinds],
        "call": list(trace.call_indices),
        "slot": [encode_value(s) for s in trace.slots],
        "meta": [_meta(m) for m in trace.op_meta],
        "parents": [[[encode_value(pos), p] for pos, p in ps] for ps in trace.op_parents],
        "module_call": list(trace.module_call_indices),
        "inplace": [bool(x) for x in trace.inplace_flags],
        "io": [[i, p] for i, p in sorted(trace.io_paths.items())],
        "labels": list(trace.labels),
        "layer_labels": list(trace.op_layer_labels),
        "pass": list(trace.pass_numbers),
        "group": list(trace.groups),
        "group_size": [[g, n] for g, n in trace.group_sizes.items()],
        "types": list(trace.op_types),
        "func_names": list(trace.func_names),
        "dropped": [[i, r] for i, r in sorted(dropped.items())],
        "finite": [[i, bool(f[0]), bool(f[1])] for i, f in sorted(trace.finite_flags.items())],
        "param_addresses": [[i, list(a)] for i, a in sorted(trace.param_addresses.items())],
        "params": write_params(trace),  # io/params.py
        "module_param_counts": write_module_param_counts(trace),
        "funcs": funcs,
        "codes": codes,
        "calls": calls,
        "modules": [[m.address, list(m.all_addresses), m.class_name, list(m.param_names)] for m in trace.modules],
        "module_calls": _module_calls(trace),
        "unattributed": trace.unattributed,
        "timings": {k: float(v) for k, v in trace.timings.items()},
        "budget_exhausted_at": trace.budget_exhausted_at,
        "alias_reads": sorted([int(c), int(p)] for c, p in trace.alias_reads),
        "activations": [[i, k] for i, k in sorted(keys.items()) if i not in dropped],
        "flops": trace._flops_col,  # derived before cleanup(), when arguments were held
        **_output_structure(trace),
        **write_trace_state(trace),  # io/trace_state.py
    }


def _output_structure(trace) -> dict:
    """``{"output_structure": ...}`` when the output's containers are known: a live trace's output, or
    the structure a loaded trace was read with; nothing after ``cleanup()`` released the output."""
    from ..record.saved_output import output_structure

    if trace.loaded_from is not None:
        known = trace._output_structure
        return {} if known is None else {"output_structure": encode_value(known[0])}
    if trace.is_cleaned_up or trace.stopped_after is not None:
        return {}
    return {"output_structure": encode_value(output_structure(trace._output))}


def _line(code, offset):
    # Calls record the user frame's instruction offset; a saved trace keeps the resolved line number.
    from ..record.source import line_of

    return None if code is None else line_of(code, offset)


def _qualified_name(func) -> str:
    from ..labels.naming import func_name_of

    owner = getattr(func, "__module__", None) or getattr(getattr(func, "__objclass__", None), "__name__", "")
    return f"{owner}.{getattr(func, '__qualname__', func_name_of(func))}" if owner else func_name_of(func)


def _meta(m) -> list:
    """One ``OpMeta`` as the file's meta row: [shape, dtype, device, requires_grad, grad_fn class name]."""
    shape, grad_fn = m.shape, m.grad_fn_class
    row = [[None if d is None else int(d) for d in shape], torch_constant_name(m.dtype), str(m.device),
           bool(m.requires_grad), grad_fn.__name__ if grad_fn is not None else None]
    return row + [int(shape.numel)] if None in shape else row  # a nested tensor: None where ragged


def _module_calls(trace) -> list:
    ops = trace._call_ops()
    return [[row.module, row.number, row.parent, row.start_ns, row.end_ns, list(row.inputs), list(row.outputs),
             list(ops[k])] for k, row in enumerate(trace._call_rows)]
