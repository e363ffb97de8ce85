"""``nonfinite_origin``: the forward op where a NaN or Inf was born, read from an existing trace.

The origin is the first op in execution order whose output holds a NaN or Inf while every tensor it
read was finite; later non-finite ops that read a non-finite tensor merely propagated it.  Evidence for
each op comes from its saved activation or, when the trace was taken with ``record_finite=True``, from
the flag capture recorded (flags survive ``cleanup()``).  Ops with neither are *unexamined*: when one of
them is an ancestor of the first non-finite op seen, it could be the true origin, and the report says so.

What a forward trace cannot see — NaNs born in backward, errors inside custom ``autograd.Function``
backward code, a NaN born and removed inside one captured call — is autograd anomaly mode's job; every
report carries ``DETECT_ANOMALY_RECIPE``, the same text each time.
"""

from __future__ import annotations

import torch

from ..checks import check_flag
from ..record.columns import Kind, overwritten_allocations, uninitialized_ops
from ..record.dropped import all_made_in_transform
from ..record.finite import nonfinite_flags
from ..record.params import changed_since_trace
from ..record.trace import checked_trace
from ..errors import TraceCleanedUp, counted, listed, refusing_unknown_keywords
from ..tree import without_values

DETECT_ANOMALY_CODE = """\
import torch

with torch.autograd.set_detect_anomaly(True):
    loss = model(x).sum()  # forward: anomaly mode keeps each op's creation traceback
    loss.backward()  # raises at the first backward node that returns NaN, naming it
"""
DETECT_ANOMALY_RECIPE = (
    "For NaN/Inf born in backward, or inside a custom autograd.Function, let autograd find it: run the "
    "failing step once under anomaly mode (slower; leave it off otherwise):\n\n"
    + "".join(f"    {line}\n" if line else "\n" for line in DETECT_ANOMALY_CODE.splitlines())
    + "\nThe RuntimeError names the backward node (e.g. 'SqrtBackward0') and the warning above it shows the "
      "forward line that created it. Anomaly mode checks backward outputs for NaN only: an Inf raises nothing "
      "until it turns into a NaN further on, so it names that later node; the gradients of a trace taken with "
      "grads=True show where the Inf itself appeared (tl.debug.nonfinite_origin(log, grads=True)).")

_KINDS = {(True, False): "nan", (False, True): "inf", (True, True): "both"}
# Among possible origins: what a collective received, which no op of this rank's trace holds.
OTHER_RANKS = "(values other ranks sent to the collective)"
_OUTSIDE = "(a tensor made outside the trace)"  # among possible origins: an argument no op of the trace made
_CHANGED = "changed since the trace"  # why a parameter is among them
_UNCHECKED = "not checked: the trace no longer holds the model"
_UNREGISTERED = "not checked: no parameter of the traced model"  # a function given to tl.trace called the module


