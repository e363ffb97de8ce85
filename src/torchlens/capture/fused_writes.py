"""Writes that torch makes inside a kernel, predicted from the call: normalisation running statistics, and
the observer statistics and quantization parameters of QAT's fused fake-quantize kernel.

``F.batch_norm`` in training mode and ``F.instance_norm`` with input statistics (and the aten operators
beneath them, called directly), and ``batch_norm_update_stats`` at every call, update their running mean
and variance inside the kernel, without an in-place name or a schema that would announce it.  Buffers read
by such a call are saved by reference like any other activation, so copy-on-write must know of these
writes before the call runs, as it knows of ``add_``.  Any other write found only after a call (its
version counter moved) still drops what was saved of the written tensor, with the reason
(``CaptureState.note_writes``): nothing saved is ever silently changed.
"""

from __future__ import annotations

import operator
from itertools import compress

import torch
import torch.nn.functional as F

from ..record.columns import CALL_ARGS, CALL_FIRST_RECORD, CALL_FUNC, CALL_KWARGS, CALL_PARENTS
from ..record.finite import drained_flags, nonfinite_flags
from ..record.layouts import version_of
from .bindings import is_bound

_FUNC_OF = operator.itemgetter(CALL_FUNC)

# Torch-level functions whose kernel writes arguments that only their aten schema marks ``Tensor(a!)``:
# QAT's FusedMovingAvgObsFakeQuantize updates its observer's running min and max, the scale and the zero
# point (resizing them on its first call), moving no version counter.  ``capture/writes.py`` gives each
# its schema's verdict, so copy-on-write keeps what was saved of those buffers as they were read.
WRITES_BY_ATEN_SCHEMA = ("fused_moving_avg_obs_fake_quant", "_fused_moving_avg_obs_fq_helper")


def _schema_written_positions(name: str) -> tuple:
    """The positions of the arguments ``torch.ops.aten.<name>``'s default schema writes."""
    schema = getattr(torch.ops.aten, name).default._schema
    return tuple(k for k, argument in enumerate(schema.arguments)
                 if argument.alias_info is not None and argument.alias_info.is_write)


# func -> the positions of the buffers it writes.  Its flags (observer and fake quantization on) are tensors,
# which a recorded call no longer holds: the buffers are taken as written at every call.
_OBSERVERS = {getattr(torch, name): _schema_written_positions(name)
              for name in WRITES_BY_ATEN_SCHEMA}

# func -> (flag name, flag position, ((name, position) of each running statistic)): the statistics
# are written when the flag is true, or at every call when there is no flag (None).
_NORMS = {
    F.batch_norm: ("training", 5, (("running_mean", 1), ("running_var", 2))),
    F.instance_norm: ("use_input_stats", 5, (("running_mean", 1), ("running_var", 2))),
    torch.batch_norm: ("training", 5, (("running_mean", 3), ("running_var", 4))),
    torch.instance_norm: ("use_input_stats", 5, (("running_mean", 3), ("running_var", 4))),
}


def _aten_norms() -> dict:
    """The aten operators with ``torch.batch_norm``'s arguments whose kernel writes the running statistics,
    which their schemas do not mark written (``_native_batch_norm_legit``'s does: capture/writes.py reads
    it), called directly or through their default overload, and the torch-level functions of the same names
    (``torch.native_batch_norm``), whose Python signatures hide even a schema's mark."""
    found = {}
    for name, flag in (("batch_norm", "training"), ("native_batch_norm", "training"),
                       ("_batch_norm_impl_index", "training"), ("instance_norm", "use_input_stats")):
        packet = getattr(torch.ops.aten, name)
        for op in (packet, packet.default):
            found[op] = (flag, 5, (("running_mean", 3), ("running_var", 4)))
    # (torch.batch_norm and torch.instance_norm are in _NORMS already.  _native_batch_norm_legit's overload
    # without statistics has its flag at 3: read at 5, it is eps, and no tensor stands where statistics would.)
    for name in ("native_batch_norm", "_batch_norm_impl_index", "_native_batch_norm_legit"):
        found[getattr(torch, name)] = ("training", 5, (("running_mean", 3), ("running_var", 4)))
    # batch_norm_update_stats(input, running_mean, running_var, momentum): it updates them at every call.
    packet = torch.ops.aten.batch_norm_update_stats
    for op in (torch.batch_norm_update_stats, packet, packet.default):
        found[op] = (None, None, (("running_mean", 1), ("running_var", 2)))
    return found


