"""Errors torchlens raises on purpose, each saying what went wrong and what to do."""


class TorchlensError(Exception):
    """Base class for torchlens's own errors."""


class ActivationUnavailable(TorchlensError):
    """An activation was asked for that the trace does not hold (cleaned up or dropped)."""


class TraceCleanedUp(TorchlensError):
    """Data released by ``Trace.cleanup()`` was asked for."""


class NestedTraceError(TorchlensError):
    """``tl.trace`` was called from inside a traced forward."""


class GradientUnavailable(TorchlensError):
    """A gradient was asked for that autograd never computes or the trace was not set up to receive."""