class NonfiniteReport:
    """Where a NaN/Inf entered the forward, what carried it, and what could not be examined."""

    def __init__(self, **fields):
        self.found = fields["found"]
        self.origin = fields["origin"]  # Op, or None
        # "op", "intervention", "input", "buffer", "buffer_write" (a kernel's write into one), "parameter" or None
        self.origin_kind = fields["origin_kind"]
        self.kind = fields["kind"]  # "nan", "inf", "both" or None
        self.certain = fields["certain"]
        self.possible_origins = tuple(fields["possible_origins"])
        self.propagators = tuple(fields["propagators"])
        self.other_origins = tuple(fields["other_origins"])
        self.undetermined = tuple(fields["undetermined"])  # later non-finite ops fed by unexamined ones
        self.parameters = tuple(fields["parameters"])
        self.parameters_checked = fields["parameters_checked"]
        self.parameters_changed = tuple(fields.get("parameters_changed", ()))  # since the trace: not checked
        self.basis = fields["basis"]
        self.examined = fields["examined"]
        self.unexamined = tuple(fields["unexamined"])
        self.uninitialized = tuple(fields["uninitialized"])  # non-finite values that are undefined memory
        # (op label, buffer address, kind) for each running statistic an op's kernel left non-finite
        self.buffers_written = tuple(fields.get("buffers_written", ()))
        self.stats_unexamined = tuple(fields.get("stats_unexamined", ()))  # ops writing statistics not traced
        self.recipe = DETECT_ANOMALY_RECIPE

    @property
    def origin_label(self):
        """The origin op's label (``sqrt_1_3:1``), or None where no op is the origin."""
        return self.origin.label if self.origin is not None else None

    @property
    def module(self):
        """The label of the module call the origin op ran in (``block:1``), or None."""
        return self.origin.module if self.origin is not None else None

    @property
    def source(self):
        """The user's line that led to the origin op (``.file``, ``.line``, ``.function``, ``.code``), or None."""
        return self.origin.source if self.origin is not None else None

    def __bool__(self) -> bool:
        return self.found

    def __str__(self) -> str:
        lines = [f"non-finite origin ({counted(self.examined, 'op')} examined from {self.basis}):"]
        if not self.found:
            lines.append("  no NaN or Inf in any examined forward output")
        else:
            lines += self._origin_lines()
        if self.unexamined:
            shown = listed(self.unexamined, 5)
            lines.append(f"  {counted(len(self.unexamined), 'op')} not examined (not saved, no finite flag): {shown}")
        if self.uninitialized:
            shown = listed(self.uninitialized, 5)
            lines.append(f"  not evidence: {shown} held NaN/Inf in uninitialized memory (torch.empty and kin, a view "
                         "of it, or a write into part of it), whose contents are undefined")
        if self.buffers_written and self.origin_kind != "buffer_write":
            shown = ", ".join(f"{address} ({kind.upper()}, by {label})"
                              for label, address, kind in self.buffers_written)
            lines.append(f"  running statistics left non-finite inside a kernel: {shown}")
        if self.stats_unexamined:
            lines.append(f"  running statistics written inside the kernels of {listed(self.stats_unexamined, 5)} "
                         "were not examined (tensors from outside the trace, not buffers of a traced module): trace "
                         "the module that holds them (tl.trace(model, x)) to examine them")
        if self.parameters and self.origin_kind != "parameter":
            lines.append(f"  parameters holding NaN/Inf: {', '.join(self.parameters)}")
        if not self.parameters_checked:
            lines.append("  parameters were not checked (the trace no longer holds the model)")
        if self.parameters_changed:
            shown = listed(self.parameters_changed, 5)
            lines.append(f"  {len(self.parameters_changed)} parameters changed since the trace (an optimizer step?) "
                         f"were not checked: {shown}; run nonfinite_origin before the step to check them")
        lines += ["", self.recipe]
        return "\n".join(lines)

    def _origin_lines(self) -> list:
        op = self.origin
        where = f" in {op.module}" if op.module else ""
        source = f" at {op.source}" if op.source else ""
        if self.origin_kind in ("input", "buffer"):
            lines = [f"  {self.kind.upper()} already present in {self.origin_kind} {op.io_path} ({op.label}): "
                     "not born in this forward"]
        elif self.origin_kind == "parameter":
            read = [a for a in self.parameters if a in op.params]
            lines = [f"  {self.kind.upper()} already present in parameter(s) {', '.join(read)}, first "
                     f"read by {op.label} ({op.func_name}){where}{source}"]
        elif self.origin_kind == "buffer_write":
            lines = [f"  {'origin' if self.certain else 'last writer'}: {op.label} ({op.func_name}){where}{source} "
                     f"left {self.kind.upper()} in {_written_by(self.buffers_written, op.label)}, written inside "
                     "its kernel" + (" from finite inputs" if self.certain else "" if self.possible_origins
                                     else " (not all its inputs examined)")
                     + " (its output was finite): a running statistic that overflowed"]
            if self.possible_origins:
                lines.append(f"  earlier calls wrote it too, in their kernels, unexamined: the origin may be among "
                             f"{_some(self.possible_origins, 'possible_origins')}")
        elif self.origin_kind == "intervention":
            made = "was finite" if self.certain else \
                "was not kept, so either the op or the action may have made it"
            lines = [f"  origin: {op.intervention!r} left a value holding {self.kind.upper()} at {op.label} "
                     f"({op.func_name}){where}{source}; the op's own value {made}"]
        elif self.certain:
            lines = [f"  origin: {op.label} ({op.func_name}){where}{source} produced {self.kind.upper()} from "
                     "finite inputs"]
        elif self.possible_origins == (OTHER_RANKS,):
            lines = [f"  first non-finite op examined: {op.label} ({op.func_name}){where}{source} produced "
                     f"{self.kind.upper()}, from finite inputs on this rank, but it is a collective: the other ranks' "
                     "values it read may hold it, or it made it (a sum that overflows); run nonfinite_origin on every "
                     "rank too"]
        else:
            undefined = any(p in self.uninitialized for p in self.possible_origins)
            among = counted(len(self.possible_origins), "ancestor") + " not examined or uninitialized" if undefined \
                else counted(len(self.possible_origins), "unexamined ancestor")
            lines = [f"  first non-finite op examined: {op.label} ({op.func_name}){where}{source} produced "
                     f"{self.kind.upper()}, but not all of its inputs were examined"
                     + (" and defined" if undefined else ""),
                     f"  the origin may be among {among}: "
                     f"{_some(self.possible_origins, 'possible_origins')}; "
                     f"{_advice(self.possible_origins, self.uninitialized)}"]
        if self.propagators:
            lines.append(f"  propagated by {len(self.propagators)} op(s): {listed(self.propagators, 8)}")
        if self.other_origins:
            lines.append(f"  further independent origins: {_some(self.other_origins, 'other_origins')}")
        if self.undetermined:
            lines.append(f"  also non-finite, fed by unexamined ops (origin or propagator, cannot tell): "
                         f"{_some(self.undetermined, 'undetermined')}")
        return lines

    __repr__ = __str__


