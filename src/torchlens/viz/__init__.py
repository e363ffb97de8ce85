"""Pictures of a trace: DOT, SVG, PNG, and a self-contained interactive HTML viewer.

``render(trace, "model.html")`` picks the format from the suffix.  The unrolled view draws every op; the
rolled view folds the passes of each op site into one node and the calls of each module into one box.
Layout is Graphviz's (``dot`` on PATH, else ``pip install torchlens[viz]``); DOT text needs no engine.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
import tempfile

from ..checks import check_file_to_write, check_int, check_path
from .layout import LayoutEngineMissing, LayoutFailed, find_engine

FORMATS = ("dot", "svg", "png", "html")
_ALSO = {"dot": "gv", "html": "htm"}  # the other name each of those formats is known by
_BY_OTHER_NAME = {other: name for name, other in _ALSO.items()}


def _named(dotted: bool = False) -> str:
    """The formats as an error lists them, each with its other suffix (``.dot (or .gv)``)."""
    dot = "." if dotted else ""
    return ", ".join(f"{dot}{f}" + (f" (or {dot}{_ALSO[f]})" if f in _ALSO else "") for f in FORMATS)


def format_of(path, fmt=None) -> str:
    """The picture format ``render`` writes: ``fmt`` when given, else the one ``path``'s suffix names."""
    if fmt is not None:
        if not isinstance(fmt, str):
            raise TypeError(f"format= takes the name of a picture format, one of {_named()}, got "
                            f"{type(fmt).__name__} {fmt!r}")
        fmt = fmt.lower().lstrip(".")
        fmt = _BY_OTHER_NAME.get(fmt, fmt)
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of {_named()}, not {fmt!r}")
        return fmt
    if path is None:
        return "dot"
    path = check_path(path, "path", "name a file (a str or a pathlib.Path) whose suffix names the format",
                      who="format_of")  # pathlib's own refusal names no parameter
    suffix = pathlib.Path(path).suffix.lower().lstrip(".")
    suffix = _BY_OTHER_NAME.get(suffix, suffix)
    if suffix not in FORMATS:
        raise ValueError(f"cannot tell the format from {str(path)!r}: use a path ending in "
                         f"{_named(dotted=True)}, or pass format=")
    return suffix


def _check(trace, depth, title):
    from ..record.trace import Trace

    if not isinstance(trace, Trace):
        raise TypeError(f"render needs a Trace from tl.trace(...), not {type(trace).__name__}")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"render: title= takes a string (the picture's heading), or None for the model's name, the "
                        f"view and the op count; got {type(title).__name__} {title!r}")
    if depth is not None:
        check_int(depth, "depth", "give a module depth, 0 or more (0 collapses every top-level module), or None to "
                  "draw every module", who="render", at_least=0)


def _coloring(trace, color_by, device_times, cpu_times):
    from .metrics import Coloring, nonfinite_origins, op_values, resolve_metric

    metric, times = resolve_metric(color_by, device_times, cpu_times)
    if metric is None:
        return None
    origins = nonfinite_origins(trace) if metric == "nonfinite" else ()
    return Coloring(metric, op_values(trace, metric, times), origins)


def render(trace, path=None, view: str = "unrolled", depth=None, color_by=None, format=None, *,
           device_times=None, cpu_times=None, title=None, progress=None, direction="TB"):
    """Draw a trace.  Returns the path written, or the content (str, or bytes for PNG) when ``path`` is None.

    ``view``: ``"unrolled"`` (one node per op) or ``"rolled"`` (one node per layer, passes folded).
    ``depth``: module calls this many levels down are collapsed into one node (0: every top-level module);
    None draws everything in static formats and picks a readable starting depth in HTML.
    ``color_by``: ``"duration"``, ``"flops"``, ``"memory"``, ``"nonfinite"``, ``"grad_norm"`` (a trace taken
    with ``grads=True``, after a backward), ``"device_time"`` (with ``device_times={op label: seconds}`` or a
    kernel profile; a mapping passed as ``color_by`` means the same) or ``"cpu_time"`` (with ``cpu_times=``, the
    same way: the profiler's self CPU time, what a CPU-only kernel profile has instead of device time).
    ``format``: ``"dot"``, ``"svg"``, ``"png"`` or ``"html"``; by default taken from the path's suffix.
    ``direction``: ``"TB"`` (data flows down, the default) or ``"LR"`` (left to right: deep models on wide
    screens).
    ``progress``: a bar over the rendering steps once they take about a second (None: on an interactive
    terminal or notebook only; True: anywhere; False: never).
    """
    from ..progress import bar

    if path is not None:  # checked now: the file is written only after the layout, which can take seconds
        path = check_file_to_write(path, "path", "name a file in an existing folder (a str or a pathlib.Path)",
                                   who="render")
    fmt = format_of(path, format)
    _check(trace, depth, title)
    with bar(progress, f"rendering {trace.model_name}", total=3, unit=" steps") as shown:
        return _render(trace, path, view, depth, color_by, fmt, (device_times, cpu_times), title, shown, direction)


