"""Where in the user's code an op was called: ``op.source``, read from the code object and instruction
offset capture recorded for the op (``record.columns.Call``'s ``code`` and ``line``)."""

from __future__ import annotations

import functools
import linecache
from dataclasses import dataclass


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


@functools.lru_cache(maxsize=65536)
def line_of(code, offset: int):
    """The source line of instruction ``offset`` in ``code``."""
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return line
    return code.co_firstlineno


def source_of(code, offset):
    """``SourceLocation`` for a recorded user frame, or None."""
    if code is None:
        return None
    return SourceLocation(code.co_filename, line_of(code, offset), getattr(code, "co_qualname", code.co_name))