def _written_by(written, label: str) -> str:
    return ", ".join(f"buffer {address}" for by, address, _ in written if by == label)


def _advice(possible, uninitialized=()) -> str:
    """How to examine the possible origins: ops by recording flags, parameters on a trace that holds the model,
    other ranks' values by looking there; uninitialized memory (``uninitialized``) no flag can vouch for."""
    ways = []
    undefined = [p for p in possible if p in uninitialized]
    if any(not p.startswith("(") and p not in undefined for p in possible):
        ways.append("trace with record_finite=True to examine every op (and save the outputs of collectives issued "
                    "async: their flags are taken when they are issued, before their results arrive)")
    if _OUTSIDE in possible:  # no flag is taken for it: it is no op's, input's or buffer's value
        ways.append("a tensor the forward read but the trace did not make (a module attribute that is not a "
                    "buffer, a global, the output of a TorchScript module) is never examined, flags or not: register "
                    "it as a buffer (module.register_buffer), pass it in as an input, or run such a module as plain "
                    "Python to have it examined")
    if any(p.endswith(f"{_UNCHECKED})") for p in possible):
        ways.append("call nonfinite_origin before cleanup(), on the trace that holds the model, to check the "
                    "parameters")
    if any(p.endswith(f"{_UNREGISTERED})") for p in possible):
        ways.append("trace the module itself (tl.trace(model, x)), not a function that calls it, to check its "
                    "parameters")
    if any(p.endswith(f"{_CHANGED})") for p in possible):
        ways.append("call nonfinite_origin before the parameters change (an optimizer step) to check them")
    if OTHER_RANKS in possible:
        ways.append("it is a collective, so run nonfinite_origin on every rank too")
    if undefined:  # examined, and set aside: recording flags would examine them again, to no more effect
        ways.append(f"{listed(undefined, 3)} held uninitialized memory (torch.empty and kin), whose bits say nothing "
                    "whatever was recorded: write every element (fill_, zero_, copy_) before reading it")
    return "; ".join(ways)


def _some(labels, attribute: str) -> str:
    """The first labels of a long list for the printed report, and the attribute that holds them all."""
    return listed(labels, 8, f" ... (all {len(labels)} in report.{attribute})")


