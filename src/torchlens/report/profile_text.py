"""The printed form of a ``KernelProfile``: a header, the coverage, and the costliest ops."""

from __future__ import annotations

from ..errors import counted
from ..record.summary import aligned_lines


def _fmt_ns(ns) -> str:
    if ns is None:
        return "n/a"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e3:.1f} us"


def _fmt(value) -> str:
    return "n/a" if value is None else str(value)


def profile_text(profile, top: int = 15) -> str:
    coverage = profile.coverage
    rows = profile.ops
    mode = "borrowed profiler" if profile.borrowed else "own profiler"
    # A backward-only profile of an earlier trace measured no forward: rank by what it measured.
    backward_only = profile.backward_nodes is not None
    phases = "backward only (no forward profiled)" if backward_only else \
        "forward + backward" if profile.backward else "forward"
    # A row is a torch call (a call returning several tensors is one row): counted as print(log) counts calls.
    lines = [f"KernelProfile of {profile.trace.model_name}: {counted(len(rows), 'torch call')}, {phases}, {mode}; "
             "all times are profiler (Kineto) measurements", str(coverage)]
    if not rows:  # an empty table under "top 0 ops" reads as a profile that lost its rows
        lines.append("the forward ran no torch ops: there is nothing to rank")
        return "\n".join(lines)
    device = coverage.has_device
    key = "device_ns" if device else "cpu_ns"
    rank_key = "bwd_" + key if backward_only else key
    ranked = sorted(rows, key=lambda r: -(r[rank_key] or 0))[:top]
    header = ["op", "module", "device" if device else "self CPU", "kernels" if device else "aten ops"]
    if profile.backward:
        header.append("bwd device" if device else "bwd self CPU")
    table = [header]
    for r in ranked:
        line = [r["op"], r["module"] or "-", _fmt_ns(r[key]), _fmt(r["kernels"] if device else r["aten_ops"])]
        if profile.backward:
            line.append(_fmt_ns(r["bwd_" + key]))
        table.append(line)
    lines.append(f"top {len(ranked)} ops by {'backward ' if backward_only else ''}"
                 f"{'device time' if device else 'self CPU time'}:")
    lines += ["  " + line for line in aligned_lines(table)]
    if profile.backward:
        lines += _backward_by_module(profile, "bwd_" + key, device)
    return "\n".join(lines)


def _backward_by_module(profile, key, device, top: int = 8) -> list:
    """The module calls whose backward cost most (inclusive of nested calls)."""
    calls = sorted(profile.module_calls, key=lambda r: -(r[key] or 0))[:top]
    if not calls:
        return []
    lines = [f"top {len(calls)} module calls by backward {'device' if device else 'self CPU'} time (inclusive):"]
    lines += ["  " + line for line in aligned_lines([[r["module_call"], _fmt_ns(r[key])] for r in calls])]
    return lines
