"""Debugging tools that read an existing trace: ``hot_path`` and ``nonfinite_origin``."""

import importlib

_EXPORTS = {
    "hot_path": ".hotspots",
    "HotPath": ".hotspots",
    "nonfinite_origin": ".nonfinite",
    "NonfiniteReport": ".nonfinite",
    "DETECT_ANOMALY_RECIPE": ".nonfinite",
    "GradNonfiniteReport": ".grad_nonfinite",
}


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchlens.debug' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))  # lazy names listed without importing them


__all__ = list(_EXPORTS)