@refusing_unknown_keywords("tl.debug.nonfinite_origin")
def nonfinite_origin(log, grads: bool = False):
    """Name the forward op where a NaN/Inf first appeared in ``log`` (no extra forward is run).

    With ``grads=True``, name instead the first op, in backward order, whose gradient became NaN/Inf
    (a trace taken with ``grads=True``, after a backward): see ``debug/grad_nonfinite.py``."""
    checked_trace(log, "nonfinite_origin")
    check_flag(grads, "grads", "give True or False: nonfinite_origin reads the trace alone and runs nothing, so it "
               "takes no inputs", who="nonfinite_origin")
    if grads:
        from .grad_nonfinite import grad_nonfinite_origin

        return grad_nonfinite_origin(log)
    has_flags = bool(log.finite_flags)
    if log.is_cleaned_up and not has_flags:
        raise TraceCleanedUp("nonfinite_origin needs saved activations or finite flags, and this trace was "
                             "cleaned up without flags: call it before cleanup(), or trace with "
                             "record_finite=True (the flags survive cleanup)")
    if not log.is_cleaned_up:
        log.drop_written()  # a tensor written since the trace is not what its op made
    # Outputs repeat their producer's tensor: not examined twice.
    status = [_status(log, i) if k != Kind.OUTPUT else None for i, k in enumerate(log.kinds)]
    examined = sum(1 for s in status if s is not None)
    if examined == 0 and any(k != Kind.OUTPUT for k in log.kinds):
        _refuse_nothing_examined(log)
    bad_params, params_checked, params_changed = _nonfinite_parameters(log)
    unread_params = _UnreadParameters(log, params_checked, params_changed)
    unexamined = [log.labels[i] for i, s in enumerate(status) if s is None and log.kinds[i] != Kind.OUTPUT]
    uninitialized = _set_aside_uninitialized(log, status)
    origin = origin_kind = None
    certain, possible, propagators, others, undetermined = True, [], [], [], []
    for i, s in enumerate(status):
        if s is None or s == (False, False):
            continue
        if any(p >= 0 and status[p] not in (None, (False, False)) for p in _read_parents(log, i)):
            propagators.append(log.labels[i])
            continue
        kind_here, unsure = _birth_kind(log, i, bad_params, status, unread_params)
        if origin is None:
            origin, origin_kind = i, kind_here
            if unsure:
                read_params = unread_params.possible_origins(log.param_addresses.get(i, ()))
                certain, possible = False, list(dict.fromkeys(  # each once: ancestors may name OTHER_RANKS
                    _unexamined_ancestors(log, status, i) + read_params
                    + ([OTHER_RANKS] if _from_other_ranks(log, i) else [])))
        elif unsure:
            undetermined.append(log.labels[i])
        else:
            others.append(log.labels[i])
    stats = _stats_born(log, status)
    if stats and origin is None:
        first = min(stats)
        origin, origin_kind, status[first] = first, "buffer_write", _worst(flags for _, flags, _ in stats[first])
        earlier = [log.labels[e] for _, _, before in stats[first] for e in before]
        certain = not earlier and all(status[p] is not None for p in _read_parents(log, first))
        possible = list(dict.fromkeys(earlier))  # each wrote the statistic in its kernel, unexamined
    others += [log.labels[i] for i in sorted(stats) if i != origin and log.labels[i] not in others]
    basis = ("recorded finite flags" if has_flags and (log.is_cleaned_up or not log.saved_activations) else
             "saved activations and recorded finite flags" if has_flags else "saved activations")
    return NonfiniteReport(
        found=origin is not None, origin=log.ops[origin] if origin is not None else None,
        origin_kind=origin_kind, kind=_KINDS[status[origin]] if origin is not None else None, certain=certain,
        possible_origins=possible, propagators=propagators, other_origins=others,
        undetermined=undetermined,
        parameters=bad_params,
        parameters_checked=params_checked, parameters_changed=params_changed, basis=basis, examined=examined,
        unexamined=unexamined, uninitialized=uninitialized,
        stats_unexamined=_stats_unexamined(log),
        buffers_written=tuple((log.labels[i], address, _KINDS[flags])
                              for i in sorted(stats) for address, flags, _ in stats[i]))


