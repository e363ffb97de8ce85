"""``kernel_profile(log, backward=...)``: profile only the backward of a trace taken with ``grads=True``.

The usual kernel profile runs a traced forward inside the profiler and learns which op created each
backward node from the sequence numbers its forward aten ops carry.  A trace taken with ``grads=True``
already knows them: capture read each recorded output's ``grad_fn`` sequence number while registering
its gradient hook.  So the backward can be profiled on its own, later, without a second forward: every
profiler event inside a backward node is joined to the op whose output that node differentiates, per
op, per layer and per module call (inclusive).  Forward columns are ``None`` (not measured), and so is
the backward of any op whose node number capture did not see (an op left out by ``grads=[...]``).  An op that
handed on a leaf (``w.float()`` of a float parameter returns ``w``) made no node: its backward is a measured zero,
as in the profile of a whole forward and backward, the leaf's ``AccumulateGrad`` being no op's.
"""

from __future__ import annotations

import torch

from ..errors import counted
from .markers import ProfilerMarkers
from .profile_join import join


def profile_backward_of(trace, backward, chrome_trace, profiler, activities, profiler_kwargs):
    from .kernel_profiling import KernelProfile, ProfilerBusyError, _check_borrowed, _own_profiler, check_chrome_path

    if backward is False:
        raise ValueError("kernel_profile(trace) profiles the trace's backward: pass backward=True (all-ones "
                         "gradients on every output that requires grad) or backward=f(output)")
    if trace.is_cleaned_up or trace.loaded_from is not None:  # before asking for gradients it cannot have
        raise ValueError("kernel_profile(trace) needs the live trace's output to run its backward; this one was "
                         "cleaned up or loaded from disk")
    capture = _grad_capture(trace)
    nodes = _node_owners(trace, capture)
    numbered = _numbered_calls(trace, capture)  # read now: cleanup() removes the hooks it reads
    markers = ProfilerMarkers()

    def run():
        try:
            markers.phase_enter("backward")
            _backward_once(trace, backward)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        finally:
            markers.close()

    if profiler is not None:
        _check_borrowed(profiler, chrome_trace)
        run()
        return KernelProfile(trace, profiler, markers, borrowed=True, backward=True, backward_nodes=nodes,
                             backward_numbered=numbered)
    if torch._C._autograd._profiler_enabled():
        raise ProfilerBusyError("a torch profiler is already running in this process. Pass it as "
                                "kernel_profile(..., profiler=prof), or close it first.")
    check_chrome_path(chrome_trace)
    prof = _own_profiler(activities, profiler_kwargs)
    with prof:
        run()
    result = KernelProfile(trace, prof, markers, borrowed=False, backward=True, backward_nodes=nodes,
                           backward_numbered=numbered)
    if chrome_trace is not None:
        result.export_chrome_trace(chrome_trace)
    return result


_FRESH_TRACE = "take a trace with tl.trace(model, x, grads=True) and pass it here before its backward runs"


def _grad_capture(trace):
    """The trace's gradient capture; without one, the refusal says what kernel_profile needs (the generic advice,
    "run a backward through log.output", would leave it no backward to profile)."""
    from ..errors import GradientUnavailable
    from ..record.grads import grad_capture_of

    try:
        return grad_capture_of(trace)
    except GradientUnavailable:
        raise GradientUnavailable("kernel_profile(trace) profiles the trace's backward, and this trace was taken "
                                  f"without gradients: {_FRESH_TRACE} (kernel_profile runs it)") from None


def _backward_once(trace, backward) -> None:
    """The trace's backward; autograd's refusal of a second one (the graph freed by an earlier backward) is said
    in the terms of this call."""
    from .kernel_profiling import run_backward

    try:
        run_backward(trace, backward)
    except RuntimeError as error:
        if "backward through the graph a second time" not in str(error):
            raise
        raise RuntimeError("kernel_profile(trace) runs the trace's backward, and this trace's backward already ran "
                           f"and freed its graph: {_FRESH_TRACE} (kernel_profile runs it), or run the earlier "
                           "backward with retain_graph=True") from error


