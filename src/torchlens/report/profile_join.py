"""Join profiler events to torchlens markers by ids: host containment, CUPTI correlation, sequence number.

Three links, each exact:

1. Host events (aten ops, runtime calls such as ``cudaLaunchKernel``) belong to the innermost
   torchlens marker that contains them *on the same thread* (RecordFunction ranges nest strictly per
   thread, so containment is the profiler's own parent relation).
2. A device event (kernel, memcpy, memset) carries the CUPTI correlation id of the runtime call that
   launched it; it belongs to wherever that runtime call belongs.  A kernel that runs long after its
   launch still lands on the op that launched it.  When no runtime event carries its correlation,
   the External id Kineto stamped on it (the launching host op's) is used instead, and counted.
3. Backward work: the autograd engine wraps each grad node in events carrying the node's sequence
   number; forward aten ops carry the sequence number of the node they created.  Backward work goes to
   the op whose marker contained those forward aten ops, on whatever thread the engine ran it (a node run
   inside an op's marker, by a ``torch.autograd.grad`` the forward calls, is that op's work; an engine range
   that lost its node's number to a tensor hook run before the node takes it from the node's own event).  A node
   whose number no aten op recorded (a write into a view's ``CopySlices``) goes to the op recording the
   number below it, when a forward op recorded one above it too.

Nothing is matched by name except decoding our own marker names.  Work that none of the links reaches
is counted under a reason, never dropped and never guessed.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

from .markers import PREFIX, parse_marker
from .profile_events import DEVICE, HOST, OVERHEAD, RUNTIME, USER_RANGE

# Why an event is not attributed to an op.  Keys are stable; the text is what the report prints.
REASONS = {
    "module_outside_ops": "inside a module call but outside any captured op (counted on the module call)",
    "forward_outside_ops": "inside the traced forward but outside any captured op or module call",
    "backward_outside_nodes": "in the backward phase outside any grad node (the loss, the backward seed, "
                              "AccumulateGrad, engine bookkeeping)",
    "backward_without_op": "backward of a grad node no captured op created (AccumulateGrad, the loss, a node made "
                           "on another thread, a custom autograd.Function's backward whose output no captured op "
                           "made)",
    "call_without_op": "inside a torch call that returned no tensor, so is not an op (torch.equal, ...)",
    "outside_profile": "before or after the profiled forward/backward on the model's thread",
    "other_thread": "on a thread that ran no torchlens marker (other threads' work)",
    "no_correlation": "device event without a CUPTI correlation id",
    "no_launch_event": "no runtime event with this correlation id in the trace (CUDA graph replay, or a "
                       "launch before the profiler started)",
}

CPU_NS, ATEN_OPS, DEVICE_NS, KERNELS, MEMOPS = range(5)  # the slots of a tally


class Target(NamedTuple):
    """Where an event's work is credited: an op (in its forward or its backward), a module call's own work
    outside its ops, or a reason it reaches neither."""
    kind: str  # "op", "module" or "unattributed"
    key: object  # the op marker serial, the module call index, or a key of REASONS
    phase: str | None = None  # an op's: "forward" or "backward"


class Owner:
    """What encloses one aten op or runtime call on its thread: the innermost op marker, module marker, phase
    and grad node (sequence number), the grad nodes around that node (``outer``, outermost first: a backward run
    inside a node's, as a reentrant checkpoint runs its region's), the thread (None when no marker of the run
    ran on it), and the event's own time, its children's excluded."""

    __slots__ = ("op", "module", "phase", "seq", "outer", "thread", "self_ns")

    def __init__(self, op, module, phase, nodes, thread):
        self.op, self.module, self.phase, self.thread = op, module, phase, thread
        self.seq, self.outer = (nodes[-1], nodes[:-1]) if nodes else (None, ())
        self.self_ns = 0


def _tally() -> list:
    return [0, 0, 0, 0, 0]


def union_ns(intervals) -> int:
    """Total length of the union of ``(start, end)`` intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    if cur_end is not None:
        total += cur_end - cur_start
    return total