def _render(trace, path, view, depth, color_by, fmt, times, title, shown, direction):
    from .dot import DotWriter
    from .graph import build_structure, project

    structure = build_structure(trace, view)
    coloring = _coloring(trace, color_by, *times)
    shown.update()
    if fmt == "html":
        from .html import html_page
        from .records import RecordBuilder

        content = html_page(trace, structure, coloring, RecordBuilder(trace, coloring), depth, title, direction)
    else:
        writer = DotWriter(trace, structure, coloring, direction)
        heading = title or f"{trace.model_name} ({view}, {len(trace)} ops)"
        dot = writer.write(project(structure, -1, depth), heading, coloring.legend() if coloring else None)
        shown.update()
        if fmt == "dot":
            content = dot
        else:
            from .layout import layout

            content = layout([dot], fmt)[0]
            if fmt == "svg":
                content = content.decode("utf-8")
    shown.update()
    if path is None:
        return content
    path = pathlib.Path(path)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    ipython = shell.get_ipython() if hasattr(shell, "get_ipython") else None
    return ipython is not None and "IPKernelApp" in getattr(ipython, "config", {})


def show(trace, **kwargs):
    """Open the interactive view: inline in Jupyter, else in the default web browser (a temp HTML file);
    where no browser can open (no display), say where the file is.  Returns the file's path (None inline)."""
    # Either way the viewer is HTML: format= may say so (or be None), and is not passed on, since both ways
    # name the format themselves.  DOT or SVG text in the viewer's page is no viewer.
    from ..record.trace import checked_trace
    from .notebook import check_max_ops

    checked_trace(trace, "show")  # before its name is read for the file's
    _check_viewer_options("show", "opens", kwargs, takes="render's options ({}) and max_ops in a notebook")
    check_max_ops(kwargs.get("max_ops"), "show")
    if _in_notebook():
        from IPython.display import HTML, display

        display(HTML(notebook_html(trace, **kwargs)))
        return None
    import webbrowser

    kwargs.pop("max_ops", None)  # how much a notebook cell draws inline: the browser's page draws it all
    handle, name = tempfile.mkstemp(prefix=f"torchlens_{_file_name_part(trace.model_name)}_", suffix=".html")
    os.close(handle)
    try:
        path = render(trace, name, **kwargs)
    except BaseException:  # a refused argument or a missing layout engine leaves no empty file behind
        os.remove(name)
        raise
    if not _has_display() or not webbrowser.open(path.resolve().as_uri()):
        print(f"torchlens: no browser could be opened here; the viewer is at {path} (open it where a browser "
              "runs)", file=sys.stderr)
    return path


def _file_name_part(name: str) -> str:
    """``name`` (a model name such as ``facebook/opt-125m``) as part of a file name on any system: a separator
    would name a folder that does not exist, and Windows refuses ``: * ? " < > |`` in file names."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60]


def _has_display() -> bool:
    """False on a Linux machine with no graphical session (a server, a container, ssh without -X)."""
    if not sys.platform.startswith("linux"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _check_viewer_options(who: str, does: str, kwargs: dict, takes: str) -> None:
    """Refuse an option of the viewer ``who`` draws that it does not take by its own name (render's would name
    render, which the user did not call): render's options but ``path``, and ``max_ops`` for a notebook's inline
    drawing.  ``format=`` may only say HTML, and is taken out of ``kwargs``: the viewer names its format itself."""
    from ..errors import refuse_unknown_keywords

    refuse_unknown_keywords(who, kwargs, render, also=("max_ops",), takes=takes)
    shown_format = kwargs.pop("format", None)
    if shown_format is not None and format_of(None, shown_format) != "html":
        raise ValueError(f"{who} {does} the interactive HTML viewer, not format={shown_format!r}; write that "
                         "format with render(path, format=...)")


def notebook_html(trace, max_ops=None, **kwargs) -> str:
    """The trace's summary, module and op tables, and the viewer packed for opening on demand; ``kwargs`` are
    render's options for that viewer."""
    from .notebook import notebook_html as page

    _check_viewer_options("notebook_html", "packs", kwargs, takes="max_ops and render's options ({})")
    return page(trace, max_ops=max_ops, **kwargs)


def heatmap(frame, path=None, value: str = "normalized", title: str | None = None):
    """A patching table (``tl.report.activation_patching`` or ``attribution_patching``) as an SVG heatmap, a row
    per site and a column per position: ``value`` names the column drawn, ``title`` the heading (``value`` by
    default).  Written to ``path`` (an ``.svg`` file) when given, and the path returned; the SVG text otherwise
    (``viz/heatmaps.py``)."""
    from .heatmaps import heatmap as draw  # a submodule named heatmap would shadow this function

    return draw(frame, path, value=value, title=title)


__all__ = ["render", "show", "notebook_html", "format_of", "find_engine", "LayoutEngineMissing", "LayoutFailed",
           "FORMATS", "heatmap"]
