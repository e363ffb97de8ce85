"""``tl.trace``: set capture up, run the forward once, tear everything down, finalize.

Nothing outlives the call: the capture mode is popped, ``_call_impl``'s relay, the shims, compiled routing and
any module hooks removed by one context manager (``teardown.Capture``), whether the model returns or raises."""

from __future__ import annotations

import gc
import inspect
import os
import threading
from time import perf_counter_ns

import torch

from ..checks import asks_for_grads, check_flag, check_model, check_number
from ..errors import NestedTraceError, add_note, first_few, unknown_option_hint, warn_user
from ..progress import QUIET, bar, shows_bar
from ..record.columns import MODULE_CALL_MODULE
from ..record.finalize import finalize
from ..record.layouts import param_versions
from ..record.model_index import PACKED_WEIGHTS_CAVEAT, index_of, traced_address
from ..record.replay_context import global_settings
from ..record.modules import is_unregistered
from ..record.trace import Trace
from ..copies import clone_call
from ..tree import as_args, as_kwargs
from .caught import caught_calls_caveat, forget_caught_exceptions
from .collectives import drop_flags_before_arrival, process_rank
from .compiled import (CompiledSubmodules, DynamoCompiles, Suspension, check_compiled_option,
                       compiled_in_place, optimized_module_type)
from .compiled_functions import CompiledFunctions, compiled_function_caveat
from .fastpath import FastPathShim
from .forks import leave_copied_trace, refuse_forked_trace
from .fused_writes import (link_running_stats_readers, norm_calls, stat_writes, stats_left_nonfinite,
                           stats_writers_untracked)
from .function_outputs import function_outputs
from .grads import attach_grads, grad_capture
from .inputs import add_inputs, note_how_arguments_were_passed
from .mode import CaptureMode, redispatch_function
from .modules import ModuleCallTracker, other_threads_caveat
from .packing import PackLog, SavedTensorHooks, refusal_noted
from .returned import refuse_unrecordable_output
from .restore import module_run_by
from .saving import SavePolicy, SelectedModuleOutputs
from .source import FrameClassifier
from .state import INFERENCE_CAVEAT, CaptureState, StopForward
from .teardown import (Capture, ModeOnStack, leftovers, refuse_lifted_mode, release_failed, release_refused,
                       restore_grad_mode, restore_torch_function_state, torch_function_state)
from .wrappers import (COMPILED_ROOT_CAVEAT, PARALLEL, PARALLEL_CLASSES, is_compile_wrapper, unwrap,
                       warn_unreduced_grads)

_local = threading.local()  # .active: this thread is tracing
_collector_was_on: dict = {}  # tracing thread id -> whether the collector ran when its trace began
if hasattr(os, "register_at_fork"):  # a platform without os.fork (Windows) copies no trace into a child
    os.register_at_fork(after_in_child=lambda: leave_copied_trace(_local, _collector_was_on))  # capture/forks.py
# save="all" and save="none" name nothing of a model, and a trace never changes them: one policy each.
_PLAIN_POLICIES = {"all": SavePolicy("all", None), "none": SavePolicy("none", None)}


