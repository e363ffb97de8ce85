"""Private observability tools: the paired-ratio overhead harness behind every published overhead figure."""

from .overhead import OverheadResult, RefusalPredicate, machine_fingerprint, measure_overhead, same_output

__all__ = ["measure_overhead", "RefusalPredicate", "OverheadResult", "same_output", "machine_fingerprint"]
