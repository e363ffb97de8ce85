"""Validation by replay: does the trace describe what the model really computed?

``tl.validate(model, x)`` runs an untraced reference forward on a copy of the model, traces the model
itself, checks the traced outputs equal the reference bit for bit, and replays every op from its saved
parents and recorded non-tensor arguments.  ``trace.validate()`` does the replay part on an existing
trace that saved its activations.

Replay runs each op as it ran: under its grad mode and autocast state, with its inputs' ``requires_grad``
flags, on private copies of its inputs and of the parameters as they were when it ran (CPU kernels
differ with these: ``torch.lstm`` and attention pick other kernels without grad).  It never writes
model state, and it decides that an op is random by what it did, not by its name: an op whose replay
moved a random number generator is reported as not replayed, and the generators are put back.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from ..checks import check_model
from ..errors import closest_hint, counted, first_few, forward_keyword_hint
from ..record.columns import is_first_output, makes_uninitialized, uninitialized_ops
from ..record.dropped import WRITTEN_AFTER_TRACE, all_made_in_transform, is_param_written
from ..record.replay_context import ThreadSettings, as_traced, began_with, on_device, other_settings
from ..capture.collectives import is_collective
from ..capture.compiled import KeptForReplay, module_behind
from ..capture.restore import RngState, model_state, module_run_by
from ..capture.teardown import restore_grad_mode
from ..capture.writes import schema_written, write_verdict
from ..copies import clone_call, copied_whole, copy_with_layout, generator_twin, is_global_generator
from ..tree import (as_args, as_kwargs, fill, outputs_equal, path_text, slice_with_tensor, structures_equal,
                   tensor_leaves, unmaterialized, without_values)
from .params import compiled_reads_changed, param_as_it_ran

# Calls that differentiate through the forward's own graph (a gradient penalty, a physics-informed loss).
_GRAPH_FUNCS = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward)
# Forward-mode AD's calls (torch.autograd.forward_ad.make_dual, unpack_dual): they name a dual level, which
# ended with the forward.
_DUAL_FUNCS = (torch._make_dual, torch._unpack_dual)
# Calls that change a tensor's size in place, leaving what they add uninitialized.
_RESIZES = frozenset(["resize_", "resize_as_"])

PASSED, FAILED, NOTHING_TO_REPLAY = "passed", "failed", "nothing to replay"
RANDOM = "random: consumed the RNG (replay would draw other numbers)"
COMPILED_WROTE = ("its compiled code wrote its module's buffers (running statistics?) as it ran again: it read them as "
                  "the forward left them, not as they were when it ran")
NONDETERMINISTIC = ("nondeterministic: run twice on the same arguments, the call gave different values (its kernel "
                    "varies from run to run), so no replay can match what it made")
NOT_RUN_AGAIN = ("; not run a third time to see whether the forward itself varies from run to run: it issues "
                 "collectives, which an extra forward on this rank alone would leave waiting on the other ranks")
TENSOR_SLICE = ("a slice bound is a tensor (x[s:e] with s or e a tensor): the record holds the slice as a value, "
                "not the bound's producer or its value at the call, which a later write may have changed")


@dataclass
class ValidationResult:
    """What validation checked and found.

    ``status`` is ``"passed"``, ``"failed"`` or ``"nothing to replay"`` (nothing was checked: no saved
    activations, a cleaned-up trace, or no op that could run again); ``passed`` and ``bool(result)`` are
    True only for ``"passed"``.
    """

    outputs_match: bool | None = None
    replayed: int = 0
    mismatched: list = field(default_factory=list)  # (label, reason)
    not_replayed: list = field(default_factory=list)  # (label, reason)
    outputs_differ: str = ""  # where the traced and untraced outputs differ, or why they were not compared
    nothing_reason: str = ""  # why nothing could be replayed, when nothing was

    @property
    def status(self) -> str:
        if self.outputs_match is False or self.mismatched:
            return FAILED
        if self.replayed == 0 and self.outputs_match is None:
            return NOTHING_TO_REPLAY
        return PASSED

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        status = self.status
        if status == NOTHING_TO_REPLAY:
            lines = [f"validation: NOTHING TO REPLAY, nothing was checked: "
                     f"{self.nothing_reason or 'no op could be replayed'}"]
        else:
            verdict = "passed" if status == PASSED else "FAILED"
            lines = [f"validation {verdict}: {counted(self.replayed, 'op')} replayed exactly"]
        if self.outputs_match is not None:
            lines.append(f"  outputs equal an untraced run: {self.outputs_match}"
                         + (f" ({self.outputs_differ})" if self.outputs_differ else ""))
        elif self.outputs_differ:
            lines.append(f"  outputs {self.outputs_differ}")
        for label, reason in self.mismatched:
            lines.append(f"  MISMATCH {label}: {reason}")
        if self.not_replayed:
            lines.append(f"  {counted(len(self.not_replayed), 'op')} not replayed:")
            for label, reason in self.not_replayed[:20]:
                lines.append(f"    {label}: {reason}")
        return "\n".join(lines)


def _reference_output(model, args: tuple, kwargs: dict, root=None) -> tuple:
    """The untraced output, from a copy of the model (so its counters, caches and in-place updates
    stay out of the user's model); when the model cannot be copied, from the model itself with
    everything a forward can change restored afterwards: the modules of ``root=``, or, for a callable that
    names no model, each module the run calls (met as it runs).  Returns it with whether it was a copy."""
    args, kwargs = clone_call(args, kwargs)
    bound = module_run_by(model)
    if bound is not None and (root is None or root is bound) and not _holds_fake_tensors(bound):
        try:  # a module, or a bound method of one, or a partial of either (copied with it); not a lambda
            reference = copy.deepcopy(model)
        except Exception:  # noqa: BLE001 - locks, open files, C++ handles: fall back to restoring
            reference = None
        if reference is not None and copied_whole(bound, module_run_by(reference)):
            return reference(*args, **kwargs), True
    refuse_unmaterialized(root if root is not None else bound, "tl.validate")  # torch could not copy it
    state, watching = model_state(model, root)
    try:
        with watching:
            return model(*args, **kwargs), False
    finally:
        state.restore()


def refuse_unmaterialized(module, tool: str) -> None:
    """Refuse to run ``module`` for ``tool`` and put it back afterwards while it has lazy modules not yet
    materialized: their first forward gives them weights and changes their class, in place, for good."""
    lazy = unmaterialized(module)
    if lazy:
        raise ValueError(f"{tool} runs the model and puts it back afterwards, which its lazy modules prevent: they "
                         f"are not yet materialized ({first_few(lazy)}), and their first forward changes them for "
                         f"good; run one forward first (model(x)), then call {tool} again")


def _holds_fake_tensors(module) -> bool:
    """Whether ``module`` holds ``FakeTensor`` parameters or buffers: a deep copy of them belongs to a new
    ``FakeTensorMode``, which refuses the caller's fake inputs, so the reference runs on the model itself."""
    tensors = (*module.parameters(), *module.buffers())
    return any(without_values(t) and not t.is_meta for t in tensors)


def _check_trace_options(known, options: dict) -> None:
    """``validate``'s extra keywords are ``tl.trace``'s options: a misspelt one is named as validate's, with the
    option meant, not left to ``trace()`` to call an unexpected keyword of its own.  ``known``: those options."""
    for name in options:
        if name == "save":
            raise TypeError("tl.validate() saves every activation to replay it: it takes no save= (trace with "
                            "save= and call log.validate() to replay what a selection kept)")
        if name in ("intervene", "stop_after") and options[name] not in (None, {}):
            # the traced run is then another run than the untraced one it is compared with: always "FAILED"
            raise ValueError(f"tl.validate() compares the trace with an untraced run of the model, which {name}= "
                             "would not change, so it would fail however faithful the trace: trace with "
                             f"tl.trace(..., {name}=...) and call log.validate() to replay each op of that run")
        if name not in known:
            raise TypeError(f"tl.validate() got an unexpected keyword argument {name!r}: besides progress=, it takes "
                            f"tl.trace's options ({', '.join(n for n in known if n not in ('save', 'progress'))})"
                            f"{closest_hint(name, known)}{forward_keyword_hint('tl.validate', name)}")


# ----- entry points ------------------------------------------------------------------------------------
def validate(model, args=(), kwargs=None, progress=None, **trace_kwargs) -> ValidationResult:
    """Trace ``model`` and check the trace against an untraced run and against replay of every op.

    ``args`` follows ``tl.trace``'s rule: a tuple is the positional arguments, any other value the one
    positional argument.  The untraced run uses a copy of the model (a callable such as a lambda runs on the
    model itself, which is then put back: ``_reference_output``); the model and the global random number
    generators (``capture.restore``) end exactly as after one untraced forward.  ``progress``: bars for tracing
    and replay once either takes about a second (None: on an interactive terminal or notebook only; True:
    anywhere; False: never).
    """
    from ..capture.inputs import note_how_arguments_were_passed
    from ..capture.session import OPTIONS, trace
    from ..capture.wrappers import unwrap

    model = unwrap(model)
    check_model(model, "tl.validate")
    _check_trace_options(OPTIONS, trace_kwargs)
    call_args = as_args(args)
    kwargs = dict(as_kwargs(kwargs, "tl.validate"))
    before, grad = RngState(), torch.is_grad_enabled()
    try:
        expected, on_a_copy = _reference_output(model, call_args, kwargs, trace_kwargs.get("root"))
        after = RngState()
    except BaseException as exc:  # the untraced run fails first: say how the arguments were passed, as a trace does
        restore_grad_mode(grad)  # (an interrupt inside torch's Tensor.__deepcopy__ leaves gradients off)
        note_how_arguments_were_passed(exc, call_args, model)
        raise
    finally:
        before.restore()  # the traced forward draws what the untraced one drew
    try:
        log = trace(model, call_args, kwargs, save="all", progress=progress, **trace_kwargs)
        result = validate_trace(log, progress=progress)
    finally:
        after.restore()
    try:
        result.outputs_match, result.outputs_differ = _compare_outputs(log, expected)
    except Exception as exc:  # noqa: BLE001 - a tensor subclass without an equality kernel (MaskedTensor)
        result.outputs_differ = f"not compared: torch.equal raised {type(exc).__name__} on the outputs"
    # (A copy of the model has its own copy of a generator it holds: both runs then drew the same numbers.)
    drawing = _op_drawing_from_own_generator(log) if result.outputs_match is False and not on_a_copy else None
    if drawing is not None:
        result.outputs_match = None
        result.outputs_differ = (
            f"not compared: {drawing} draws from a torch.Generator passed as generator=, which validation cannot "
            "put back between its untraced and traced runs (it knows only the global generators), so the two "
            "drew other numbers; that generator has now advanced by both runs. Seed it again before each run and "
            "compare the outputs yourself")
    if result.outputs_match is False and drawing is None and _issues_collectives(log):
        result.outputs_differ += NOT_RUN_AGAIN
    elif result.outputs_match is False and drawing is None and _untraced_runs_differ(
            model, (call_args, kwargs, trace_kwargs.get("root")), (before, after), log, expected):
        result.outputs_match = None
        result.outputs_differ = (
            "not compared: two untraced runs from the same generator states gave different outputs, "
            f"{_why_runs_differ(result)} and no traced run could match them; replay checks each op on its own")
    if result.outputs_match and _without_any_values(log.output):  # meta or fake: only shapes agreed
        result.outputs_match = None
        result.outputs_differ = "not compared by value: meta or fake tensors hold none (their shapes and dtypes agree)"
    return result


def _compare_outputs(log, expected, output=None) -> tuple:
    """``structures_equal`` of the traced and untraced outputs (or of ``output``, another untraced run's, in the
    traced output's structure) that are not uninitialized memory (``torch.empty`` and kin, or a view of one:
    ``uninitialized_ops``), whose bits each run's allocator chose.  Those are left out and named whether or not
    their bits happened to agree, so that the result does not depend on the allocator."""
    output = log.output if output is None else output
    # Not through in-place writes: a fill_ or copy_ makes the whole tensor defined, and it is compared.
    undefined_ops = uninitialized_ops(log, through_writes=False)
    returned = {o.io_path for o in log.outputs if o.index in undefined_ops}
    leaves = tensor_leaves(log.output)
    undefined = {path: None for path, _ in leaves if path_text("output", path) in returned}
    if not undefined:
        return structures_equal(output, expected)
    equal, why = structures_equal(fill(output, undefined), fill(expected, undefined))
    left_out = f"not compared: {', '.join(path_text('output', p) for p in undefined)}, uninitialized memory " \
               "(torch.empty and kin, or a view of it), whose contents are not defined"
    return (None if len(undefined) == len(leaves) else True, left_out) if equal else (equal, why)


def _untraced_runs_differ(model, call, states, log, expected) -> bool:
    """Whether a second untraced run of ``call`` (``(args, kwargs, root)``), from the generator states the first
    began with, gives another output than the first (``expected``): the forward then draws from a source
    ``RngState`` cannot put back (Reformer reseeds with ``torch.seed()`` in training mode).  Run only when the
    traced and untraced outputs differed; the generators end as after the first run (``states``: before, after)."""
    before, after = states
    before.restore()
    try:
        again, _ = _reference_output(model, *call)
    finally:
        after.restore()
    try:
        return _compare_outputs(log, expected, output=again)[0] is False
    except Exception:  # noqa: BLE001 - compared as the traced output was, which raised nothing
        return False


def _why_runs_differ(result) -> str:
    """Why two untraced runs from the same generator states differed: an op whose kernel replay found varying from
    run to run (``NONDETERMINISTIC``), or else a source of randomness validation cannot put back."""
    varying = [label for label, why in result.not_replayed if why == NONDETERMINISTIC]
    if varying:
        return (f"since {first_few(varying)} gave other values run twice on the same arguments (a kernel that varies "
                "from run to run: listed below),")
    return ("so the forward draws from a source validation cannot put back (torch.seed(), which reseeds from the "
            "operating system, or the clock)")


def _issues_collectives(log) -> bool:
    """Whether the forward issued a collective (``dist.all_reduce`` in forward, FSDP2's all-gathers): one more
    forward on this rank alone would wait at it for ranks that run no such forward (until the group's timeout)."""
    return any(is_collective(call.func) for call in log.calls)


def _op_drawing_from_own_generator(log):
    """The label of the first op called with a ``torch.Generator`` other than a global one (``generator=``),
    if any: ``RngState`` puts back only the global ones."""
    for call in log.calls:
        if call.kwargs and any(isinstance(v, torch.Generator) and not is_global_generator(v)
                               for v in call.kwargs.values()):
            return log.labels[call.first_record]
    return None


def _without_any_values(output) -> bool:
    """Whether every tensor of ``output`` is a meta or fake one (and there is one): nothing to compare values of."""
    leaves = [t for _, t in tensor_leaves(output)]
    return bool(leaves) and all(without_values(t) for t in leaves)


def validate_trace(log, progress=None) -> ValidationResult:
    """Replay each op of ``log`` from its saved parents; report mismatches and what could not run."""
    from ..progress import bar

    result = ValidationResult()
    if log.is_cleaned_up:
        result.nothing_reason = "the trace was cleaned up (cleanup() released its activations)"
        return result
    log.drop_written()  # replayed against what each op made, not a value written since
    if not log.saved_activations:
        result.nothing_reason = "its activations were made inside a torch.func transform, unreadable outside it; " \
            "validate outside the transform" if all_made_in_transform(log) else \
            "the trace saved no activations; trace with save='all' to validate"
        return result
    rng, settings = RngState(), ThreadSettings()
    began = began_with(log)
    shown = bar(progress, f"validating {log.model_name}", total=len(log), unit=" ops")
    try:
        for op in log.ops:
            shown.update()
            if op.kind != "op" or not is_first_output(log, op.index):
                continue  # a call is replayed once, at its first output, and all its outputs are compared
            problem = _replay_problem(log, op, rng, began)
            if problem is not None and problem[0] == "mismatch":
                problem = _under_another_setting(log, op, rng, began, problem)
            if problem is None:
                result.replayed += 1
            elif problem[0] == "mismatch":
                result.mismatched.append((op.label, problem[1]))
            else:
                result.not_replayed.append((op.label, problem[1]))
    finally:
        rng.restore()
        settings.restore()
        shown.close()
    if result.replayed == 0:
        result.nothing_reason = "no op could be replayed (see the reasons listed)"
    return result


# ----- one op ------------------------------------------------------------------------------------------
def _skip(reason: str) -> tuple:
    return ("not replayed", reason)


def _mismatch(reason: str) -> tuple:
    return ("mismatch", reason)


def _under_another_setting(log, op, rng: RngState, began: dict, problem: tuple):
    """None when ``op``, which mismatched under the settings its forward began with, replays to its saved
    output under another one it may have run under (a forward that changes one itself); else ``problem``."""
    for change in other_settings(log, op, began):
        if _replay_problem(log, op, rng, {**began, **change}) is None:
            return None
    return problem


def _grew_uninitialized(log, op) -> bool:
    """Whether ``op`` is a ``resize_`` (or ``resize_as_``) that made its tensor larger: the elements it added
    hold whatever the memory held (QAT's FakeQuantize resizes its scale so on its first forward)."""
    if op.func_name not in _RESIZES:
        return False
    resized = op.parent_arg_positions.get(0)
    if resized is None:
        return True
    parent = log[resized].index
    if (log.call_indices[op.index], parent) in log.alias_reads:
        # It resized the base of a view written in place, which the writer's output (the view) is not: its size
        # says nothing of the base's, and the read is not replayed for that reason.
        return False
    return log[resized].numel < op.numel


def _replay_problem(log, op, rng: RngState, setting: dict):
    """None when ``op`` replays to its saved output; else ``(kind, reason)``.  ``setting``: the global settings
    to replay under (``as_traced``; one that is None or absent stays as it is now)."""
    call_position = log.call_indices[op.index]
    call = log.calls[call_position]
    func = call.func
    problem = _unreplayable(log, op, call)
    if problem is not None:
        return problem
    replay = log._replay
    context = replay.contexts.get(call_position, replay.context) if replay is not None else None
    arguments, why = _replay_arguments(log, replay, call, call_position)
    if why is not None:
        return _skip(why)
    args, kwargs = arguments
    kwargs = on_device(func, kwargs, op.device)
    generators = _private_generators(kwargs)
    compiled = module_behind(func)  # its compiled code reads (and may write) that module's own state
    if compiled is not None:
        why = compiled_reads_changed(log, replay, compiled, call_position)
        if why is not None:
            return _skip(why)
        kept = KeptForReplay(compiled)
    try:
        with as_traced(log, context, setting):
            out = func(*args, **kwargs)
    except Exception as exc:  # replay cannot always rebuild a call (e.g. objects with hidden state)
        return _skip(f"replay raised {type(exc).__name__}: {exc}")
    finally:
        wrote = compiled is not None and kept.restore()
    if rng.moved() or any(g.get_state().ne(state).any() for g, state in generators):
        rng.restore()
        return _skip(RANDOM)
    problem = _compare_replayed(log, op, call, func, args, kwargs, out)
    if wrote and problem is not None and problem[0] == "mismatch":
        return _skip(COMPILED_WROTE)
    if problem is not None and problem[0] == "mismatch" and compiled is None and not call.wrote_arguments \
            and _varies(func, args, kwargs, out, as_traced(log, context, setting)):
        return _skip(NONDETERMINISTIC)
    return problem


def _unreplayable(log, op, call):
    """``_skip(reason)`` (or a mismatch) when ``op`` cannot be replayed at all, before any argument is built: its
    call's record is gone, its values are none to compare, or running it again could not give its output."""
    func, skeleton, kw_skeleton = call.func, call.args, call.kwargs
    if skeleton is None and kw_skeleton is None:
        return _skip("the trace was cleaned up")
    if op.device.type == "meta":
        return _skip("meta tensors hold no values to compare")
    if slice_with_tensor(skeleton) or slice_with_tensor(kw_skeleton):
        return _skip(TENSOR_SLICE)
    if op.has_activation and without_values(log.saved_activations[op.index]):
        return _skip("fake tensors (FakeTensorMode) hold no values to compare")
    if makes_uninitialized(op):
        return _skip("uninitialized memory (torch.empty and kin): its contents are not defined")
    if _grew_uninitialized(log, op):
        return _skip("uninitialized memory: resize_ grew the tensor, and the contents of its new elements are "
                     "not defined")
    if is_collective(func):
        return _skip("a collective: replayed on one rank alone it would block on, or pair with, other ranks' calls")
    if func in _DUAL_FUNCS:
        return _skip("forward-mode AD (torch.autograd.forward_ad): the dual level it ran in ended with the forward, "
                     "so replay can neither make nor unpack its dual tensors")
    if func in _GRAPH_FUNCS:
        return _skip("it differentiates through the forward's autograd graph, which replayed copies of its "
                     "arguments are not part of")
    if not op.has_activation:
        dropped = op.dropped_reason
        if dropped == WRITTEN_AFTER_TRACE:  # the trace no longer holds what the op made
            return _mismatch(f"its saved output was {dropped}")
        if is_param_written(dropped):  # a parameter updated since, as for the ops reading it: not a mismatch
            return _skip(f"parameter changed since the trace: {dropped}")
        return _skip(f"its saved output was dropped: {dropped}" if dropped else "its own output was not saved")
    return None


def _replay_arguments(log, replay, call, call_position: int) -> tuple:
    """``((args, kwargs), None)``: the call's arguments rebuilt from private copies of its parents' saved values
    and its parameters as they were when it ran; or ``(None, why)`` when one cannot be had."""
    positional, keyword = {}, {}
    copies: dict = {}  # one copy per parent: a tensor passed twice stays one tensor (``query is key``)
    for position, parent in call.parents:
        if parent < 0:
            return None, "a tensor argument came from outside the trace"
        if parent not in log.saved_activations:
            return None, _parent_unsaved(log, parent)
        if (call_position, parent) in log.alias_reads:
            return None, (f"it read {log.labels[parent]}'s storage after a write through a view (or while writing "
                          "it through another argument, or a running statistic or observer buffer it wrote in its "
                          "kernel, or through a tensor Tensor.set_ put on part of that storage), a value that no op "
                          "output holds")
        if parent not in copies:
            copies[parent] = _private_copy(log.saved_activations[parent], log.op_meta[parent].requires_grad)
        _put(positional, keyword, position, copies[parent])
    for position, param in call.params:
        value, why = param_as_it_ran(log, replay, param, call_position)
        if why is not None:
            return None, why
        _put(positional, keyword, position, value)
    return (fill(tuple(call.args), positional), fill(dict(call.kwargs), keyword)), None


def _varies(func, args, kwargs, out, context) -> bool:
    """Whether the call, run once more on the same arguments, gives other values than its replay did (a kernel
    that varies from run to run: ``torch.linalg.lstsq`` on the CPU): its mismatch then says nothing of the trace.
    Only for a call that wrote none of its arguments, which the second run reads as the first did."""
    try:
        with context:
            return not outputs_equal(func(*args, **kwargs), out)
    except Exception:  # noqa: BLE001 - a second run that fails says nothing either way
        return False


def _compare_replayed(log, op, call, func, args, kwargs, out):
    """None when what replay returned (``out``) equals what ``op``'s call made, else ``(kind, reason)``."""
    if out is None:
        out = _written_by(func, args, kwargs)
    if not isinstance(out, torch.Tensor):  # a tuple, a list; the dict or dataclass of a compiled submodule
        count = call.num_outputs
        wanted = [_as_made(log, i) for i in range(op.index, op.index + count)]
        got = [t for _, t in tensor_leaves(out)]
        if len(got) != len(wanted):
            return _mismatch("a different number of outputs on replay")
        for g, want in zip(got, wanted):
            if want is not None:
                problem = _compared(g, want, "a replayed output differs from the saved one")
                if problem is not None:
                    return problem
        return None
    if op.index in log._interventions:  # its saved value is the action's: compare with the value it made
        made = _as_made(log, op.index)
        if made is None:
            return _skip("an intervention replaced its output, and the value it made was not kept (op.original)")
        return _compared(out, made, "the replayed output differs from the value it made (op.original)")
    return _compared(out, log.saved_activations[op.index], "the replayed output differs from the saved one")


def _written_by(func, args, kwargs):
    """What a call that returned None produced: its out= tensors (``split_with_sizes_copy``), the arguments
    its schema says it writes (a custom op with ``mutates_args``), or its receiver (``__setitem__``)."""
    if "out" in kwargs:
        return kwargs["out"]
    verdict = write_verdict(func)
    if type(verdict) is tuple:
        written = schema_written(verdict, args, kwargs)
        return written[0] if len(written) == 1 else written
    return args[0]


def _as_made(log, index: int):
    """The value op ``index`` made: its saved output or, where an intervention replaced it, the value it had
    before (``op.original``; None when not kept).  Later ops are replayed from the values they read."""
    if index in log._interventions:
        return log._originals.get(index)
    return log.saved_activations.get(index)


def _compared(replayed, saved, differs: str):
    """None when the replayed tensor equals the saved one, else the problem: ``differs``, or, when torch cannot
    compare them (a tensor subclass without an equality kernel, such as ``MaskedTensor``), not replayed."""
    try:
        same = outputs_equal(replayed, saved)
    except Exception as exc:  # noqa: BLE001 - whatever the subclass raises: the comparison says nothing
        return _skip(f"its {type(saved).__name__} output cannot be compared (torch.equal raised "
                     f"{type(exc).__name__})")
    return None if same else _mismatch(differs)


def _parent_unsaved(log, parent: int) -> str:
    """Why a parent's value is missing: never saved (``save=``), or saved and then dropped, with the reason (a
    parent changed behind capture's back, or since the trace, was saved: "not saved" would point at ``save=``)."""
    dropped = log.dropped_activations.get(parent)
    return f"parent {log.labels[parent]} was " + (f"saved, then dropped: {dropped}" if dropped else "not saved")


def _put(positional: dict, keyword: dict, position, value) -> None:
    """Place a tensor for ``tree.fill``: a position is an int, a keyword, or ``(int or keyword, *path)``."""
    path = position if isinstance(position, tuple) else (position,)
    (keyword if isinstance(path[0], str) else positional)[path] = value


def _private_copy(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A copy replay may write, with ``t``'s strides and, as the op saw it, ``requires_grad`` (made by a
    differentiable copy, so an in-place op accepts it as it accepted the op output it stands for)."""
    if requires_grad and (t.is_floating_point() or t.is_complex()):
        with torch.enable_grad():
            return copy_with_layout(t.detach().requires_grad_(True))
    return copy_with_layout(t)


def _private_generators(kwargs: dict) -> list:
    """Swap each ``torch.Generator`` argument for a copy (replay must not advance the user's); returns
    ``(copy, state before)`` pairs to see whether replay drew from them."""
    swapped = []

    def private(g):
        twin = generator_twin(g)
        swapped.append((twin, twin.get_state()))
        return twin

    for key, value in list(kwargs.items()):  # torch takes generators by keyword only
        if isinstance(value, torch.Generator):
            kwargs[key] = private(value)
    return swapped