def _refuse_nothing_examined(log) -> None:
    """Raise, naming why a trace with ops holds no value and no flag to examine, and what would give it some."""
    if _all_on_meta(log):
        raise ValueError("nonfinite_origin has nothing to examine: this forward ran on the meta device (or "
                         "under FakeTensorMode), whose tensors have shapes but no values; trace the model on "
                         "a real device")
    if all_made_in_transform(log):
        raise ValueError("nonfinite_origin has nothing to examine: this forward ran inside a torch.func transform "
                         "(vmap, grad, ...), whose values cannot be read once it has returned (and which "
                         "record_finite=True cannot examine); trace the model outside the transform")
    gone = _why_activations_gone(log)
    if gone is not None:
        raise ValueError(f"nonfinite_origin has nothing to examine: the trace loaded from {log.loaded_from} "
                         f"holds no activations ({gone}) and no finite flags; save it with its activations, "
                         "or trace with record_finite=True (the flags are saved with the metadata)")
    raise ValueError("nonfinite_origin has nothing to examine: no activation was saved and no finite flag "
                     "recorded; trace with save='all' or record_finite=True")


def _stats_born(log, status) -> dict:
    """``{op: ((buffer address, flags), ...)}``: the running statistics (BatchNorm's ``running_var``) that op
    left holding NaN/Inf, written inside its kernel, from values it read finite: that write is in no output,
    so the op's own status cannot show it (capture noted the statistics' state at the forward's end)."""
    written = log._stats_left_nonfinite
    return {i: stats for i, stats in written.items()
            if not any(p >= 0 and status[p] not in (None, (False, False)) for p in _read_parents(log, i))}


def _stats_unexamined(log) -> tuple:
    """Labels of the ops that wrote, inside their kernels, running statistics from outside the trace (capture
    noted them: ``stats_writers_untracked``): whether those went non-finite is not known."""
    return tuple(log.labels[i] for i in log._stats_untracked)


def _worst(flags) -> tuple:
    """``(has_nan, has_inf)`` over several flags."""
    flags = list(flags)  # (a generator: read twice below)
    return any(nan for nan, _ in flags), any(inf for _, inf in flags)


def _status(log, i):
    """``(has_nan, has_inf)`` for op ``i``, or None when neither an activation nor a flag says."""
    flag = log.finite_flags.get(i)
    if flag is not None:
        return tuple(flag)
    if log.is_cleaned_up or log.ops[i].dropped_reason is not None:
        return None
    t = log.saved_activations.get(i)
    if t is None:
        return None
    return nonfinite_flags(t)


def _why_activations_gone(log):
    """Why a loaded trace holds no activation it saved (written with activations=False), or None."""
    if log.loaded_from is None:
        return None
    return next((log.ops[i].dropped_reason for i, kind in enumerate(log.kinds)
                 if kind != Kind.OUTPUT and log.ops[i].dropped_reason is not None), None)


def _all_on_meta(log) -> bool:
    saved = [] if log.is_cleaned_up else list(log.saved_activations.values())
    return bool(saved) and all(isinstance(t, torch.Tensor) and without_values(t) for t in saved)


def _read_parents(log, i) -> list:
    """The parents whose values op ``i`` read: not the uninitialized memory it overwrote whole (a ``copy_`` into a
    ``torch.empty``), whose bits it never looked at."""
    parents = [p for _, p in log.op_parents[i]]
    if not log.ops[i].is_inplace:
        return parents
    overwritten = overwritten_allocations(log, log.ops[i])
    return [p for p in parents if p not in overwritten]


def _set_aside_uninitialized(log, status) -> list:
    """Labels of the non-finite values that are uninitialized memory, their status set to unknown (None).

    ``torch.empty`` and kin return whatever bits the memory held (NaN under
    ``torch.use_deterministic_algorithms(True)``, which fills it so), and a model fills the tensor afterwards
    (DeepSeek-V3 writes its key states into two slices of a ``new_empty``).  Such a value, a view of it, or a
    write into part of it says nothing about where a NaN was born.  A later op that computes with one is
    then not certain to be an origin: its undefined input is named among the possible ones.  A write into part
    of memory holding NaN/Inf leaves the rest of it so, whatever the part it wrote holds (its own value, a view):
    the ops reading the whole tensor after it name the write as their parent, so it is set aside too."""
    undefined, found, aside = uninitialized_ops(log, through_writes=True), [], set()
    for i in sorted(undefined):
        carried = log.ops[i].is_inplace and any(p in aside for _, p in log.op_parents[i])
        if carried or status[i] not in (None, (False, False)):
            status[i] = None
            aside.add(i)
            found.append(log.labels[i])
    return found


