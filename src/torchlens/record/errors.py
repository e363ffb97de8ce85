"""Errors torchlens raises on purpose, each saying what went wrong and what to do."""


class TorchlensError(Exception):
    """Base class for torchlens's own errors."""


class ActivationUnavailable(TorchlensError):
    """An activation was asked for that the trace does not hold (cleaned up or dropped)."""


class TraceCleanedUp(TorchlensError):
    """Data released by ``Trace.cleanup()`` was asked for."""


class NestedTraceError(TorchlensError):
    """``tl.trace`` was called from inside a traced forward."""


class UnmatchedSelection(TorchlensError, KeyError):
    """A ``save=`` entry named nothing in the trace (a ``KeyError`` naming the closest labels)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InterventionError(TorchlensError):
    """An intervention could not be applied faithfully (its site was not reached, the forward took
    another path than the reference trace, or an action returned an unusable value)."""


class GradientUnavailable(TorchlensError):
    """A gradient was asked for that autograd never computes or the trace was not set up to receive."""
