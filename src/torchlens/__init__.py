"""torchlens: every tensor operation of a PyTorch forward pass, addressed and recorded.

``tl.trace(model, x)`` runs one forward under ``__torch_function__`` interposition and returns a
``Trace``: each op has a label (``linear_1_1:2``), a module call site (``encoder.layers.0:1``), a source
line and, if saved, its activation.  Reports and debugging tools in ``tl.report`` and ``tl.debug`` bridge
to the native PyTorch tools that own each measurement.
"""

from .capture.session import trace
from .intervene import clamp, mean_ablate, noise, patch_from, scale, steer, zero_ablate
from .record import (ActivationUnavailable, AmbiguousKey, Buffer, GradientUnavailable, InterventionError, Layer, Module,
                     ModuleCall, NestedTraceError, Op, Param, TorchlensError, Trace, TraceCleanedUp, UnmatchedSelection)
from .validate import validate

__version__ = "0.1.0"

_LAZY_MODULES = {"debug", "report", "viz", "io", "distributed"}
_LAZY_NAMES = {"load": ".io", "extract": ".io", "load_extracted": ".io", "log_forward_pass": ".compat"}


def __getattr__(name):
    # Bridges load on first use so that `import torchlens` stays cheap.
    import importlib

    if name in _LAZY_MODULES:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name], __name__), name)
    raise AttributeError(f"module 'torchlens' has no attribute {name!r}")


def __dir__():
    # The lazy names are listed without importing them.
    return sorted(set(globals()) | _LAZY_MODULES | set(_LAZY_NAMES))


__all__ = ["trace", "validate", "Trace", "Op", "Layer", "ModuleCall", "Module", "Param", "Buffer", "TorchlensError",
           "ActivationUnavailable", "TraceCleanedUp", "NestedTraceError", "GradientUnavailable", "debug", "report",
           "viz", "io", "distributed", "load", "extract", "load_extracted", "log_forward_pass", "InterventionError",
           "AmbiguousKey", "UnmatchedSelection", "zero_ablate", "mean_ablate", "patch_from", "steer", "scale", "clamp",
           "noise"]