def _trace(model, args=(), kwargs=None, save="all", save_device=None, record_finite: bool = False,
          max_saved_bytes: int | None = None, name: str | None = None, deep: bool = False, root=None,
          markers=None, progress=None, intervene=None, reference=None, stop_after=None, grads=False,
          saved_for_backward: bool = False, compiled: str = "run") -> Trace:
    """One trace, with the collector already paused and the thread marked as tracing by ``trace``.
    ``trace`` passes every option by position (a keyword costs about 0.1 us per hop); others name them.

    The steps: check the call, prepare the capture state, run the forward inside every capture part,
    then finalize the record and add what the run leaves beside it (caveats, interventions, gradients)."""
    given_root = root
    model, root, compiled_root = _checked_call(model, root, kwargs, compiled, deep, grads, stop_after)
    if deep is not False or name is not None or reference is not None or record_finite is not False \
            or saved_for_backward is not False:  # identity checks alone in the common call
        _check_options(deep, name, reference, intervene, stop_after, record_finite, saved_for_backward)
    try:
        kwargs = dict(**kwargs) if kwargs else {}  # as a call unpacks them: a key that is no string is refused
    except TypeError:
        as_kwargs(kwargs)  # names the key, before the forward (else Python's refusal reads as the model's)
        raise
    args = args if type(args) is tuple else as_args(args)
    index = index_of(root)  # the one walk over the model's modules, parameters and buffers, cached per model
    policy = _PLAIN_POLICIES.get(save) if type(save) is str else None
    if policy is None:
        policy = SavePolicy(save, root, index)
    if save_device is not None:
        save_device = _checked_save_device(save_device)
    if max_saved_bytes is not None:  # "1GB" would fail at the first saved tensor, -1 save nothing, NaN not limit
        check_number(max_saved_bytes, "max_saved_bytes", "give a number of bytes (2**30 for 1 GiB), or None for no "
                     "limit", at_least=0)
    started = perf_counter_ns()
    state = CaptureState(save_mode=policy.mode, save_device=save_device, record_finite=record_finite,
                         buffers=index.buffers, max_saved_bytes=max_saved_bytes, params=index.params)
    state.param_versions_at_start = param_versions(index.param_objects[0]) if index.params else None
    if policy.mode == 2:
        state.selector = policy.capture_selector(state, modules=False)  # (their calls save their outputs)
        # A selection picks inputs or buffers only when it names them (a module returning one saves it): not held.
        state.save_sources = bool({"input", "buffer"} & policy.types)
    if markers is not None:  # profiler ranges per op and module call (torchlens.report.kernel_profile)
        state.markers = markers
    runtime = None if intervene is None and stop_after is None else \
        _intervention_runtime(model, root, args, kwargs, intervene, stop_after, reference, deep, index, policy,
                              compiled)
    if runtime is not None and runtime.watches_calls:
        state.intervention, state.site_calls = runtime, runtime.site_calls
    state.grads = grad_capture(grads, root, state) if grads is not False else None
    packing = PackLog(state.calls) if saved_for_backward else None
    if runtime is not None:
        runtime.packing = packing
    input_aliases = add_inputs(state, model, args, kwargs)
    began = global_settings()  # for replay: the global settings that change an op's bits
    mode = CaptureMode(state, _FRAMES, deep=deep)
    shown = bar(progress, f"tracing {name or _display_name(model, root)}", unit=" module calls") \
        if shows_bar(progress) else QUIET
    parts, submodules = _capture_parts(state, mode, model, root, index, policy, runtime, compiled, shown, packing)
    capture = Capture(parts)
    output = _run_captured(capture, parts, mode, state, runtime, packing, model, root, args, kwargs, shown)
    if capture.forked_into is not None:  # set in a child forked inside the forward, never in the parent
        refuse_forked_trace(capture)
    if state.mode_lifted:
        release_failed(state, runtime)
        refuse_lifted_mode()
    forward_done = perf_counter_ns()
    if type(output) is not torch.Tensor and output is not None:  # else nothing in it can hide a tensor
        refuse_unrecordable_output(output, model, shown)

    mutated = state.check_saved_versions()
    if state.finite_flags and process_rank()[0] is not None:  # only under torch.distributed can a collective run
        drop_flags_before_arrival(state)
    norms = norm_calls(state.calls)
    stats_written = stats_untracked = None
    if norms:
        writes = stat_writes(state.calls, norms)
        stats_written = stats_left_nonfinite(writes, state.producers, index.buffers.values())
        stats_untracked = stats_writers_untracked(writes)
        if state.saved:  # before the links below rename what each norm call read
            state.guard_running_stats(norms, index.batch_counters())
        link_running_stats_readers(state.calls, norms, state.alias_reads)
    model_name = name or _display_name(model, root)
    timings = {"forward": (forward_done - started) / 1e9}
    if shown is not QUIET:
        shown.set_description(f"finalizing {model_name}")
    try:
        result = finalize(state, model, output, model_name, timings, index)
    finally:
        if shown is not QUIET:
            shown.close()
    if stats_written:  # nonfinite_origin: statistics a kernel left holding NaN/Inf, in no saved value
        result._stats_left_nonfinite = stats_written
    if stats_untracked:  # (and those it could not examine)
        result._stats_untracked = tuple(stats_untracked)
    result._autocast = state.context[1]  # the autocast state around the forward, for replay
    result._deep = deep  # a reference= trace numbers ops as deep= said (intervene/path.py)
    if input_aliases:
        result._input_aliases = input_aliases
    result._settings = (began, global_settings())  # a forward may change them: replay tries those it ended with
    try:
        if given_root is not None and root is not model and state.module_calls:
            _refuse_root_never_run(result, root)
        _complete(result, state, index, policy, runtime, packing, submodules, root, model_name)
    except BaseException:  # a refusal after the forward (a save= entry or a site that matched nothing)
        release_refused(result, state, runtime)
        raise
    if compiled_root:
        warn_user(COMPILED_ROOT_CAVEAT)
        result.caveats = result.caveats + (COMPILED_ROOT_CAVEAT,)
    timings["total"] = (perf_counter_ns() - started) / 1e9
    mutated = [*mutated, *policy.written_unseen]  # (those a selected call returned were not saved by then)
    if mutated:
        warn_mutated([result.labels[i] for i in sorted(mutated)])
    if result.budget_exhausted_at is not None:  # the first op a selection asked for that was left unsaved
        warn_user(f"max_saved_bytes reached: activations from {result.labels[result.budget_exhausted_at]} "
                  f"on were not saved{policy.held_note()}")
    return result