def _node_owners(trace, capture) -> dict:
    """``{sequence number: call}``.  Nodes are numbered in creation order, so when every output was
    numbered, the nodes a call made besides its output's (``weight.t()`` inside ``linear``) are the
    numbers after the previous call's and up to its own."""
    owners = {}
    for index, seq in capture.sequence_numbers.items():
        owners.setdefault(seq, trace.call_indices[index])
    if capture.policy is not None:  # a grads=[...] selection: unnumbered ops in between
        _selected_call_nodes(trace, capture, owners)
        return owners
    previous = capture.first_sequence_number
    for seq in sorted(owners):
        if previous is not None:
            for inner in range(previous + 1, seq):
                owners[inner] = owners[seq]
        previous = seq
    return owners


def _selected_call_nodes(trace, capture, owners: dict) -> set:
    """Under a ``grads=[...]`` selection: adds to ``owners`` the nodes each selected call made besides its output's,
    and returns the calls whose nodes are not all known.  Those nodes are numbered after the last node of the call
    before that needed grad, so they are known only where that call was selected too; elsewhere the call's backward
    would read as its output node's alone (a linear's as its reshape's), so it is unknown instead."""
    last = {}
    for index, seq in capture.sequence_numbers.items():
        call = trace.call_indices[index]
        last[call] = max(seq, last.get(call, seq))
    partial, previous = set(), capture.first_sequence_number
    for c, call in enumerate(trace.calls):
        seq = last.get(c)
        if seq is None:
            previous = None if _needs_grad(trace, call) else previous  # an unselected call that made nodes
            continue
        if previous is None:
            partial.add(c)
        for inner in range(previous + 1 if previous is not None else seq, seq):
            owners.setdefault(inner, c)
        previous = seq if previous is None else max(previous, seq)
    return partial


def _numbered_calls(trace, capture) -> set:
    """The calls whose output's backward-node number capture read, or whose output it watched as a leaf (a hook
    without a number: the output had no node).  Besides the nodes' owners this holds the calls that handed on a
    tensor another call made (dropout in eval mode, ``contiguous`` on a contiguous tensor, ``.to`` its own dtype)
    or a leaf (``w.float()`` of a float parameter): their output's node is the earlier call's, or the leaf's
    ``AccumulateGrad``, no op's, so they made none, and their backward is a measured zero, not an unknown."""
    watched = capture.sequence_numbers.keys() | capture.handles.keys()
    return {trace.call_indices[index] for index in watched if trace.call_indices[index] >= 0}


def _needs_grad(trace, call) -> bool:
    meta, first = trace.op_meta, call.first_record
    return any(meta[i].requires_grad for i in range(first, first + call.num_outputs))


def join_backward(profile, events):
    """``(serial_of_call, joined, problems)`` where each call is its own serial."""
    from ..record.grads import grad_capture_of

    trace = profile.trace
    serial_of_call = {c: c for c in range(len(trace.calls))}
    joined = join(events, profile.markers.run, None, seq_owner=profile.backward_nodes)
    known = set(profile.backward_nodes.values()) | profile.backward_numbered
    # No backward node at all (the output needs no grad) is a measured zero; an unseen node is unknown.
    joined.backward_measured = {c for c, call in enumerate(trace.calls)
                                if c in known or not _needs_grad(trace, call)}
    capture = grad_capture_of(trace)
    if capture.policy is not None:
        joined.backward_measured -= _selected_call_nodes(trace, capture, {})
    problems = []
    unknown = len(trace.calls) - len(joined.backward_measured)
    if unknown:
        problems.append(f"the backward nodes of {counted(unknown, 'op')} were not all numbered during capture (left "
                        "out by grads=[...], or tensor subclasses): their backward columns are n/a")
    return serial_of_call, joined, problems
