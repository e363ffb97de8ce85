"""Progress bars for work that runs long: tracing, finalizing, validating, rendering.

A bar appears only once the work has taken about a second (``tqdm``'s ``delay``), so quick traces
print nothing.  ``progress=None`` (the default) shows bars only on an interactive terminal or in a
notebook, never into a pipe or a log file; ``True`` asks for them anywhere, ``False`` turns them off.
Bars are advanced at driver granularity (module calls, replayed ops, rendering steps), never from
the per-op capture handler.  tqdm is imported only when a bar may be shown.
"""

from __future__ import annotations

import sys

from .errors import MissingPackage

DELAY_S = 1.0
# What a refusal of a ``progress=`` other than True, False or None advises.
PROGRESS_ADVICE = ("give True to show a progress bar anywhere, False for none, or None (the default) for one on an "
                   "interactive terminal or in a notebook when tqdm is installed")


class _Quiet:
    """The bar when none is shown: every method does nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


QUIET = _Quiet()


# (stderr, IPython module, answer) of the last ``_interactive`` call: every trace asks, and the answer
# changes only when stderr is replaced or IPython is imported.
_last_answer: tuple = (None, None, False)


def _interactive() -> bool:
    global _last_answer
    stream, shell = sys.stderr, sys.modules.get("IPython")
    last = _last_answer
    if last[0] is stream and last[1] is shell and stream is not None:
        return last[2]
    answer = _ask_interactive(stream, shell)
    _last_answer = (stream, shell, answer)
    return answer


def _ask_interactive(stream, shell) -> bool:
    if getattr(stream, "isatty", None) is not None and stream.isatty():
        return True
    ipython = shell.get_ipython() if shell is not None and hasattr(shell, "get_ipython") else None
    return ipython is not None and "IPKernelApp" in getattr(ipython, "config", {})


def shows_bar(progress) -> bool:
    """Whether ``bar(progress, ...)`` may show a bar (so that a caller builds its description only then).
    An invalid ``progress`` answers True: ``bar`` refuses it."""
    return progress is not False and (progress is not None or _interactive())


def bar(progress, desc: str, total=None, unit: str = "it", *, initial: int = 0, delay: float | None = None,
        leave: bool = False):
    """A tqdm bar on stderr, or ``QUIET``; ``progress`` is the user's ``True``/``False``/``None``.  ``initial``:
    the units done before (a resumed job); ``delay`` (``DELAY_S`` when None) and ``leave`` as tqdm's (a bar
    over a long job the user started, such as ``tl.extract``'s, shows at once and stays)."""
    if progress is False or (progress is None and not _interactive()):
        return QUIET
    if progress is not None and progress is not True:
        raise TypeError(f"progress must be True, False or None (automatic), not {progress!r}")
    if sys.stderr is None:  # pythonw.exe, or an app frozen without a console: nowhere to draw a bar
        return QUIET
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:
        if progress is None:
            return QUIET  # automatic bars are a nicety: without tqdm there are none
        raise MissingPackage("progress=True needs tqdm: pip install tqdm (or pass progress=False)") from exc
    return tqdm(total=total, desc=desc, unit=unit, initial=initial,
                delay=DELAY_S if delay is None else delay, leave=leave, file=sys.stderr)
