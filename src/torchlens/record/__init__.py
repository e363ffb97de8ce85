"""The record model: ``Trace`` holds columns; ``Op``, ``Layer``, ``ModuleCall`` and ``Module`` are views."""

from ..errors import (ActivationUnavailable, AmbiguousKey, GradientUnavailable, InterventionError, NestedTraceError,
                      TorchlensError, TraceCleanedUp, UnmatchedSelection)
from .modules import Module, ModuleCall
from .op import Layer, Op
from .params import Buffer, Param
from .trace import Trace

__all__ = ["Trace", "Op", "Layer", "ModuleCall", "Module", "Param", "Buffer", "TorchlensError", "ActivationUnavailable",
           "TraceCleanedUp", "NestedTraceError", "InterventionError", "GradientUnavailable", "AmbiguousKey",
           "UnmatchedSelection"]