def _checked_call(model, root, kwargs, compiled, deep, grads, stop_after) -> tuple:
    """The module to run, the root that names modules, and whether ``model`` was a ``torch.compile`` wrapper,
    once the call's arguments are known to make a trace; a bad argument raises here, before anything is set up."""
    if root is None and isinstance(model, torch.nn.Module) and type(model._modules) is dict \
            and "_orig_mod" not in model._modules and "_torchdynamo_orig_callable" not in model.__dict__ \
            and PARALLEL_CLASSES.isdisjoint(type(model).__mro__) and (kwargs is None or type(kwargs) is dict) \
            and compiled == "run" and deep is False and stop_after is None:
        # The common call, settled by C-level checks: an eager module that wraps nothing (no TorchScript
        # mapping, no compiled or parallel wrapper), default options.  Every other call takes the checks below.
        return model, model, False
    compiled_root = is_compile_wrapper(model)
    if asks_for_grads(grads) and isinstance(model, PARALLEL[1]):
        warn_unreduced_grads(model)
    model = unwrap(model)
    check_model(model, "tl.trace")
    root = _root_of(model, root)
    if kwargs is not None and not isinstance(kwargs, dict):
        as_kwargs(kwargs)  # raises for anything but a mapping, saying how to pass several positional arguments
    if compiled != "run":
        check_compiled_option(compiled)
    if deep is True and redispatch_function is None:  # any other value is refused by _check_options
        raise RuntimeError(f"deep=True needs torch.overrides.redispatch_function, which torch {torch.__version__} "
                           "lacks; upgrade torch or trace with deep=False")
    if stop_after is not None and asks_for_grads(grads):
        raise ValueError(f"tl.trace(..., grads=) keeps gradients from a backward through the output, but "
                         f"stop_after={stop_after!r} stops the forward before it makes one (and the saved "
                         "activations are detached); trace the whole forward (no stop_after) for gradients")
    return model, root, compiled_root


