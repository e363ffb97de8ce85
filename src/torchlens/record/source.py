"""Where in the user's code an op was called: ``op.source``, read from the code object and instruction
offset capture recorded for the op (``record.columns.Call``'s ``code`` and ``line``)."""

from __future__ import annotations

import __future__
import functools
import linecache
import operator
import warnings
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

from ..cache import per_object


@dataclass(frozen=True)
class SourceLocation:
    """Where in the user's code an op was called."""

    file: str
    line: int
    function: str
    compiled: Any = field(default=None, compare=False, repr=False)  # the code that ran, to check the file against

    @property
    def code(self) -> str:
        """The text of the calling line, read from the file when asked; '' when it cannot be read, or when the
        file's text no longer compiles to the code that ran (edited or deleted since, or code made from a string
        under the file's name): its line there would be another line than the one that ran."""
        return line_text(self.compiled, self.file, self.line)

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"

    def __reduce__(self):
        # A code object does not pickle: a copy reads its line unchecked, as a saved trace's location does.
        return SourceLocation, (self.file, self.line, self.function)


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
    return SourceLocation(code.co_filename, line_of(code, offset), getattr(code, "co_qualname", code.co_name), code)


def line_text(code, file: str, line: int) -> str:
    """Line ``line`` of ``file`` as linecache holds it, when that text compiles to ``code``; else the file read
    again (linecache keeps a file's text until told it changed), checked the same way; '' when neither is the
    text ``code`` was compiled from.  A saved trace's stand-in for code has nothing to check against: its line
    is read from the file as it is now."""
    if type(code) is not CodeType:
        linecache.checkcache(file)
        return linecache.getline(file, line).strip()
    for reread in (False, True):
        if reread:
            linecache.checkcache(file)
        lines = linecache.getlines(file)
        if lines and code in _compiled(file, lines, code.co_flags & _FUTURE_FLAGS).get(_key(code), ()):
            return lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return ""


# The flags a ``from __future__`` import sets: every code a compilation makes carries them in its co_flags.
_FUTURE_FLAGS = functools.reduce(operator.or_, (getattr(__future__, name).compiler_flag
                                                for name in __future__.all_feature_names))


def _key(code) -> tuple:
    return code.co_qualname, code.co_firstlineno


_COMPILED: dict = {}  # (file, future flags) -> (linecache's list of its lines, what they compile to)


def _compiled(file: str, lines: list, flags: int) -> dict:
    """``{(qualified name, first line): [code, ...]}`` of every code object ``lines`` compile to (code objects
    compare equal when their instructions, constants, names and line and column tables are), {} when they do
    not compile.  Kept per file while linecache keeps the same list: a file read again is compiled again."""
    entry = _COMPILED.get((file, flags))
    if entry is not None and entry[0] is lines:
        return entry[1]
    try:
        with warnings.catch_warnings():  # an invalid escape sequence in the file warned once, at its import
            warnings.simplefilter("ignore")
            pending = [compile("".join(lines), file, "exec", flags=flags, dont_inherit=True)]
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        pending = []
    found: dict = {}
    while pending:
        code = pending.pop()
        found.setdefault(_key(code), []).append(code)
        pending.extend(c for c in code.co_consts if type(c) is CodeType)
    _COMPILED[(file, flags)] = lines, found
    return found
