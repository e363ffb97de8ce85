"""What a notebook shows for a trace: the summary, a compact op table, and the viewer on demand.

A notebook renders ``_repr_html_`` every time a trace is displayed and keeps the result in the
notebook file, so the display stays small: the interactive viewer is embedded gzip-compressed and
only unpacked into an inline frame when the reader presses the button (browsers decompress natively,
``DecompressionStream``).  A viewer too large even compressed is left to ``log.show()``.
"""

from __future__ import annotations

import base64
import gzip
import html
import itertools

from ..checks import check_int
from ..errors import counted
from ..record.layouts import shape_text

BUDGET_BYTES = 240_000  # the compressed viewer; with the tables a display stays under 300 KB
_HEAD, _TAIL = 12, 4
MODULE_DEPTH = 2  # the module table's levels: a deep model's full tree would bury the op table under it
_ids = itertools.count()

_STYLE = ("font:12px monospace;border-collapse:collapse;margin:4px 0", "padding:1px 8px;text-align:left;"
          "border-bottom:1px solid #ddd")

_OPEN_SCRIPT = """<script>
async function tlOpenViewer(button, id) {
  button.disabled = true; button.textContent = "Opening the viewer...";
  const packed = atob(document.getElementById(id).textContent.trim());
  const bytes = Uint8Array.from(packed, c => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  const frame = document.createElement("iframe");
  frame.setAttribute("sandbox", "allow-scripts");
  frame.style.cssText = "width:100%;height:600px;border:1px solid #ccc";
  frame.srcdoc = await new Response(stream).text();
  button.replaceWith(frame);
}
</script>"""


def _table(header, rows) -> str:
    table_style, cell = _STYLE
    head = "".join(f'<th style="{cell}">{html.escape(h)}</th>' for h in header)
    body = "".join("<tr>" + "".join(f'<td style="{cell}">{html.escape(str(v))}</td>' for v in row) + "</tr>"
                   for row in rows)
    return f'<table style="{table_style}"><tr>{head}</tr>{body}</table>'


def _header_text(trace) -> str:
    """``print(trace)`` up to its op roster, which the op table replaces."""
    lines = str(trace).splitlines()
    return "\n".join(lines[: lines.index("Ops:")] if "Ops:" in lines else lines)


def _module_table(trace) -> str:
    from ..record.module_table import INCOMPLETE_FLOPS_NOTE, flops_text, human_count

    summary = trace.summary(depth=MODULE_DEPTH)
    rows = [(r["call"], r["class_name"], human_count(r["params"]), r["ops"], flops_text(r)) for r in summary.rows]
    table = _table(["module call", "class", "params", "ops", "FLOPs"], rows)
    if summary.rows[0]["flops_complete"] is False:  # the root's count covers every op: any '+' shows there
        table += f'<p style="font-size:12px;margin:0">FLOPs: {INCOMPLETE_FLOPS_NOTE} (a lower bound)</p>'
    cut = _deeper_calls_note(trace)
    if cut:
        table += f'<p style="font-size:12px;margin:0">{html.escape(cut)}</p>'
    return table


def _deeper_calls_note(trace) -> str:
    """Say that calls below the table's levels exist and where they are listed: a table that simply stopped read
    as a model with no deeper modules (BERT's encoder.layer.0.attention.self, four levels down)."""
    deeper = [mc.depth for mc in trace.module_calls if mc.depth >= MODULE_DEPTH]
    if not deeper:
        return ""
    return (f"{counted(len(deeper), 'deeper module call')} (down to level {max(deeper) + 1}) not listed: "
            f"log.summary() lists every call, log.summary(depth=N) the first N levels")


def _op_table(trace) -> str:
    ops = trace.ops
    shown = list(ops) if len(ops) <= _HEAD + _TAIL else list(ops[:_HEAD]) + [None] + list(ops[-_TAIL:])
    rows = []
    for op in shown:
        if op is None:
            rows.append(("...", f"{len(ops) - _HEAD - _TAIL} more ops: log.ops or log.to_pandas()", "", ""))
        else:
            shape = shape_text(op.shape)
            rows.append((op.label, op.func_name if op.kind == "op" else op.kind, shape, op.module or ""))
    return _table(["op", "function", "shape", "module call"], rows)


def check_max_ops(max_ops, who: str) -> None:
    """``max_ops`` is checked wherever it is given, even by ``show`` outside a notebook, which has no use for it:
    a wrong value must not pass there and fail only once the same call runs in a notebook."""
    if max_ops is not None:
        check_int(max_ops, "max_ops", "give the most ops drawn inline, 0 or more, or None for no limit", who=who,
                  at_least=0)


def notebook_html(trace, max_ops=None, **render_kwargs) -> str:
    from ..record.trace import checked_trace
    from . import render
    from .layout import LayoutEngineMissing, LayoutFailed

    checked_trace(trace, "notebook_html")
    check_max_ops(max_ops, "notebook_html")
    parts = [f'<pre style="font-size:12px;margin:0">{html.escape(_header_text(trace))}</pre>',
             _module_table(trace), _op_table(trace)]
    if max_ops is not None and len(trace) > max_ops:
        parts.append(f"<p><i>{len(trace)} ops: call .show() for the interactive graph, or "
                     ".render('graph.html') to write it.</i></p>")
        return "<div>" + "".join(parts) + "</div>"
    try:
        page = render(trace, None, format="html", **render_kwargs)
    except (LayoutEngineMissing, LayoutFailed) as unavailable:  # a notebook cell shows the tables and says why
        parts.append(f"<p><i>{html.escape(str(unavailable))}</i></p>")
        return "<div>" + "".join(parts) + "</div>"
    packed = base64.b64encode(gzip.compress(page.encode("utf-8"), 9)).decode("ascii")
    if len(packed) > BUDGET_BYTES:
        parts.append(f"<p><i>The interactive viewer of these {len(trace)} ops is too large to keep in a notebook "
                     "cell: call .show() to open it, or .render('graph.html') to write it.</i></p>")
        return "<div>" + "".join(parts) + "</div>"
    data_id = f"tl-viewer-{next(_ids)}"
    parts.append(f'<script type="application/octet-stream" id="{data_id}">{packed}</script>')
    parts.append(_OPEN_SCRIPT)
    parts.append(f'<button class="tl-open-viewer" onclick="tlOpenViewer(this, \'{data_id}\')">'
                 "Open the interactive viewer</button>")
    return "<div>" + "".join(parts) + "</div>"