class JoinResult:
    """What the join found, keyed by marker ids (serials, module call indices)."""

    def __init__(self):
        self.op_forward: dict = {}  # op serial -> tally
        self.op_backward: dict = {}  # op serial -> tally
        self.module_direct: dict = {}  # module call index -> tally (work outside ops inside the call)
        self.op_span: dict = {}  # op serial -> marker duration (ns, the profiler's own host range)
        self.op_aten: dict = {}  # op serial -> names of the top-level aten ops inside its marker
        self.marker_counts: dict = {}  # (kind, key) -> times seen
        self.marker_ids: dict = {}  # marker name -> External id of its event
        self.host_unattributed: dict = {}  # reason -> [events, self ns]
        self.device_unattributed: dict = {}  # reason -> [events, ns]
        self.host_total = [0, 0]  # [events, self ns] of every aten op and runtime call
        self.host_attributed = [0, 0]  # of those, landed on an op (forward or backward)
        self.device_intervals: dict = {}  # device -> [(start, end)] of every device event
        self.attributed_intervals: dict = {}  # device -> [(start, end)] landed on an op or module call
        self.device_events = 0
        self.external_ids: dict = {}  # host External id -> Target
        self.correlations: dict = {}  # CUPTI correlation id -> Target
        self.nesting_violations = 0
        self.profiler_overhead = [0, 0]  # [events, ns] the profiler spent on itself
        self.device_via_external_id = 0  # device events linked by External id, lacking a runtime event
        self.backward_only = False  # a backward-only profile of an earlier trace (kernel_profile(log))
        self.backward_measured: set = set()  # there: the op serials whose backward could be attributed

    @property
    def has_device(self) -> bool:
        return self.device_events > 0


def join(events: list, run: int, op_serials=None, seq_owner=None, function_nodes=None) -> JoinResult:
    """Attribute ``events`` to the markers of profile ``run`` (see the module docstring).

    ``op_serials``: the op marker serials that became ops (``ProfilerMarkers.resolve_calls``); work
    under any other op marker belongs to a call that returned no tensor.  ``seq_owner``
    (``{sequence number: op serial}``): a backward-only profile of an earlier trace, whose backward
    nodes the trace itself numbered (``grads=True``); no forward ran inside the profile.
    ``function_nodes`` (``{sequence number: op serial}``): the nodes custom Functions gave the output of an op
    (``ProfilerMarkers.function_node``), numbered inside ``apply``, outside that op's range."""
    result = JoinResult()
    # A backward-only profile's forward ran earlier, on a thread this profile may not mark: its nodes go by number.
    owners = _sweep_threads(events, run, result, _marked_threads(events, run) if seq_owner is None else None)
    result.backward_only = seq_owner is not None
    if seq_owner is None:
        seq_owner = _forward_sequence_owners(events, owners, function_nodes or {})
    resolved = {}
    for i, owner in owners.items():
        e = events[i]
        target = _resolve(owner, seq_owner)
        if target.kind == "op" and op_serials is not None and target.key not in op_serials:
            target = Target("unattributed", "call_without_op")
        resolved[i] = target
        result.host_total[0] += 1
        result.host_total[1] += owner.self_ns
        _credit_host(result, e, target, owner.self_ns)
    _join_device(events, resolved, result)
    return result


