"""A patching table as a heatmap: one row per site, one column per position, as a standalone SVG.

Written directly as SVG (no plotting library): cells are coloured on a diverging scale centred on 0,
blue for negative and red for positive values, saturated at the largest finite magnitude in the table; a
missing value (NaN: a site that could not be patched, or a metric that was NaN) is grey, and its tooltip says
which.
"""

from __future__ import annotations

import math
import numbers
from html import escape

from ..checks import check_file_to_write

_CELL, _ROW_LABEL_CHARS, _FONT = 22, 7, 11
MISSING = "#dddddd"


def heatmap(frame, path=None, value: str = "normalized", title: str | None = None):
    """SVG text of ``frame`` (from ``tl.report.activation_patching`` or ``attribution_patching``): rows are
    its ``site`` values in order, columns its ``position`` values (one column without that column), cells
    ``frame[value]``.  Written to ``path`` when given (and the path returned)."""
    _check_table(frame, value, title)
    if path is not None:
        path = _checked_svg_path(path)
    sites = list(dict.fromkeys(frame["site"]))
    # A site with no positions (no such dimension in its value) has one row at <NA>: a row of grey cells.
    positions = [p for p in dict.fromkeys(frame["position"]) if isinstance(p, numbers.Integral)] \
        if "position" in frame else [None]
    cells, reasons = {}, {}
    for row in frame.itertuples(index=False):
        position = getattr(row, "position", None) if positions != [None] else None
        cells[(row.site, position)] = float(getattr(row, value))
        # Why a row has no number, where the table says: activation patching's error, attribution's note.
        reasons[(row.site, position)] = getattr(row, "error", "") or getattr(row, "note", "")
    # Saturated at the largest finite magnitude: an infinite one (a log-probability of 0) drawn as the scale would
    # draw every finite cell white, and itself as inf / inf, NaN, of no side.  It saturates on its own side instead.
    finite = [abs(v) for v in cells.values() if math.isfinite(v)]
    scale = max(finite, default=1.0) or 1.0
    left = _ROW_LABEL_CHARS * max((len(str(s)) for s in sites), default=4) + 10
    top = 40
    width = left + _CELL * len(positions) + 20
    height = top + _CELL * len(sites) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="monospace" font-size="{_FONT}">',
             f'<text x="4" y="14">{escape(title or value)} (blue &lt; 0 &lt; red, |max| = {scale:.3g})</text>']
    for j, position in enumerate(positions):
        if position is not None:
            parts.append(f'<text x="{left + j * _CELL + _CELL / 2}" y="{top - 6}" text-anchor="middle">'
                         f'{escape(str(position))}</text>')
    for i, site in enumerate(sites):
        y = top + i * _CELL
        parts.append(f'<text x="{left - 6}" y="{y + _CELL * 0.7}" text-anchor="end">{escape(str(site))}</text>')
        for j, position in enumerate(positions):
            v = cells.get((site, position), math.nan)
            fill = MISSING if math.isnan(v) else _color(v / scale)
            shown = f"{v:.4g}" if not math.isnan(v) else _no_number(reasons.get((site, position)))
            where = f" position {position}" if position is not None else ""
            parts.append(f'<rect x="{left + j * _CELL}" y="{y}" width="{_CELL}" height="{_CELL}" fill="{fill}" '
                         f'stroke="white"><title>{escape(str(site))}{where}: {escape(shown)}</title></rect>')
    parts.append("</svg>")
    svg = "\n".join(parts)
    if path is None:
        return svg
    path.write_text(svg, encoding="utf-8")
    return path


def _no_number(reason) -> str:
    """The tooltip of a NaN cell: why the table has no number there, where it says (a site that could not be
    patched); NaN itself where the row holds no reason (a metric that was NaN on the patched run); no row at all, a
    position the site's value does not have, was not patched."""
    if reason is None:
        return "not patched"
    return str(reason) if reason else "nan"


def _checked_svg_path(path):
    """``path`` as a ``pathlib.Path`` to write the SVG to: a file that can be written, named ``.svg`` (the text
    is SVG whatever the name says: a ``.png`` would hold no PNG)."""
    import pathlib

    advice = "name an .svg file in an existing folder (a str or a pathlib.Path)"
    path = pathlib.Path(check_file_to_write(path, "path", advice, who="heatmap"))
    if path.suffix.lower() != ".svg":
        raise ValueError(f"heatmap: path={str(path)!r} does not end in .svg, but a heatmap is written as SVG text; "
                         f"{advice}, or leave path out for the SVG text")
    return path


def _check_table(frame, value, title) -> None:
    """What the picture reads, checked first: another object failed on a missing attribute, and a column
    that is no number (``value="error"``) on a float conversion of its first cell."""
    columns = list(getattr(frame, "columns", ()))
    if not hasattr(frame, "itertuples") or "site" not in columns:
        raise TypeError(f"heatmap takes the table tl.report.activation_patching or attribution_patching returns (a "
                        f"DataFrame with a site column), got {type(frame).__name__}")
    numeric = [c for c in columns if c not in ("site", "position") and _is_numeric(frame[c])]
    if value not in numeric:
        raise ValueError(f"heatmap: value={value!r} is not a column of numbers in this table; give one of "
                         f"{', '.join(map(repr, numeric))}")
    if title is not None and not isinstance(title, str):
        raise TypeError(f"heatmap: title= takes a string, got {type(title).__name__} {title!r}")


def _is_numeric(column) -> bool:
    import pandas as pd  # the table is a DataFrame: pandas is there

    return pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column)


def _color(x: float) -> str:
    """White at 0, red towards +1, blue towards -1."""
    x = max(-1.0, min(1.0, x))
    fade = int(round(255 * (1 - abs(x))))
    return f"#ff{fade:02x}{fade:02x}" if x >= 0 else f"#{fade:02x}{fade:02x}ff"