_NORMS.update(_aten_norms())
WRITES_RUNNING_STATS = frozenset(_NORMS)
_KERNEL_WRITERS = WRITES_RUNNING_STATS | frozenset(_OBSERVERS)
# func -> (flag name, flag position): the compiled hot path skips the check when the flag is off (a call with
# no flag always writes: the Python check runs).
RUNNING_STATS_FLAGS = {func: (name, position) for func, (name, position, _) in _NORMS.items() if name is not None}
# func -> the positions of its running statistics: their slots in a call that passed neither by keyword
# (the usual one), and their names.
_POSITIONAL_STATS = {func: tuple(position for _, position in stats) for func, (_, _, stats) in _NORMS.items()}
_STAT_NAMES = {func: tuple(name for name, _ in stats) for func, (_, _, stats) in _NORMS.items()}


def _argument(args, kwargs, name: str, position: int):
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else None


def stat_slots(func, kwargs) -> tuple:
    """The argument slots (a position, or a keyword's name, as a call's parents name them) of a recorded
    norm call's running statistics, or of the buffers a fused observer call writes."""
    if func in _OBSERVERS:
        return _OBSERVERS[func]
    if not kwargs or kwargs.keys().isdisjoint(_STAT_NAMES[func]):
        return _POSITIONAL_STATS[func]
    return tuple(name if name in kwargs else position for name, position in _NORMS[func][2])


def _written_stat_slots(func, args, kwargs) -> tuple:
    """The slots of the running statistics a recorded call wrote in its kernel: none in eval mode (a fused
    observer call: its buffers' always).
    ``args`` and ``kwargs`` are the call as recorded, its tensors blanked: the flag is not a tensor, so it
    is still there."""
    if func in _OBSERVERS:
        return _OBSERVERS[func]
    flag_name, flag_position, _ = _NORMS[func]
    if flag_name is not None and not _argument(args, kwargs, flag_name, flag_position):
        return ()
    return stat_slots(func, kwargs)


def norm_calls(calls: list) -> list:
    """The positions in ``calls`` of the normalisation calls that read running statistics, and of the fused
    observer calls (C-level scans: a trace without one pays for the first alone)."""
    if _KERNEL_WRITERS.isdisjoint(map(_FUNC_OF, calls)):
        return []
    return list(compress(range(len(calls)), map(_KERNEL_WRITERS.__contains__, map(_FUNC_OF, calls))))


def link_running_stats_readers(calls: list, norms: list, alias_reads: set) -> None:
    """After the forward: make the op that last wrote a running statistic in its kernel the parent of
    each later read of it (the next BatchNorm call, code reading ``bn.running_mean`` or a fake-quantize
    module's ``scale``), as for any other write.  Such a write moves no version counter, so capture bound
    each later read to the statistic's record as first read, whose saved value predates the write.  Each
    rewritten edge is an alias read: the value read is not that op's output (replay skips it, saying so).
    ``norms``: ``norm_calls(calls)``."""
    writes = {}
    for c in norms:
        call = calls[c]
        slots = _written_stat_slots(call[CALL_FUNC], call[CALL_ARGS], call[CALL_KWARGS] or {})
        if slots:
            writes[c] = slots
    if writes:  # training mode (an eval-mode trace skips this walk over every call)
        _rebind_reads_to_writers(calls, alias_reads, writes)


