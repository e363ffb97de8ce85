"""Profiler events in one normalized shape, read either from a closed profiler or from a chrome trace.

The join (``profile_join.py``) needs, per event: its category, interval, host thread, the ids that link
it (External id, CUPTI correlation, autograd sequence number) and, for device work, device and stream.
Two readers produce the same ``Event``s:

- ``events_from_profiler``: the in-memory Kineto events of a closed ``torch.profiler.profile``
  (``prof.profiler.kineto_results.events()``), the fast path used on a live profile;
- ``events_from_chrome``: a chrome trace written by torch's exporter, used for traces on disk (the
  checked-in GPU fixture, or a trace someone sends you).

Kinds come from Kineto's typed categories (``cpu_op``, ``cuda_runtime``, ``kernel``, ...), never from
event names.  Host thread ids differ between the two sources (a Kineto thread index in memory, the OS
thread id in chrome); the join only compares threads within one source, so that never matters.  A grad node's
event names the thread that made the node by the Kineto index in both: only in memory can the join compare it with
the threads events ran on (``Event.fwd_thread``).
"""

from __future__ import annotations

import json
from decimal import Decimal

HOST, RUNTIME, DEVICE, OTHER = "host", "runtime", "device", "other"
OVERHEAD = "overhead"  # the profiler's own work (buffer flushes, CUPTI); kept to be reported, never joined

USER_RANGE = "user_annotation"  # a record_function range (torchlens's own markers are cpu_op events)
_HOST_CATEGORIES = frozenset(["cpu_op", USER_RANGE])
_RUNTIME_CATEGORIES = frozenset(["cuda_runtime", "cuda_driver", "privateuse1_runtime", "privateuse1_driver"])
_DEVICE_CATEGORIES = {"kernel": "kernel", "concurrent_kernel": "kernel", "gpu_memcpy": "memcpy",
                      "gpu_memset": "memset"}


def kind_of(category: str) -> str:
    if category in _HOST_CATEGORIES:
        return HOST
    if category in _RUNTIME_CATEGORIES:
        return RUNTIME
    if category in _DEVICE_CATEGORIES:
        return DEVICE
    return OTHER


class Event:
    """One profiler event.  Times are integer nanoseconds on the profiler's own clock."""

    __slots__ = ("name", "category", "kind", "start", "end", "thread", "device", "stream", "correlation",
                 "external_id", "seq", "backward", "fwd_thread")

    def __init__(self, name, category, start, end, thread, *, device=None, stream=None, correlation=None,
                 external_id=None, seq=-1, backward=False, fwd_thread=None):
        self.name = name
        self.category = category
        self.kind = kind_of(category)
        self.start = start
        self.end = end
        self.thread = thread
        self.device = device  # "cuda:0" for device work, else None
        self.stream = stream
        self.correlation = correlation  # CUPTI correlation id (runtime and device events)
        self.external_id = external_id  # host: its own External id; runtime/device: the launching op's
        self.seq = seq  # autograd sequence number, -1 when none
        self.backward = backward  # a grad-node event (carries a forward thread id)
        # A grad-node event's: the thread that made the node, as ``thread`` names threads (in memory only: a chrome
        # trace names the node's thread by an index, but an event's by the OS's id), else None.
        self.fwd_thread = fwd_thread

    @property
    def device_kind(self):
        """``"kernel"``, ``"memcpy"`` or ``"memset"`` for device work, else None."""
        return _DEVICE_CATEGORIES.get(self.category)

    @property
    def duration(self) -> int:
        return self.end - self.start

    def __repr__(self) -> str:
        return f"<Event {self.category} {self.name!r} {self.start}..{self.end} thread={self.thread}>"


def _positive(value):
    return value if value is not None and value > 0 else None


def events_from_profiler(prof) -> list:
    """Normalized events of a closed ``torch.profiler.profile`` (or its autograd ``profile``)."""
    inner = getattr(prof, "profiler", prof)
    results = getattr(inner, "kineto_results", None)
    if results is None:
        raise RuntimeError("the profiler has no results yet: leave its `with` block (or call .stop()) "
                           "before reading a kernel profile")
    events = []
    for e in results.events():
        category = e.activity_type()
        kind = kind_of(category)
        if kind == OTHER:
            if category == OVERHEAD:
                events.append(Event(e.name(), category, e.start_ns(), e.end_ns(), None))
            continue
        if kind == DEVICE:
            device_type = str(e.device_type()).rsplit(".", 1)[-1].lower()
            events.append(Event(e.name(), category, e.start_ns(), e.end_ns(), e.device_resource_id(),
                                device=f"{device_type}:{e.device_index()}", stream=e.device_resource_id(),
                                correlation=_positive(e.correlation_id()),
                                external_id=_positive(e.linked_correlation_id())))
        elif kind == RUNTIME:
            events.append(Event(e.name(), category, e.start_ns(), e.end_ns(), e.start_thread_id(),
                                correlation=_positive(e.correlation_id()),
                                external_id=_positive(e.linked_correlation_id())))
        else:
            events.append(Event(e.name(), category, e.start_ns(), e.end_ns(), e.start_thread_id(),
                                external_id=_positive(e.correlation_id()), seq=e.sequence_nr(),
                                backward=e.fwd_thread_id() > 0, fwd_thread=_positive(e.fwd_thread_id())))
    return events


def _ns(us: Decimal) -> int:
    return int(us * 1000)


def load_chrome(path) -> dict:
    """A chrome trace JSON with exact timestamps (floats parsed as Decimal: microseconds to ns)."""
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f, parse_float=Decimal)


def events_from_chrome(data: dict) -> list:
    """Normalized events of a chrome trace as torch/Kineto write it (``"X"`` duration events only)."""
    base = int(data.get("baseTimeNanoseconds", 0))
    events = []
    for raw in data.get("traceEvents", ()):
        if raw.get("ph") != "X" or "cat" not in raw:
            continue
        category = raw["cat"]
        kind = kind_of(category)
        if kind == OTHER and category != OVERHEAD:
            continue
        args = raw.get("args") or {}
        start = base + _ns(Decimal(raw["ts"]))
        end = start + _ns(Decimal(raw.get("dur", 0)))
        if kind == OTHER:
            events.append(Event(raw["name"], category, start, end, None))
            continue
        external = _positive(args.get("External id"))
        if kind == DEVICE:
            device = args.get("device", raw.get("pid"))
            stream = args.get("stream", raw.get("tid"))
            events.append(Event(raw["name"], category, start, end, stream, device=f"cuda:{device}",
                                stream=stream, correlation=_positive(args.get("correlation")),
                                external_id=external))
        elif kind == RUNTIME:
            events.append(Event(raw["name"], category, start, end, raw.get("tid"),
                                correlation=_positive(args.get("correlation")), external_id=external))
        else:
            seq = args.get("Sequence number", -1)
            events.append(Event(raw["name"], category, start, end, raw.get("tid"), external_id=external,
                                seq=seq if seq is not None else -1,
                                backward=(args.get("Fwd thread id") or 0) > 0))
    return events
