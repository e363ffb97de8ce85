"""The record's errors, re-exported from ``torchlens.errors`` (their one home) for compatibility."""

from ..errors import (ActivationUnavailable, GradientUnavailable, InterventionError, NestedTraceError,  # noqa: F401
                      TorchlensError, TraceCleanedUp, UnmatchedSelection)
