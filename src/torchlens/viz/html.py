"""The self-contained interactive HTML viewer: laid-out SVG pictures, the records, and our own script.

A big model is not drawn as one picture.  The first picture shows the model collapsed at the deepest
module level that keeps it under ``BUDGET`` nodes; every module it collapses gets a picture of its own
inside, built the same way, so opening a module is switching pictures and never needs a layout in the
browser.  Each op is drawn in exactly one picture, which keeps the file linear in the trace's size.
Pictures sit in the page as inert text and only the one being looked at is parsed into the DOM, which is
what makes a large trace open quickly.  The page loads nothing from the network.
"""

from __future__ import annotations

import html
import json
import re
from collections import deque
from importlib import resources

from .dot import BUDGET, CHANGED, KIND_FILL, DotWriter
from .graph import auto_depth, project
from .layout import layout

_SVG_START = re.compile(rb"<svg\b")


def build_pictures(structure, depth=None, budget: int = BUDGET) -> list:
    """``[(picture, parent picture index)]``: the first is the whole model, then one per collapsed module."""
    first_depth = depth if depth is not None else auto_depth(structure, -1, budget)
    pending = deque([(-1, first_depth, None)])  # breadth first: a parent's picture precedes its children's
    pictures = []
    while pending:
        focus, level, parent = pending.popleft()
        picture = project(structure, focus, level)
        index = len(pictures)
        pictures.append((picture, parent))
        for g in picture.collapsed:
            pending.append((g, auto_depth(structure, g, budget), index))
    return pictures


def _svg_body(svg: bytes) -> str:
    """The ``<svg>`` element alone: no XML prolog, doctype or comments."""
    match = _SVG_START.search(svg)
    text = svg[match.start():].decode("utf-8") if match else svg.decode("utf-8")
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return text.replace("</script", "&lt;/script")


def _asset(name: str) -> str:
    return resources.files("torchlens.viz").joinpath("assets", name).read_text(encoding="utf-8")


def page_data(trace, structure, pictures, records, coloring) -> dict:
    groups, items = structure.groups, structure.items
    where, opens, views = {}, {}, []
    for index, (picture, parent) in enumerate(pictures):
        for i in picture.items:
            where[items[i].key] = index
        for g in picture.collapsed + picture.clusters:
            where.setdefault(groups[g].key, index)
        if picture.focus >= 0:
            opens[groups[picture.focus].key] = index
        crumb = []
        g = picture.focus
        while g >= 0:
            crumb.append(groups[g].key)
            g = groups[g].parent
        views.append({"focus": groups[picture.focus].key if picture.focus >= 0 else None, "parent": parent,
                      "crumb": list(reversed(crumb)), "items": len(picture.items),
                      "modules": len(picture.collapsed)})
    item_records = {}
    for item in items:
        rec = records.layer_record(item) if structure.view == "rolled" else records.op_record(trace.ops[item.ops[0]])
        item_records[item.key] = rec
    group_records = {}
    for group in groups:
        group_records[group.key] = records.group_record(group)
    search = [[item.label, item.key] for item in items]
    # A group no picture draws (in the rolled view, a module's calls from a second position, drawn in its first:
    # a module that calls itself) would be a search result that goes nowhere when chosen.
    search += [[group.label, group.key] for group in groups if group.key in where]
    return {"model": trace.model_name, "view": structure.view, "ops": len(trace), "items": item_records,
            "groups": group_records, "titles": {g.key: f"{g.label} ({g.class_name})" for g in groups},
            "where": where, "opens": opens, "views": views, "search": search,
            "legend": coloring.legend() if coloring is not None else None}


def legend_html(coloring, changed=False, notes=()) -> str:
    kinds = [("input", "input"), ("output", "output"), ("buffer", "buffer"), ("op", "op"),
             ("param_op", "op using parameters (bold border)"), ("module", "collapsed module: double-click to open"),
             ("ref", "node drawn in another picture: click to go there")]
    rows = [f'<div class="tl-key"><span class="tl-swatch" style="background:{KIND_FILL[k]}"></span>'
            f"{html.escape(t)}</div>" for k, t in kinds]
    if changed:
        rows.append(f'<div class="tl-key"><span class="tl-swatch" style="border:2px solid {CHANGED}"></span>'
                    "changed by an intervention (red border)</div>")
    out = '<div class="tl-legend-kinds">' + "".join(rows) + "</div>"
    out += "".join(f'<div class="tl-legend-note">{html.escape(note)}</div>' for note in notes)  # what no node shows
    if coloring is not None:
        legend = coloring.legend()
        out += f'<div class="tl-legend-title">{html.escape(legend["title"])}</div>'
        out += f'<div class="tl-legend-note">{html.escape(legend["note"])}</div>'
        out += "".join(f'<div class="tl-key"><span class="tl-swatch" style="background:{c}"></span>'
                       f"{html.escape(t)}</div>" for c, t in legend["entries"])
    return out


def html_page(trace, structure, coloring, records, depth=None, title=None, direction="TB") -> str:
    pictures = build_pictures(structure, depth)
    writer = DotWriter(trace, structure, coloring, direction)
    svgs = layout([writer.write(picture) for picture, _ in pictures], "svg")
    data = page_data(trace, structure, pictures, records, coloring)
    # A multi-output call's further outputs are ports of its first output's node: find them there.
    data["alias"] = {key: node for picture, _ in pictures for key, (node, _) in writer.port_aliases(picture).items()
                     if key != node}
    title = title or f"{trace.model_name} \u2014 torchlens ({structure.view})"
    summary = str(trace).split("\nOps:")[0]
    view_blocks = "\n".join(f'<script type="text/x-tl-svg" id="tl-view-{i}">{_svg_body(svg)}</script>'
                            for i, svg in enumerate(svgs))
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{_asset("viewer.css")}</style>
</head><body>
<div id="tl-app">
<header id="tl-bar">
  <span id="tl-title" title="{html.escape(summary)}">{html.escape(title)}</span>
  <nav id="tl-crumbs" aria-label="module path"></nav>
  <span id="tl-tools">
    <button id="tl-up" type="button" title="collapse: back to the enclosing module (u)">&#8593; Up</button>
    <button id="tl-fit" type="button" title="fit at a readable size (f); the whole picture (w)">Fit</button>
    <input id="tl-search" type="search" placeholder="Search labels (/)" autocomplete="off" spellcheck="false">
  </span>
  <ul id="tl-results" hidden></ul>
</header>
<main id="tl-canvas" tabindex="0"></main>
<aside id="tl-panel"><div id="tl-panel-body"><p class="tl-hint">Click a node for its record.
Double-click a module box to open it.</p><pre class="tl-summary">{html.escape(summary)}</pre></div></aside>
<section id="tl-legend">{legend_html(coloring, bool(writer.changed), writer.notes())}</section>
</div>
<script type="application/json" id="tl-data">{payload}</script>
{view_blocks}
<script>{_asset("viewer.js")}</script>
</body></html>
"""
