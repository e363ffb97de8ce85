"""Debugging tools that read an existing trace: ``hot_path`` and ``nonfinite_origin``."""

from ..lazy import exports

_EXPORTS = {
    "hot_path": ".hotspots",
    "HotPath": ".hotspots",
    "nonfinite_origin": ".nonfinite",
    "NonfiniteReport": ".nonfinite",
    "DETECT_ANOMALY_RECIPE": ".nonfinite",
    "GradNonfiniteReport": ".grad_nonfinite",
}


__getattr__, __dir__ = exports(__name__, _EXPORTS)

__all__ = list(_EXPORTS)