def _rebind_reads_to_writers(calls: list, alias_reads: set, writes: dict) -> None:
    """Make each read of a running statistic after a call that wrote it (``writes``: call -> its written
    slots) name that call's first output as its parent, and note the edge as an alias read."""
    writer: dict = {}  # record as read -> first output record of the call that last wrote it
    for c, call in enumerate(calls):
        parents = call[CALL_PARENTS]
        if writer and any(record in writer for _, record in parents):
            parents = tuple((slot, writer.get(record, record)) for slot, record in parents)
            alias_reads.update((c, writer[record]) for _, record in call[CALL_PARENTS] if record in writer)
            calls[c] = (*call[:CALL_PARENTS], parents, *call[CALL_PARENTS + 1:])
        slots = writes.get(c)
        if slots:
            for slot, record in call[CALL_PARENTS]:  # the records as read, which later reads still name
                if slot in slots and record >= 0:
                    writer[record] = call[CALL_FIRST_RECORD]


def running_stats_written(func, args, kwargs) -> list:
    """The running-statistic tensors the call is about to update in its kernel (none in eval mode)."""
    flag_name, flag_position, stats = _NORMS[func]
    if flag_name is not None and not _argument(args, kwargs, flag_name, flag_position):
        return []
    found = (_argument(args, kwargs, name, position) for name, position in stats)
    return [t for t in found if isinstance(t, torch.Tensor)]


def stat_writes(calls: list, norms: list) -> list:
    """``(op, record)`` for each running statistic a norm call (``norms``: ``norm_calls(calls)``) wrote in its
    kernel, in call order: ``op`` the call's first output's record, ``record`` the one the statistic was read as
    (negative for a tensor the trace does not hold).  Read before ``link_running_stats_readers`` renames them."""
    writes = []
    for c in norms:
        call = calls[c]
        slots = _written_stat_slots(call[CALL_FUNC], call[CALL_ARGS], call[CALL_KWARGS] or {})
        if slots:
            writes += [(call[CALL_FIRST_RECORD], record) for slot, record in call[CALL_PARENTS] if slot in slots]
    return writes


def stats_left_nonfinite(writes: list, producers: dict, buffers) -> dict:
    """``{op: ((buffer address, (has_nan, has_inf), earlier writers), ...)}``: the running statistics that a call
    (its first output's record, ``op``) wrote last in its kernel and left holding NaN or Inf at the forward's end,
    with the ops of the calls that wrote each before it (a BatchNorm run twice), any of which may have made it.  That
    write is in no saved value (the statistic is saved as read, before the kernel ran) and moves no version
    counter, so ``nonfinite_origin`` would see it only on the next trace, as a buffer already non-finite.
    ``writes``: ``stat_writes``; ``buffers``: the model's ``(buffer, address)`` pairs; ``producers``: capture's,
    which still binds an untouched buffer to its read."""
    writers: dict = {}  # record of a statistic as read -> first record of each call that wrote it, in order
    for op, record in writes:
        writers.setdefault(record, []).append(op)
    if not writers:  # no kernel wrote a statistic (an eval forward): no buffer to look at
        return {}
    written = []  # (statistic, its address, the record it was read as)
    for b, address in buffers:
        entry = producers.get(id(b))
        if entry is not None and entry[1] in writers and is_bound(entry, b) and entry[2] == version_of(b):
            written.append((b, address, entry[1]))  # (else never read as a statistic, or written since by an op)
    # On an accelerator the flags stay on the device until one read of them all: no sync per statistic.
    flags = drained_flags({k: nonfinite_flags(b, sync=False) for k, (b, _, _) in enumerate(written)})
    found: dict = {}
    for k, (_, address, record) in enumerate(written):
        if flags[k] is not None and flags[k] != (False, False):
            *earlier, last = writers[record]
            found.setdefault(last, []).append((address, flags[k], tuple(earlier)))
    return {op: tuple(stats) for op, stats in found.items()}


def stats_writers_untracked(writes: list) -> list:
    """The first records of the calls that wrote, in their kernels, running statistics the trace does not hold
    (tensors from outside it: a BatchNorm called by a function traced with no root, or ``F.batch_norm`` given
    plain tensors), whose values after the write ``stats_left_nonfinite`` could not examine, each call once.
    ``writes``: ``stat_writes``."""
    return list(dict.fromkeys(op for op, record in writes if record < 0))
