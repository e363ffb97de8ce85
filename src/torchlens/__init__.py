"""torchlens: every tensor operation of a PyTorch forward pass, addressed and recorded.

``tl.trace(model, x)`` runs one forward under ``__torch_function__`` interposition and returns a
``Trace``: each op has a label (``linear_1_1:2``), a module call site (``encoder.layers.0:1``), a source
line and, if saved, its activation.  Reports and debugging tools in ``tl.report`` and ``tl.debug`` bridge
to the native PyTorch tools that own each measurement.
"""

from .capture.session import trace
from .intervene import clamp, mean_ablate, noise, patch_from, scale, steer, zero_ablate
from .lazy import exports
from .record import (ActivationUnavailable, AmbiguousKey, Buffer, GradientUnavailable, InterventionError, Layer, Module,
                     ModuleCall, NestedTraceError, Op, Param, TorchlensError, Trace, TraceCleanedUp, UnmatchedSelection)
from .validate import validate

__version__ = "0.1.0"

# Bridges load on first use, so that `import torchlens` stays cheap.
_LAZY = {"debug": (".debug", None), "report": (".report", None), "viz": (".viz", None), "io": (".io", None),
         "distributed": (".distributed", None), "load": ".io", "extract": ".io", "load_extracted": ".io",
         "log_forward_pass": ".compat"}
__getattr__, __dir__ = exports(__name__, _LAZY)

__all__ = ["trace", "validate", "Trace", "Op", "Layer", "ModuleCall", "Module", "Param", "Buffer", "TorchlensError",
           "ActivationUnavailable", "TraceCleanedUp", "NestedTraceError", "GradientUnavailable", "debug", "report",
           "viz", "io", "distributed", "load", "extract", "load_extracted", "log_forward_pass", "InterventionError",
           "AmbiguousKey", "UnmatchedSelection", "zero_ablate", "mean_ablate", "patch_from", "steer", "scale", "clamp",
           "noise"]