def _sweep_threads(events, run, result, model_threads) -> dict:
    """Per thread, the innermost op marker / module marker / phase / grad node around each event.  ``model_threads``
    (``_marked_threads``, or None): the threads whose grad nodes an op of the trace may have made.

    Returns ``{event index: Owner}`` for aten ops and runtime calls (markers themselves are recorded in ``result``)."""
    by_thread: dict = {}
    for i, e in enumerate(events):
        if (e.kind == HOST or e.kind == RUNTIME) and not _is_user_range(e) and not _is_other_run(e, run):
            by_thread.setdefault(e.thread, []).append(i)
    owners: dict = {}
    children_ns = [0] * len(events)
    marked_threads = set()
    for thread, indices in by_thread.items():
        indices.sort(key=lambda i: (events[i].start, -events[i].end))
        stack: list = []  # (end, index, op, module, phase, grad node numbers (outermost first), is_marker)
        for i in indices:
            e = events[i]
            while stack and stack[-1][0] <= e.start:
                stack.pop()
            if stack:
                end, parent, op, module, phase, nodes, parent_is_op_marker = stack[-1]
                children_ns[parent] += e.end - e.start
                if e.end > end:
                    result.nesting_violations += 1
            else:
                op = module = phase = None
                nodes, parent_is_op_marker = (), False
            marker = parse_marker(e.name) if e.kind == HOST and e.name.startswith(PREFIX) else None
            if marker is not None and marker[1] == run:
                kind, _, key = marker
                marked_threads.add(thread)
                result.marker_counts[(kind, key)] = result.marker_counts.get((kind, key), 0) + 1
                result.marker_ids[e.name] = e.external_id
                if kind == "op":
                    op, nodes = key, ()
                    result.op_span[key] = result.op_span.get(key, 0) + e.end - e.start
                elif kind == "module":
                    module = key
                else:
                    phase = key
                stack.append((e.end, i, op, module, phase, nodes, kind == "op"))
                continue
            if parent_is_op_marker and e.kind == HOST:
                result.op_aten.setdefault(op, []).append(e.name)
            if e.kind == HOST and e.backward and e.seq >= 0:
                # A grad node run inside an op's range is that op's work (torch.autograd.grad called by the
                # forward): it keeps the op; run outside one, it is the backward of whichever op made it.
                nodes = nodes + (_node_number(e, model_threads),)
                if stack and parent in owners and _lost_its_number(events[parent]):
                    _number_wrapper(stack, owners[parent], nodes)
            owners[i] = Owner(op, module, phase, nodes, thread)
            stack.append((e.end, i, op, module, phase, nodes, False))
    for i, owner in owners.items():
        owner.self_ns = events[i].end - events[i].start - children_ns[i]
        if owner.thread not in marked_threads:
            owner.thread = None  # a thread without any marker of this run
    return owners


def _marked_threads(events, run) -> set:
    """The threads that ran a marker of profile ``run``: the model's (and the one its backward ran on)."""
    return {e.thread for e in events if e.kind == HOST and e.name.startswith(PREFIX)
            and (marker := parse_marker(e.name)) is not None and marker[1] == run}


def _node_number(e, model_threads) -> int:
    """The number of the grad node ``e`` runs, by which it is joined to the op that made it; -1 (no op's) for a node
    made on a thread that ran no marker (a thread pool's worker): each thread numbers its nodes from its own
    counter, so its numbers are those of other nodes of the model's thread.  Known where the profile names the
    node's thread as it names the others (``Event.fwd_thread``)."""
    if model_threads is None or e.fwd_thread is None or e.fwd_thread in model_threads:
        return e.seq
    return -1


def _lost_its_number(e) -> bool:
    """Whether ``e``, holding a grad node's own event, is the engine's range around that node without the node's
    number.  Torch's profiler copies the number onto the range from the event right after it, the node's, and a
    tensor hook run in between (one that adds the gradient to one kept from an earlier backward, as a trace taken
    with ``grads=True`` does) comes first."""
    return e.kind == HOST and not e.backward and e.seq < 0


def _number_wrapper(stack, owner: Owner, nodes: tuple) -> None:
    """Give the engine's range around a node (the top of ``stack``, ``owner``) that node's numbers, ``nodes``, for
    itself and for what it runs after the node's own event."""
    owner.seq, owner.outer = nodes[-1], nodes[:-1]
    end, index, op, module, phase, _, is_op_marker = stack[-1]
    stack[-1] = (end, index, op, module, phase, nodes, is_op_marker)


