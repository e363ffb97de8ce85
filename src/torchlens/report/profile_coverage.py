"""How much of what the profiler measured the join could attribute, what it could not, and why.

Device coverage is measured on busy time: the union of device event intervals per device, so
overlapping kernels (several streams) count once.  Per-op device sums can exceed busy time for the
same reason; both are reported.  Host coverage is over self CPU time of every aten op and runtime call
the profiler recorded.  Nothing unmeasured is reported as 0: a device figure is ``None`` when no device
activity was recorded.
"""

from __future__ import annotations

from .profile_join import REASONS, union_ns


def _ms(ns) -> str:
    return "n/a" if ns is None else f"{ns / 1e6:.3f} ms"


def _pct(part, whole) -> str:
    return "n/a" if part is None or not whole else f"{100.0 * part / whole:.1f}%"


class Coverage:
    """Attributed versus not, for host aten time and (when recorded) device busy time."""

    def __init__(self, joined, problems: list):
        self.host_ns = joined.host_total[1]
        self.host_events = joined.host_total[0]
        self.host_attributed_ns = joined.host_attributed[1]
        self.host_unattributed = {k: tuple(v) for k, v in joined.host_unattributed.items()}
        self.device_events = joined.device_events
        self.devices = {}
        for device, intervals in sorted(joined.device_intervals.items()):
            attributed = joined.attributed_intervals.get(device, [])
            self.devices[device] = {
                "busy_ns": union_ns(intervals),
                "attributed_ns": union_ns(attributed),
                "sum_ns": sum(e - s for s, e in intervals),
                "attributed_sum_ns": sum(e - s for s, e in attributed),
                "events": len(intervals),
                "attributed_events": len(attributed),
            }
        self.device_unattributed = {k: tuple(v) for k, v in joined.device_unattributed.items()}
        self.profiler_overhead = tuple(joined.profiler_overhead)  # (events, ns), not device work
        self.device_via_external_id = joined.device_via_external_id
        self.problems = list(problems)

    @property
    def complete(self) -> bool:
        """True when every marker was found once and every device event was linked to its launch."""
        return not self.problems

    @property
    def has_device(self) -> bool:
        return self.device_events > 0

    @property
    def device_busy_ns(self):
        """Device busy time summed over devices (None when no device activity was recorded)."""
        if not self.devices:
            return None
        return sum(d["busy_ns"] for d in self.devices.values())

    @property
    def device_attributed_ns(self):
        if not self.devices:
            return None
        return sum(d["attributed_ns"] for d in self.devices.values())

    @property
    def device_fraction(self):
        """Attributed share of device busy time (to ops or module calls), or None without device data."""
        busy = self.device_busy_ns
        return None if not busy else self.device_attributed_ns / busy

    def to_dict(self) -> dict:
        return {
            "complete": self.complete,
            "problems": self.problems,
            "host_ns": self.host_ns,
            "host_events": self.host_events,
            "host_attributed_ns": self.host_attributed_ns,
            "host_unattributed": {k: {"events": v[0], "ns": v[1], "why": REASONS.get(k, k)}
                                  for k, v in self.host_unattributed.items()},
            "devices": self.devices,
            "device_unattributed": {k: {"events": v[0], "ns": v[1], "why": REASONS.get(k, k)}
                                    for k, v in self.device_unattributed.items()},
            "profiler_overhead": {"events": self.profiler_overhead[0], "ns": self.profiler_overhead[1]},
            "device_via_external_id": self.device_via_external_id,
        }

    def __str__(self) -> str:
        lines = []
        if self.devices:
            for device, d in self.devices.items():
                lines.append(f"device {device}: busy {_ms(d['busy_ns'])} over {d['events']} events; "
                             f"attributed {_ms(d['attributed_ns'])} ({_pct(d['attributed_ns'], d['busy_ns'])})"
                             f"; per-event sum {_ms(d['sum_ns'])}"
                             + (" (overlapping work: sums exceed busy time)" if d["sum_ns"] > d["busy_ns"] else ""))
        else:
            lines.append("device: no device activity recorded (CPU-only run); device columns are n/a")
        lines.append(f"host: {_ms(self.host_ns)} self CPU over {self.host_events} aten/runtime events; "
                     f"on captured ops {_ms(self.host_attributed_ns)} ({_pct(self.host_attributed_ns, self.host_ns)})")
        for title, table in (("host", self.host_unattributed), ("device", self.device_unattributed)):
            for reason, (events, ns) in sorted(table.items(), key=lambda kv: -kv[1][1]):
                lines.append(f"  not on an op ({title}): {events} events, {_ms(ns)}: {REASONS.get(reason, reason)}")
        if self.device_via_external_id:
            lines.append(f"  {self.device_via_external_id} device events had no runtime event with their "
                         "correlation id and were linked by the External id of their launching op")
        if self.profiler_overhead[0]:
            lines.append(f"  profiler overhead (its own work, in neither figure): {self.profiler_overhead[0]} "
                         f"events, {_ms(self.profiler_overhead[1])}")
        if self.problems:
            lines.append("join INCOMPLETE:")
            lines.extend(f"  - {p}" for p in self.problems)
        else:
            lines.append("join complete: every marker found once" +
                         (", every device event linked to its launch" if self.devices else ""))
        return "\n".join(lines)


def find_problems(joined, num_modules: int, serial_of_call: dict) -> list:
    """Reasons the join is incomplete (empty when it is complete)."""
    problems = []
    counts = joined.marker_counts
    serials = list(serial_of_call.values())
    missing = sum(1 for s in serials if counts.get(("op", s), 0) == 0)
    doubled = sum(1 for s in serials if counts.get(("op", s), 0) > 1)
    if missing:
        problems.append(f"{missing} of {len(serials)} op markers are missing from the profiler's results: "
                        "the profiler was not recording during the forward (with a schedule, run the "
                        "profile in a recorded step); those ops show n/a")
    if doubled:
        problems.append(f"{doubled} op markers appear more than once in the profiler's results")
    missing_modules = sum(1 for m in range(num_modules) if counts.get(("module", m), 0) != 1)
    if missing_modules and not missing:
        problems.append(f"{missing_modules} of {num_modules} module call markers are missing or repeated: "
                        "work inside those module calls but outside their ops is not measured")
    for reason in ("no_launch_event", "no_correlation"):
        if reason in joined.device_unattributed:
            events, ns = joined.device_unattributed[reason]
            problems.append(f"{events} device events ({_ms(ns)}) could not be linked to a launch: "
                            f"{REASONS[reason]}")
    if joined.nesting_violations:
        problems.append(f"{joined.nesting_violations} host events overlap their enclosing range without nesting "
                        "(timestamps from another clock?)")
    return problems