def _check_options(deep, name, reference, intervene, stop_after, record_finite, saved_for_backward) -> None:
    """Options that would otherwise be taken as something else, or quietly ignored: ``deep="yes"`` read as true (and
    ``record_finite="no"`` too), ``name=3`` as a display name, ``reference=`` with nothing to resolve against it."""
    check_flag(record_finite, "record_finite", "give True to record a (has_nan, has_inf) flag per op, False not to")
    check_flag(saved_for_backward, "saved_for_backward", "give True to record what autograd keeps for backward, "
               "False not to")
    check_flag(deep, "deep", "give True to record the torch calls inside torch functions written in Python, "
               "False for one op each")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name= takes a string (the trace's display name), got {type(name).__name__} {name!r}")
    if reference is not None and (intervene is None or (type(intervene) is dict and not intervene)) \
            and stop_after is None:
        raise ValueError("reference= is the trace the label sites of intervene= and stop_after= are resolved "
                         "against, and this call gives neither, so it would be ignored: drop reference=, or give "
                         "intervene={site: action} or stop_after=site with it")


def _refuse_root_never_run(result, root) -> None:
    """``root=`` names the modules a callable runs by their addresses in it.  A callable that ran modules, none of
    them ``root`` or inside it, and read none of its parameters, was given another module than the one it runs:
    every module would read ``<unregistered ...>`` under a trace titled with ``root``'s class."""
    if not all(is_unregistered(m.address) for m in result.modules):
        return
    if any(not is_unregistered(address) for addresses in result.param_addresses.values() for address in addresses):
        return
    ran = first_few(dict.fromkeys(m.class_name for m in result.modules))
    raise ValueError(f"root= is the module the callable runs, but the callable ran none of root={type(root).__name__} "
                     f"and none of its submodules (it ran {ran}, which are not inside it), so no module of the trace "
                     "could be named by its address; pass root= the model the callable runs")


def _checked_save_device(save_device) -> torch.device:
    """``save_device`` as a device this process can hold tensors on, refused before the forward: otherwise the
    first saved tensor would fail mid-forward (``Torch not compiled with CUDA enabled``)."""
    try:
        device = torch.device(save_device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, TypeError) as exc:
        raise ValueError(f"save_device={save_device!r}: saved tensors cannot be moved there "
                         f"({str(exc).splitlines()[0]}); give a device this machine has, such as 'cpu'") from None
    if device.type == "meta":  # moving there keeps shapes and drops every value: a trace that looks saved
        raise ValueError(f"save_device={save_device!r}: a meta tensor holds no values, so every saved activation "
                         "would have a shape and no values; give a device this machine has, such as 'cpu', or "
                         "save='none' to record shapes and dtypes without saving activations")
    return device


def _capture_parts(state, mode, model, root, index, policy, runtime, compiled, shown, packing) -> tuple:
    """The context managers a forward runs inside, in the order they are entered, and the compiled-submodule
    part among them (None when the model has no compiled submodules)."""
    shim, installed = FastPathShim(mode), ModeOnStack(mode)
    # The index keeps the model's compiled submodules (cached with it): no walk of the model per trace.
    optimized = optimized_module_type()
    compiled_modules = index.of_type(optimized) if optimized is not None else ()
    # Modules compiled in place (module.compile()) can exist only once Dynamo is imported, as can wrappers.
    in_place = compiled_in_place(index.all_modules()) if optimized is not None else ()
    # Without compiled submodules there is nothing to route: the part is not made (nor entered, nor exited).
    submodules = CompiledSubmodules(root, compiled, None, compiled_modules, in_place) \
        if compiled_modules or in_place else None
    # The root's own call is the trace itself (its calls of itself inside it are module calls); a callable's
    # calls into its root are module calls.  By position (skip, module types, progress bar): keywords cost per trace.
    skip = model if root is model else None
    if skip is not None:
        state.root = model
    tracker = ModuleCallTracker(state, skip, _FRAMES,
                                submodules.eager_modules if submodules is not None else (), index.module_types(),
                                shown if shown is not QUIET else None)
    parts = (shim, tracker)
    grads_policy = state.grads.policy if state.grads is not None else None
    if policy.mode == 2 and policy.selected_modules or \
            grads_policy is not None and grads_policy.mode == 2 and grads_policy.selected_modules:
        # Module outputs an op outside them made (nn.Identity): kept, or watched, as the call returns.  Installed
        # before the interventions' hooks, so that its hook runs first: a stop_after= at a selected module stops
        # the forward in theirs, after the call's outputs are kept.
        parts = (*parts, SelectedModuleOutputs(state, policy, state.grads, skip))
    if runtime is not None and runtime.module_sites:
        # Interventions' module hooks run inside each module call the tracker records (torch's _call_impl runs them).
        parts = (*parts, runtime.module_hooks(state, skip))
    parts = (*parts, installed) if packing is None else (*parts, installed, SavedTensorHooks(packing))
    if optimized is not None:  # Dynamo imported: compiled functions run with capture aside (last: its mode back first)
        parts = (*parts, CompiledFunctions(state))
    if state.grads is not None or packing is not None or state.markers is not None:
        # A custom autograd Function's outputs get their backward node late, and what it keeps is packed late
        # (a profile's markers learn which op's output that node differentiates).
        parts = (function_outputs(state, state.grads, packing), *parts)
    state.suspend = lambda: Suspension(tracker, shim)  # around a compiled region, a higher-order op, a compile
    parts = (DynamoCompiles(state), *parts)
    if submodules is not None:
        submodules.suspend, submodules.state = state.suspend, state
        parts = (submodules, *parts)
    return parts, submodules


def _run_captured(capture, parts, mode, state, runtime, packing, model, root, args, kwargs, shown):
    """Run the forward inside ``capture`` and return its output (None when ``stop_after=`` ended it).  An
    exception from the model goes on, noted with the op and module it came from, once all is torn down."""
    try:
        # Torn down once by the ``with`` exit; whenever that exit is skipped or cut short, an exception
        # is on its way to the ``except`` below, which tears down again (see capture/teardown.py).
        with capture:
            output = _run_forward(model, args, kwargs) if packing is None else _run_observed(model, args, kwargs)
    except BaseException as exc:
        capture.tear_down()
        if runtime is None or runtime.stopped_at is None or not isinstance(exc, StopForward):
            shown.close()
            _annotate(exc, state, root, leftovers(mode, parts), args)
            release_failed(state, runtime)
            raise
        # stop_after= reached: the trace holds everything up to that site, the stop's exception let go.
        state.caught_calls = forget_caught_exceptions(state, exc)
        return None
    finally:
        state.suspend = None  # it holds the tracker, which holds the state: no cycle may outlive the forward
    state.caught_calls = forget_caught_exceptions(state)  # and the exceptions the forward caught
    return output


def _complete(result, state, index, policy, runtime, packing, submodules, root, model_name) -> None:
    """What the run and the options add to a finalized record: its caveats, the process rank, the root's
    class, each module call's calling line (loop or reuse, for display); then the check that each ``save=``
    entry matched, the interventions' outcome, the ``save=`` filter applied after the fact, the gradient
    hooks' sink and what autograd kept for backward.  Class defaults stand where none apply."""
    if state.versionless or submodules is not None or index.script_modules or state.unattributed \
            or index.packed_weights or state.caught_calls or state.compiled_functions or state.called_elsewhere:
        caveats = ((INFERENCE_CAVEAT,) if state.versionless else ()) + \
            (submodules.caveats() if submodules is not None else ()) + \
            compiled_function_caveat(state.compiled_functions) + \
            _script_caveat(index.script_modules + (_unregistered_scripts(result) if state.unattributed else ())) + \
            _packed_weights_caveat(index.packed_weights) + caught_calls_caveat(result, state.caught_calls) + \
            other_threads_caveat(result, state.called_elsewhere, index)
        if caveats:
            result.caveats = caveats
    rank = process_rank()
    if rank[0] is not None:  # else not under torch.distributed
        result.rank, result.world_size = rank
    result._root_class = type(root).__name__ if root is not None else model_name
    if root is None:
        result._rootless = True
    result._module_call_frames = state.call_frames
    if policy.mode == 2 or policy.labels:  # a list of entries: each must have matched something
        policy.check_matched(result, stopped_after=runtime.stopped_at if runtime is not None else None)
    if runtime is not None:
        from ..intervene.finish import finish_interventions

        finish_interventions(runtime, result)
    if policy.filters_after:
        policy.apply(result, state.held_at_exhaustion)
    if state.grads is not None:
        attach_grads(result, state.grads, bool(state.outside or state.own_outputs), index.packed_weights)
    if packing is not None:
        packing.calls = None  # the forward is over: nothing more is attributed
        result._packlog = packing


def trace(model, args=(), kwargs=None, *, save="all", save_device=None, record_finite: bool = False,
          max_saved_bytes: int | None = None, name: str | None = None, deep: bool = False, root=None,
          progress=None, intervene: dict | None = None, reference: Trace | None = None, stop_after=None,
          grads=False, saved_for_backward: bool = False, compiled: str = "run", **unknown) -> Trace:
    """Run ``model(*args, **kwargs)`` once and return the ``Trace`` of every torch op it called.

    Args:
        model: an ``nn.Module`` or any callable.  DataParallel/DDP wrappers and ``torch.compile``
            results are unwrapped to the eager module underneath.  A bound method of a module
            (``m.generate``, ``m.embed``), or a ``functools.partial`` of a module or of its method, names
            modules from that module.
        args: the positional arguments.  A tuple is the positional arguments; any other value (a
            tensor, a list, a dict) is the single positional argument: ``trace(model, [a, b])`` calls
            ``model([a, b])``.  To pass one tuple as the only argument, wrap it: ``((a, b),)``.
        kwargs: keyword arguments for forward.
        save: which activations to keep: ``"all"``, ``"none"``, a label / module address / op type or a
            list of them, or a predicate ``f(op) -> bool``.  Activations are kept by reference and copied
            only when an in-place op is about to overwrite them.
        save_device: move saved activations to this device as they are captured.
        record_finite: record a (has_nan, has_inf) flag per op even for unsaved ops.
        max_saved_bytes: stop saving (with a warning naming the first unsaved op) past this budget.
        name: a display name for the trace (defaults to the model's class name).
        deep: also record the torch calls made inside torch functions written in Python
            (``F.normalize``, ``F.interpolate``, ``F.multi_head_attention_forward``), which are
            otherwise one op each.
        root: for a callable that is not a module (``lambda x: m(x).logits``), the module whose
            submodules it calls: they are named by their address in it.  Each call of the root
            itself is a module call ``self:k`` (in ``generate()``, ``k`` is the step).
        progress: a progress bar (module calls, then finalizing) once tracing takes about a second:
            None shows it on an interactive terminal or notebook only, True anywhere, False never.
        intervene: ``{site: action}``: change what each site produces and trace the run that follows
            (see docs/interventions.md).  A site is an op label, a layer label (every pass), a module
            call (``enc.layers.3:1``), a module address (every call) or a predicate over ops; an action
            is ``f(tensor, op) -> tensor | None``, a tensor, or a helper such as ``tl.zero_ablate()``.
        reference: the trace label sites are resolved against (by default a metadata-only trace of the
            same inputs, made first).
        stop_after: a site; the forward stops once it is produced, and the trace holds everything up to
            it (``output`` is None and ``stopped_after`` names the site).
        grads: ``True`` to receive, from any later backward through the traced output, the gradient
            of every op's output (``log[label].grad``); a list of selectors (as for ``save=``) keeps
            only some.  See docs/gradients.md.
        saved_for_backward: record which tensors autograd keeps for backward, op by op
            (``op.saved_for_backward_bytes``, ``log.saved_for_backward()``).
        compiled: how ``torch.compile``'d submodules run: ``"run"`` (compiled, exactly as untraced, each
            call one ``compiled`` op) or ``"eager"`` (their interior traced op by op; outputs may then
            differ from the compiled run, and ``Trace.caveats`` says so).
    """
    if unknown:
        _refuse_unknown_options(unknown)
    # By position, in _trace's order (markers: None), not **options passed on: keywords cost per hop.
    return _paused_collector(_trace, (model, args, kwargs, save, save_device, record_finite, max_saved_bytes,
                                      name, deep, root, None, progress, intervene, reference, stop_after, grads,
                                      saved_for_backward, compiled))


# help(tl.trace) shows the options it takes: **unknown is there only to refuse the others in tl.trace's own words.
trace.__signature__ = inspect.signature(trace).replace(
    parameters=[p for p in inspect.signature(trace).parameters.values() if p.kind != p.VAR_KEYWORD])
OPTIONS = tuple(name for name, p in inspect.signature(trace).parameters.items() if p.kind == p.KEYWORD_ONLY)


def _refuse_unknown_options(unknown: dict) -> None:
    """A keyword tl.trace does not take, named with the option meant or with where a forward's keyword goes."""
    name = next(iter(unknown))
    raise TypeError(f"tl.trace() got an unexpected keyword argument {name!r}"
                    f"{unknown_option_hint('tl.trace', name, OPTIONS)}")


def trace_with_markers(model, args, kwargs, markers, **options) -> Trace:
    """``trace`` that also drives profiler ``markers`` per op and module call (``report.kernel_profile``)."""
    return _paused_collector(lambda: _trace(model, args, kwargs, markers=markers, **options), ())


def _paused_collector(run, arguments: tuple) -> Trace:
    """``run(*arguments)`` (one trace) with the thread marked as tracing and the collector paused; both are restored
    whatever is raised and wherever (an interrupt can land on any line of the restore, which then runs again as the
    interrupt passes).  A trace that raises also gets its grad mode back (``restore_grad_mode``)."""
    if getattr(_local, "active", False):
        raise NestedTraceError("tl.trace, or a tool that traces (tl.validate, tl.extract, the patching and "
                               "profiling reports), was called inside a forward that is already being traced; "
                               "trace the outer model once instead")
    collecting, torch_functions, grad = gc.isenabled(), torch_function_state(for_trace=True), torch.is_grad_enabled()
    thread = threading.get_ident()
    try:
        try:
            _local.active = True
            _collector_was_on[thread] = collecting
            gc.disable()  # a trace allocates many small records: no collector passes over them meanwhile
            return run(*arguments)
        finally:
            _local.active = False
            _collector_was_on.pop(thread, None)
            restore_torch_function_state(torch_functions)
            if collecting:
                gc.enable()
    except BaseException:
        # Once more: an interrupt landing on a line of the ``finally`` above cuts it short, and raises.
        _local.active = False
        _collector_was_on.pop(thread, None)
        restore_torch_function_state(torch_functions)
        restore_grad_mode(grad)
        if collecting and not gc.isenabled():
            gc.enable()
        raise


def _root_of(model, root):
    """The module whose addresses name the modules a trace sees (None: a plain function)."""
    if root is not None and not isinstance(root, torch.nn.Module):
        raise TypeError(f"root= must be an nn.Module (the model the callable runs), not {type(root).__name__}")
    if isinstance(model, torch.nn.Module):
        # root= the wrapper that was traced (DDP, DataParallel, torch.compile) names the module traced too.
        if root is not None and root is not model and unwrap(root) is not model:
            raise ValueError(f"root= names the module a callable runs (tl.trace(m.generate, x, root=m)), but the "
                             f"traced model is already a module ({type(model).__name__}) and root= is another "
                             f"({type(root).__name__}): drop root=, or trace the callable you meant")
        return model
    if root is None:
        return module_run_by(model)  # a bound method (m.generate, m.embed), or a partial of one or of a module
    return root


def _display_name(model, root) -> str:
    if root is model:
        return type(model).__name__
    method = getattr(model, "__name__", None)
    if root is not None:
        bound = getattr(model, "__self__", None) is root and method
        return f"{type(root).__name__}.{method}" if bound else type(root).__name__
    qualname = getattr(model, "__qualname__", None)  # torch.relu's: _VariableFunctionsClass.relu, named relu here
    return (model.__name__ if qualname and qualname[0] == "_" else qualname) or type(model).__name__


def _intervention_runtime(model, root, args, kwargs, intervene, stop_after, reference, deep, index, policy, compiled):
    """The runtime applying ``intervene=`` / ``stop_after=``, or None (the hot path then costs one check)."""
    from ..intervene import prepare

    return prepare(root if root is not None else model, intervene=intervene, stop_after=stop_after,
                   reference=reference, index=index, deep=deep, keep_originals=policy.mode != 0, compiled=compiled,
                   run_reference=lambda: _reference_trace(model, args, kwargs, deep, root, compiled))


def _reference_trace(model, args, kwargs, deep, root, compiled):
    """The metadata-only trace label sites are resolved against, on copies of the inputs: a forward that
    writes its inputs in place (``x.mul_(2)``, a key/value cache it extends) must meet them unchanged in
    the intervened run, and leave them as one forward would.  Compiled submodules run as they will in the
    intervened run (``compiled=``), so that the ops inside one traced eagerly have their labels there."""
    return _trace(model, *clone_call(args, kwargs), save="none", deep=deep, root=root, compiled=compiled)


def _run_forward(model, args, kwargs):
    # Its code object marks the boundary of user code for source lookup: keep it a plain call.
    return model(*args, **kwargs)


def _run_observed(model, args, kwargs):
    """``_run_forward`` under the saved-tensor hooks of ``saved_for_backward=True`` (a capture part), noting a
    refusal of them."""
    with refusal_noted():
        return _run_forward(model, args, kwargs)


# Frame verdicts are process-wide (capture/source.py): one classifier serves every trace.
_FRAMES = FrameClassifier(stop_codes=(_run_forward.__code__,))


def _unregistered_scripts(trace) -> tuple:
    """The TorchScript modules the forward called from outside the model (a callable traced with
    ``root=``): their outputs are among the unattributed tensors, which gate this look."""
    return tuple(m.address for m in trace.modules
                 if is_unregistered(m.address) and isinstance(m._ref, torch.jit.ScriptModule))


def _packed_weights_caveat(paths) -> tuple:
    if not paths:
        return ()
    return (f"{PACKED_WEIGHTS_CAVEAT} ({', '.join(paths)}), which are not tensors: the ops that read them name "
            "them in Op.packed_params, not Op.params, and parameter counts leave them out (a quantized Linear's or "
            "conv's weight() and bias() unpack them)",)


def warn_mutated(labels: list) -> None:
    if labels:
        warn_user(
            "torchlens dropped saved activations that were changed after being saved, by writes that "
            f"torch did not route through capture: {', '.join(labels[:10])}"
            + (" ..." if len(labels) > 10 else "")
            + ". Their metadata is intact; their reasons are listed by print(log).")


def _script_caveat(addresses) -> tuple:
    if not addresses:
        return ()
    text = (f"TorchScript modules ({', '.join(addresses)}) run their ops where capture cannot see them: each call "
            "is a module call with no ops, and its outputs enter the trace with no parent op (Trace.unattributed); "
            "trace the module as it was before torch.jit.script or torch.jit.trace to record its interior")
    warn_user(text)
    return (text,)


# A traced module call runs in more frames than an untraced one (capture's own), so a forward that nests
# module calls close to the interpreter's recursion limit can run untraced and overflow traced.
_DEEPER_TRACED = ("torchlens: a trace runs every module call in more frames than the model does, so a forward that "
                  "runs untraced can exceed the recursion limit traced: raise it with sys.setrecursionlimit; on "
                  "CPython 3.12 and 3.13 the compiled path also counts module calls against the C-level recursion "
                  "limit, which that does not raise: TORCHLENS_ACCEL=0 then traces about as deep as the model runs")


def _annotate(exc: BaseException, state, model, left=(), args=()) -> None:
    torn_down = ("capture was torn down, nothing is left installed" if not left else
                 "capture could not remove " + ", ".join(left) + "; restart the process before tracing again")
    if state.failure is not None and state.failure[2] is exc:
        from ..labels.naming import func_name_of

        func, module_call, _ = state.failure
        # The index its first output would have had: print(log) lists a trace's ops from (0), the first input.
        add_note(exc, f"torchlens: raised by torch call {func_name_of(func)!r} (op #{len(state.records)}) "
                     f"in {_where(state, module_call, model)}; {torn_down}")
    else:
        module_call = state.module_stack[-1] if state.module_stack else -1
        if state.raised_in is not None and state.raised_in[0] is exc:
            module_call = state.raised_in[1]
        where = _where(state, module_call, model)
        if module_call < 0 and state.module_calls:  # e.g. raised by a forward hook, after the call ended
            where += f" (the last module call before it: {_where(state, len(state.module_calls) - 1, model)})"
        add_note(exc, f"torchlens: raised in {where} after {len(state.records)} captured tensors; {torn_down}")
    if isinstance(exc, RecursionError):
        add_note(exc, _DEEPER_TRACED)
    note_how_arguments_were_passed(exc, args, model)


def _where(state, index: int, model) -> str:
    if index < 0:
        return "the root forward"
    module = state.module_calls[index][MODULE_CALL_MODULE]
    call_number = sum(1 for c in state.module_calls[: index + 1] if c[MODULE_CALL_MODULE] is module)
    address = type(module).__name__
    if isinstance(model, torch.nn.Module):
        # The root module's own address is "" in named_modules; a trace calls it "self".
        address = traced_address(next((n or "self" for n, m in model.named_modules() if m is module), address))
    return f"module call {address}:{call_number}"