def _is_user_range(e) -> bool:
    """A range the model's own code opened (``torch.profiler.record_function``), not one of torchlens's markers.
    It names code and does no work of its own, so the join looks through it: its enter and its exit are two torch
    calls, each inside its own op marker, so it never nests in them, and its self time is Python time between
    ops, not an aten op's."""
    return e.category == USER_RANGE and not e.name.startswith(PREFIX)


def _is_other_run(e, run) -> bool:
    """A marker of another profile in the same profiler (several ``kernel_profile`` calls borrowing one).  Like a
    user's range it does no work of its own: its self time is that run's capture in Python, not an aten op's, so
    the join looks through it and counts only the work inside it, as outside this profile."""
    if not e.name.startswith(PREFIX):
        return False
    marker = parse_marker(e.name)
    return marker is not None and marker[1] != run


def _forward_sequence_owners(events, owners, function_nodes: dict) -> dict:
    """``{sequence number: op serial or None}`` from the aten ops run on the model's thread.

    Every autograd-aware aten op records the *next* sequence number, but only an op that creates a
    grad node advances it; so node N was created by the last op (in time) that recorded N.  An
    in-place ``add_`` on a BatchNorm's step counter records the same N as the ``batch_norm`` after
    it; the batch norm is the later one, and owns the node.  Ops outside any captured op count too
    (a loss computed after the forward): their nodes belong to no op (``None``), except a custom Function's,
    which ``apply`` numbers outside the ops inside it: it belongs to the op that made the Function's output
    (``function_nodes``), whose output the node differentiates."""
    latest: dict = {}
    in_nodes: set = set()  # numbers recorded by ops run inside a grad node (a recompute during the backward)
    for i, owner in owners.items():
        e = events[i]
        if owner.thread is None or e.kind != HOST or e.backward or e.seq < 0:
            continue
        if owner.seq is not None and owner.op is None:
            in_nodes.add(e.seq)
            continue
        seen = latest.get(e.seq)
        if seen is None or e.start >= seen[0]:
            latest[e.seq] = (e.start, owner.op)
    owned = {seq: serial for seq, (_, serial) in latest.items()}
    owned.update(function_nodes)
    nodes = {e.seq for e in events if e.kind == HOST and e.backward and e.seq >= 0}
    owned.update(_unrecorded_node_owners(nodes - owned.keys() - in_nodes, owned, in_nodes))
    return owned


def _unrecorded_node_owners(unrecorded, owned: dict, in_nodes: set) -> dict:
    """Owners of grad nodes whose number no aten op recorded.

    An in-place write into a view makes two nodes in one aten op, its own and the base's ``CopySlices``, and
    reading the view's ``grad_fn`` afterwards makes a third; only the first number is recorded.  Numbers
    are taken in order on the thread, so a node numbered between two recorded numbers was made after the
    op recording the lower one began and before the one recording the higher one: by the lower one's op
    (or the capture around it).  A node numbered after every forward record, or before a number an op inside
    a grad node recorded, may have been made during the backward, so it keeps no owner."""
    recorded = sorted(owned)
    later = sorted(set(recorded) | in_nodes)
    found = {}
    for seq in unrecorded:
        below = bisect.bisect_left(recorded, seq) - 1
        above = bisect.bisect_right(later, seq)
        if below >= 0 and above < len(later) and later[above] in owned:
            found[seq] = owned[recorded[below]]
    return found


def _resolve(owner: Owner, seq_owner) -> Target:
    if owner.op is not None:
        return Target("op", owner.op, "forward")
    if owner.seq is not None:
        serial = _node_owner(owner, seq_owner)
        if serial is not None:
            return Target("op", serial, "backward")
        if owner.thread is not None and owner.phase is None:  # on the model's thread, outside this run's phases:
            return Target("unattributed", "outside_profile")  # another profile's backward, or one run after it
        return Target("unattributed", "backward_without_op")
    if owner.module is not None:
        return Target("module", owner.module)
    if owner.thread is None:
        return Target("unattributed", "other_thread")
    if owner.phase == "forward":
        return Target("unattributed", "forward_outside_ops")
    if owner.phase == "backward":
        return Target("unattributed", "backward_outside_nodes")
    return Target("unattributed", "outside_profile")


