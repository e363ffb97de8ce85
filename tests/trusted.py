"""What a validation a user can trust looks like, for the validation tests."""

from __future__ import annotations

from torchlens.validate import RANDOM


def assert_trusted(result):
    """A faithful trace: outputs equal, every op replayed or skipped with a reason, nothing mismatched."""
    assert result.outputs_match is not False, result.outputs_differ
    assert not result.mismatched, result.mismatched
    assert result.passed and bool(result) and result.status == "passed", str(result)
    assert all(reason for _, reason in result.not_replayed)


def random_labels(result) -> set:
    return {label for label, reason in result.not_replayed if reason == RANDOM}
