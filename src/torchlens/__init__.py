"""torchlens: every tensor operation of a PyTorch forward pass, addressed and recorded.

``tl.trace(model, x)`` runs one forward under ``__torch_function__`` interposition and returns a
``Trace``: each op has a label (``linear_1_1:2``), a module call site (``encoder.layers.0:1``), a source
line and, if saved, its activation.  Reports and debugging tools in ``tl.report`` and ``tl.debug`` bridge
to the native PyTorch tools that own each measurement.
"""

from .capture.session import trace
from .record import (ActivationUnavailable, Buffer, GradientUnavailable, Layer, Module, ModuleCall, NestedTraceError,
                     Op, Param, TorchlensError, Trace, TraceCleanedUp)
from .validate import validate

__version__ = "0.1.0"

_LAZY = {"debug", "report", "viz", "io"}


def __getattr__(name):
    # Bridges load on first use so that `import torchlens` stays cheap.
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    if name in ("load", "extract", "load_extracted"):
        from . import io

        return getattr(io, name)
    raise AttributeError(f"module 'torchlens' has no attribute {name!r}")


__all__ = ["trace", "validate", "Trace", "Op", "Layer", "ModuleCall", "Module", "Param", "Buffer", "TorchlensError",
           "ActivationUnavailable", "TraceCleanedUp", "NestedTraceError", "GradientUnavailable", "debug", "report", "viz", "io",
           "load", "extract", "load_extracted"]