def _node_owner(owner: Owner, seq_owner):
    """The op whose backward the node around ``owner`` belongs to.  A node no op made that ran inside another node
    (the backward of the region a reentrant checkpoint recomputes, run inside the checkpoint's node) is that
    node's work, so it goes where the node around it goes."""
    for seq in (owner.seq, *reversed(owner.outer)):
        serial = seq_owner.get(seq)
        if serial is not None:
            return serial
    return None


def _credit_host(result, e, target: Target, self_ns) -> None:
    kind = target.kind
    if kind == "op":
        table = result.op_forward if target.phase == "forward" else result.op_backward
        tally = table.get(target.key)
        if tally is None:
            tally = table[target.key] = _tally()
        tally[CPU_NS] += self_ns
        tally[ATEN_OPS] += e.kind == HOST
        result.host_attributed[0] += 1
        result.host_attributed[1] += self_ns
    elif kind == "module":
        tally = result.module_direct.get(target.key)
        if tally is None:
            tally = result.module_direct[target.key] = _tally()
        tally[CPU_NS] += self_ns
        tally[ATEN_OPS] += e.kind == HOST
        reason = result.host_unattributed.setdefault("module_outside_ops", [0, 0])
        reason[0] += 1
        reason[1] += self_ns
    else:
        reason = result.host_unattributed.setdefault(target.key, [0, 0])
        reason[0] += 1
        reason[1] += self_ns
    if kind != "unattributed":
        if e.kind == HOST and e.external_id is not None:
            result.external_ids[e.external_id] = target
        elif e.kind == RUNTIME and e.correlation is not None:
            result.correlations[e.correlation] = target


def _join_device(events, resolved, result) -> None:
    launches: dict = {}  # CUPTI correlation -> target of the runtime call that launched it
    host_ops: dict = {}  # External id -> target of that host op (the fallback link)
    for i, target in resolved.items():
        e = events[i]
        if e.kind == RUNTIME and e.correlation is not None:
            launches[e.correlation] = target
        elif e.kind == HOST and e.external_id is not None:
            host_ops[e.external_id] = target
    for e in events:
        if e.kind != DEVICE:
            if e.category == OVERHEAD:
                result.profiler_overhead[0] += 1
                result.profiler_overhead[1] += e.end - e.start
            continue
        result.device_events += 1
        interval = (e.start, e.end)
        result.device_intervals.setdefault(e.device, []).append(interval)
        target = launches.get(e.correlation) if e.correlation is not None else None
        if target is None and e.external_id in host_ops:
            # No runtime event with this correlation, but Kineto linked the device event to the host op
            # that launched it (its External id): the same link torch's FunctionEvent.kernels uses.
            target = host_ops[e.external_id]
            result.device_via_external_id += 1
        if target is None:
            target = Target("unattributed", "no_correlation" if e.correlation is None else "no_launch_event")
        if target.kind == "unattributed":
            reason = result.device_unattributed.setdefault(target.key, [0, 0])
            reason[0] += 1
            reason[1] += e.end - e.start
            continue
        if target.kind == "op":
            table = result.op_forward if target.phase == "forward" else result.op_backward
        else:
            table = result.module_direct
            reason = result.device_unattributed.setdefault("module_outside_ops", [0, 0])
            reason[0] += 1
            reason[1] += e.end - e.start
        tally = table.get(target.key)
        if tally is None:
            tally = table[target.key] = _tally()
        tally[DEVICE_NS] += e.end - e.start
        if e.device_kind == "kernel":
            tally[KERNELS] += 1
        else:
            tally[MEMOPS] += 1
        result.attributed_intervals.setdefault(e.device, []).append(interval)
        if e.correlation is not None:
            result.correlations[e.correlation] = target