def _birth_kind(log, i, bad_params, status, unread_params=()):
    """What a non-finite op with no non-finite examined parent is: ("op" / "input" / "buffer" /
    "parameter", unsure) where unsure means an unexamined or untracked tensor fed it, or it read a parameter
    whose value at the forward is unknown (``unread_params``, a ``_UnreadParameters``)."""
    kind = log.kinds[i]
    if kind == Kind.INPUT:
        return "input", False
    if kind == Kind.BUFFER:
        return "buffer", False
    params = log.param_addresses.get(i, ())
    if any(p in bad_params for p in params):
        return "parameter", False
    unsure = any(p < 0 or status[p] is None for p in _read_parents(log, i)) or \
        any(p in unread_params for p in params) or _from_other_ranks(log, i)
    if i in log._interventions:
        by_action = _action_made_it(log, i)
        if by_action is not False:
            return "intervention", by_action is None
    return "op", unsure


class _UnreadParameters:
    """The parameters whose value at the forward is unknown, as ``in`` answers it: all of them when the trace no
    longer holds the model, else those changed since the trace and those the model does not hold (read by a
    module that a function given to ``tl.trace`` called: named by shape, never checked)."""

    def __init__(self, log, checked: bool, changed):
        self.held = {address for address, _ in log._model_params or ()} if checked else None
        self.changed = set(changed)

    def why(self, address):
        """Why ``address`` was not checked, or None when it was."""
        if self.held is None:
            return _UNCHECKED
        if address in self.changed:
            return _CHANGED
        return None if address in self.held else _UNREGISTERED

    def __contains__(self, address) -> bool:
        return self.why(address) is not None

    def possible_origins(self, addresses) -> list:
        return [f"(parameter {a}, {self.why(a)})" for a in addresses if a in self]


def _from_other_ranks(log, i) -> bool:
    """Whether op ``i`` is a collective that read other ranks' values (the trace examined this rank's alone): a
    NaN in its output may have come from one of them, or been born in it (a sum that overflows)."""
    if (log.world_size or 1) == 1 or log.kinds[i] != Kind.OP:  # None: traced outside torch.distributed
        return False
    from ..distributed.collectives import is_collective_op

    return is_collective_op(log.ops[i])


def _action_made_it(log, i):
    """Whether the non-finite value of op ``i``, where an intervention ran, is the action's: True when the op's
    own value (``original``, kept where the action replaced a saved value) was finite, False when it was not or
    when the action kept the op's value (a saved activation with no original), None when nothing tells."""
    original = log._originals.get(i)
    if original is not None:
        return not any(nonfinite_flags(original) or ())
    return None if log.is_cleaned_up or i not in log.saved_activations else False


def _unexamined_ancestors(log, status, i) -> list:
    """Unexamined ops upstream of ``i`` reachable without crossing an examined op."""
    found, stack, seen = [], [i], {i}
    while stack:
        for p in _read_parents(log, stack.pop()):
            if p >= 0 and p not in seen:
                seen.add(p)
                if status[p] is None:
                    found.append(p)
                    stack.append(p)
    found.sort()
    labels = [log.labels[p] for p in found]
    if any(p < 0 for p in _read_parents(log, i)):
        labels.append(_OUTSIDE)
    if any(_from_other_ranks(log, p) for p in found):  # an unexamined collective may have received it
        labels.append(OTHER_RANKS)
    return labels


def _nonfinite_parameters(log):
    """``(addresses of the traced model's parameters holding NaN/Inf, whether parameters could be checked at all,
    addresses of those changed since the trace)``.  A parameter is read as it is now, which is what the forward
    read only while its version is the one the forward ended with: one changed since (an optimizer step, which
    a NaN or Inf gradient leaves non-finite) is not checked, and not blamed."""
    if log.is_cleaned_up or log.loaded_from is not None:  # no live model to look at
        return [], False, []
    changed = changed_since_trace(log)
    skipped = set(changed)
    with torch.no_grad():  # as the trace names them (a plain function has none)
        bad = [address for address, p in log._model_params or ()
               if address not in skipped and any(nonfinite_flags(p) or ())]
    return bad, True, changed
