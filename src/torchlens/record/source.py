"""Where in the user's code an op was called: ``op.source``, read from the code object and instruction
offset capture recorded for the op (``record.columns.Call``'s ``code`` and ``line``)."""

from __future__ import annotations

import linecache
from dataclasses import dataclass

from ..cache import per_object


@dataclass(frozen=True)
class SourceLocation:
    """Where in the user's code an op was called."""

    file: str
    line: int
    function: str

    @property
    def code(self) -> str:
        """The text of the calling line (read lazily from the file)."""
        return linecache.getline(self.file, self.line).strip()

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


def line_of(code, offset: int):
    """The source line of instruction ``offset`` in ``code``."""
    line = _lines(code).get(offset, _NO_LINE)
    return code.co_firstlineno if line is _NO_LINE else line


_NO_LINE = object()  # an offset outside every range of co_lines (a line may be None: no line)


@per_object
def _lines(code) -> dict:
    """``{instruction offset: its source line}`` in ``code``."""
    return {offset: line for start, end, line in code.co_lines() for offset in range(start, end, 2)}


def source_of(code, offset):
    """``SourceLocation`` for a recorded user frame, or None."""
    if code is None:
        return None
    return SourceLocation(code.co_filename, line_of(code, offset), getattr(code, "co_qualname", code.co_name))
