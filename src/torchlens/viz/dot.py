"""DOT text for one picture: ops as nodes, module calls as nested clusters, data flow as edges.

Writing DOT needs no layout engine, so ``render(path="graph.dot")`` always works.  Node ids are the item
keys (``o12`` an op, ``l12`` a layer, ``m3`` a collapsed module, ``ro12`` a reference to a node drawn in
another picture); the interactive viewer finds its records by them in the laid-out SVG.

Kinds stay distinguishable whatever the fill colour: inputs are green ovals, outputs double ovals,
buffers cylinders, ops that use parameters bold boxes, collapsed modules 3-D boxes.

A torch call that returned several tensors (``nn.LSTM``: output, h, c) is drawn once, on its first
output's node, with one port per output; edges leave from the port of the output they carry, and the
other outputs' keys resolve to that node (``port_aliases``).
"""

from __future__ import annotations

import re

from .graph import edge_pass_label, items_inside, pass_ranges
from .metrics import SUMMED_METRICS, aggregate, format_value
from ..errors import counted, listed
from ..record.columns import Kind
from ..record.layouts import shape_text
from ..record.modules import rolled_up

FONT = "Helvetica"
DIRECTIONS = ("TB", "LR")  # data flows down the page, or across it (wide screens, deep models)
_KIND_STYLE = {
    "input": 'shape=ellipse, style=filled, color="#2e7d32"',
    "output": 'shape=ellipse, peripheries=2, style=filled, color="#1f4e9c"',
    "buffer": 'shape=cylinder, style=filled, color="#8a6d00"',
    "op": 'shape=box, style="rounded,filled", color="#444444"',
    "param_op": 'shape=box, style="rounded,filled,bold", color="#222222"',
    "module": 'shape=box3d, style=filled, color="#5b3f8c"',
    "ref": 'shape=note, style="dashed,filled", color="#999999", fontcolor="#666666"',
}
KIND_FILL = {"input": "#c8ecc8", "output": "#cfe0fa", "buffer": "#fff2c2", "op": "#ffffff", "param_op": "#e6e6e6",
             "module": "#e8e0f5", "ref": "#fafafa"}
# An op whose output an intervention replaced, and a collapsed module holding one: a thick red border over
# whatever the kind or the colouring says, since its value is no longer the one the op made.
CHANGED = "#c62828"
_BORDER = re.compile(r'(?<!font)color="[^"]*"')
# The nodes a picture of the HTML viewer is kept within when modules can be collapsed.  Past it Graphviz's
# network simplex, which places the nodes of each layer and by default iterates until the placement is optimal,
# ran for minutes on a picture whose edges span many layers (a 130-step loop's input, read at every step): a
# larger picture stops after one iteration per node (``nslimit=1``), a less tidy placement laid out in seconds.
BUDGET = 250
# Within the budget the same shape still took seconds (a 60-step loop collapsed to depth 0, 243 nodes: 37 s with
# Graphviz 2.43), so every picture is bounded: ten iterations per node, more than the pictures of common models
# need to reach the optimum (159 of 160 come out as unbounded: benchmarks/viz_layout_bound.py), far fewer than
# such a loop runs.
ITERATIONS_PER_NODE = 10


def esc(text) -> str:
    """Escape text for a Graphviz HTML-like label."""
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


def quote(text) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def changed_ops(trace) -> dict:
    """``{op index: what the intervention did}`` for the ops whose output an intervention replaced."""
    if not trace.interventions:
        return {}
    index = {label: i for i, label in enumerate(trace.labels)}
    return {index[applied.label]: describe_action(applied.action) for applied in trace.interventions}


def reading_notes(trace) -> list:
    """What a reader of the picture must know that no node or edge shows: a forward cut short, tensors that
    entered from outside the trace."""
    notes = []
    if trace.stopped_after is not None:
        notes.append(f"stopped after {trace.stopped_after} (stop_after=): the forward ran no further and has no "
                     "output")
    if trace.unattributed:
        them = "it" if trace.unattributed == 1 else "them"
        notes.append(f"{counted(trace.unattributed, 'tensor argument')} came from outside the trace (no op made "
                     f"{them}): no edge shows {them}, the ops that read {them} say so")
    return notes


def describe_action(action) -> str:
    """``zero_ablate()``; several actions applied in turn are joined in their order."""
    actions = action if isinstance(action, tuple) else (action,)
    return ", then ".join(repr(a) for a in actions)


class DotWriter:
    """Writes pictures of one structure, with shared styling and optional colouring."""

    def __init__(self, trace, structure, coloring=None, direction="TB"):
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'TB' (top to bottom) or 'LR' (left to right), not {direction!r}")
        self.direction = direction
        self.trace = trace
        self.structure = structure
        self.coloring = coloring
        self.rolled = structure.view == "rolled"
        self.changed = changed_ops(trace)

    # ----- labels -------------------------------------------------------------------------------
    def item_label(self, index, port_ops=()) -> str:
        """The node's rows; ``port_ops``: the ops of the other outputs drawn as its ports."""
        item = self.structure.items[index]
        trace = self.trace
        first = item.ops[0]
        n = len(item.ops)
        title = item.label
        if not self.rolled and trace.group_sizes[trace.groups[first]] == 1:
            title = trace.op_layer_labels[first]  # a single pass needs no ":1"
        if self.rolled and n > 1:
            title += f" \u00d7{n}"
        shapes = sorted({shape_text(trace.op_meta[i].shape) for i in item.ops})
        shape = shapes[0] if len(shapes) == 1 else f"{len(shapes)} shapes"
        what = trace.func_names[first] if item.kind == "op" else (trace.io_paths.get(first) or item.kind)
        rows = [f"<b>{esc(title)}</b>", f"{esc(what)} {esc(shape)}"]
        params = trace.param_addresses.get(first)
        if params:
            rows.append(f'<font point-size="8">params: {esc(", ".join(p.rsplit(".", 1)[-1] for p in params))}'
                        "</font>")
        where = self._module_of(first)
        if where:
            grey = ' color="#555555"' if self.coloring is None else ""
            rows.append(f'<font point-size="8"{grey}>@{esc(where)}</font>')
        value = self._value_row(item.ops) if item.kind == "op" else None
        if value:
            rows.append(value)
        outside = sum(1 for _, parent in trace.op_parents[first] if parent < 0)
        if outside:  # no edge can show it: say that the op had more inputs than the edges into it
            rows.append(f'<font point-size="8" color="#555555">+{counted(outside, "tensor argument")} '
                        "from outside the trace</font>")
        changed = self._changed_row(item.ops + list(port_ops))
        if changed:
            rows.append(changed)
        return "<" + "<br/>".join(rows) + ">"

    def _module_of(self, op_index):
        m = self.trace.module_call_indices[op_index]
        if m < 0:
            return None
        call = self.trace.module_calls[m]
        return call.address if self.rolled else call.label

    def _value_row(self, ops):
        if self.coloring is None or self.coloring.metric == "nonfinite":
            return None
        value = aggregate(self.coloring.values, ops, self.coloring.metric, self.trace)
        text = format_value(self.coloring.metric, value)
        if value is not None and self.coloring.metric in SUMMED_METRICS and self._some_unknown(ops):
            text += "+"  # a sum that leaves out ops with no value is a lower bound, as log.summary() marks it
        return f'<font point-size="8">{esc(text)}</font>'

    def _some_unknown(self, ops) -> bool:
        """Whether some compute op among ``ops`` has no value (an op no FLOPs formula covers, one a profile did
        not time, one whose output was neither checked nor saved)."""
        values, kinds = self.coloring.values, self.trace._kind
        return any(values[i] is None for i in ops if kinds[i] == Kind.OP)

    def _changed_row(self, ops):
        """What interventions did to these ops (their pass numbers in the rolled view), or None."""
        hits = [i for i in ops if i in self.changed]
        if not hits:
            return None
        actions = sorted({self.changed[i] for i in hits})
        text = "changed: " + "; ".join(actions)
        if self.rolled and len(ops) > 1:
            text += f" (pass {pass_ranges(self.trace.pass_numbers[i] for i in hits)})"
        return f'<font point-size="8" color="{CHANGED}">{esc(text)}</font>'

    def _style(self, kind, ops) -> str:
        """The kind's shape and border; the changed border when an intervention replaced one of ``ops``."""
        style = _KIND_STYLE[kind]
        if any(i in self.changed for i in ops):
            style = _BORDER.sub(f'color="{CHANGED}", penwidth=2.5', style, count=1)
        return style

    def notes(self) -> list:
        """``reading_notes``, and the module calls drawn nowhere: a call that ran no torch op (``nn.Identity``)
        has no node to put a box around, so the picture says it happened rather than leave it out unseen."""
        notes, calls, groups = reading_notes(self.trace), self.trace.module_calls, self.structure.groups
        drawn = rolled_up([len(group.items) for group in groups], [group.parent for group in groups])
        # A rolled box with no items of its own may be a shared module's second position, drawn in its first.
        empty = [f"{group.label} ({group.class_name})" for group, inside in zip(groups, drawn, strict=True)
                 if not inside and not any(calls[c]._num_ops for c in group.calls)]
        if empty:
            has = "has" if len(empty) == 1 else "have"
            notes.append(f"{counted(len(empty), 'module call')} ran no torch op and {has} no box: {listed(empty, 3)}")
        return notes

    def group_title(self, g) -> str:
        group = self.structure.groups[g]
        title = f"{group.label} ({group.class_name})"
        if self.rolled and len(group.calls) > 1:
            title += f" \u00d7{len(group.calls)} calls"
        return title

    def module_label(self, g) -> str:
        calls = [self.trace.module_calls[c] for c in self.structure.groups[g].calls]
        rows = [f"<b>{esc(self.group_title(g))}</b>", esc(self._calls_shapes(calls)),
                f'<font point-size="8">{self._hidden_count(g, calls)}</font>']
        ops = self._group_ops(g)
        value = self._value_row(ops)
        if value:
            rows.append(value)
        changed = sum(i in self.changed for i in ops)
        if changed:
            rows.append(f'<font point-size="8" color="{CHANGED}">{counted(changed, "op")} changed by interventions'
                        '</font>')
        return "<" + "<br/>".join(rows) + ">"

    def _calls_shapes(self, calls) -> str:
        """``2x8 \u2192 2x8``: the input and output shapes of the calls a box stands for; when the calls of a rolled
        box differ, each distinct one (``2x8 \u2192 2x8 | 1x8 \u2192 1x8``), never the first call's as if all's."""
        def shapes(nodes):
            return ", ".join(shape_text(self.trace.op_meta[i].shape) for i in nodes if i >= 0) or "-"

        seen = list(dict.fromkeys(f"{shapes(c._input_nodes)} \u2192 {shapes(c._output_nodes)}" for c in calls))
        # a decoding loop's growing length would list every step
        more = f" | {counted(len(seen) - 3, 'other shape')}" if len(seen) > 3 else ""
        return " | ".join(seen[:3]) + more

    def _hidden_count(self, g, calls) -> str:
        """``3 ops`` (per call: ``3-4 ops`` when a rolled box's calls ran different numbers), and ``, 2 buffers``
        for the buffer nodes drawn inside the module: a collapsed box hides those too, and they are ops of the
        trace that the count must not leave out."""
        items = self.structure.items
        buffers = sum(items[i].kind == "buffer" for i in items_inside(self.structure, g))
        low, high = min(c._num_ops for c in calls), max(c._num_ops for c in calls)
        ops = counted(low, "op") if low == high else f"{low}-{high} ops"
        return ops + (f", {counted(buffers, 'buffer')}" if buffers else "")

    def _group_ops(self, g):
        items = self.structure.items
        return [i for it in items_inside(self.structure, g) for i in items[it].ops]

    # ----- nodes and edges ----------------------------------------------------------------------
    def _fill(self, kind, ops=()):
        """Fill attributes: the kind's colour, or the metric's for ops and modules when colouring."""
        if self.coloring is None or kind not in ("op", "param_op", "module"):
            return f'fillcolor="{KIND_FILL[kind]}"'
        labels = [self.trace.labels[i] for i in ops]
        value = aggregate(self.coloring.values, ops, self.coloring.metric, self.trace)
        if value is False and self._some_unknown(ops):  # no NaN among the checked ops says nothing of the rest
            value = None
        fill = self.coloring.fill(value, labels)
        return f'fillcolor="{fill}", fontcolor="{self.coloring.font(fill)}"'

    def item_node(self, index, ports=()) -> str:
        item = self.structure.items[index]
        kind = item.kind
        if kind == "op" and self.trace.param_addresses.get(item.ops[0]):
            kind = "param_op"
        port_ops = [op for _, i in ports for op in self.structure.items[i].ops if op not in item.ops]
        label = self.item_label(index, port_ops)
        if ports:
            label = self._with_ports(label, ports)
        return (f'{item.key} [id="{item.key}", class="tl-node tl-{item.kind}", '
                f"{self._style(kind, item.ops + port_ops)}, {self._fill(kind, item.ops)}, label={label}];")

    def _with_ports(self, label, ports) -> str:
        """The node's rows above one cell per output: the port its edges leave from."""
        cells = []
        for port, index in ports:
            item = self.structure.items[index]
            shape = shape_text(self.trace.op_meta[item.ops[0]].shape)
            cells.append(f'<td port="p{port}" border="1" cellpadding="2"><font point-size="8">{esc(item.label)} '
                         f"{esc(shape)}</font></td>")
        return (f'<<table border="0" cellspacing="2" cellpadding="0"><tr><td colspan="{len(cells)}">{label[1:-1]}'
                f'</td></tr><tr>{"".join(cells)}</tr></table>>')

    def port_aliases(self, picture) -> dict:
        """``{item key: (node key, port)}`` for the outputs of multi-output calls drawn in this picture."""
        trace, items, op_item = self.trace, self.structure.items, self.structure.op_item
        visible = set(picture.items)
        siblings: dict = {}
        for i in picture.items:
            op = items[i].ops[0]
            c = trace.call_indices[op]
            if c < 0 or trace.calls[c].num_outputs < 2:
                continue
            first = op_item[trace.calls[c].first_record]
            if first in visible:
                siblings.setdefault(first, []).append(i)
        aliases = {}
        for first, members in siblings.items():
            if len(members) < 2:
                continue
            for port, i in enumerate(sorted(members, key=lambda m: items[m].ops[0])):
                aliases[items[i].key] = (items[first].key, port)
        return aliases

    def module_node(self, g) -> str:
        key = self.structure.groups[g].key
        ops = self._group_ops(g)
        return (f'{key} [id="{key}", class="tl-node tl-module", {self._style("module", ops)}, '
                f"{self._fill('module', ops)}, label={self.module_label(g)}];")

    def ref_node(self, index, incoming) -> str:
        item = self.structure.items[index]
        arrow = "from" if incoming else "to"
        return (f'r{item.key} [id="r{item.key}", class="tl-node tl-ref", {_KIND_STYLE["ref"]}, '
                f'{self._fill("ref")}, label=<{arrow} <b>{esc(item.label)}</b>>];')

    def edge(self, src, dst, pairs, repeated=False) -> str:
        """``repeated``: an end stands for several passes or calls, so even an edge of pass 1 alone must say
        so, or it would read as feeding every pass (an input into a loop's first pass only)."""
        attrs = ""
        if self.rolled and (repeated or any(pair != (1, 1) for pair in pairs)):
            attrs = f" [label={quote(edge_pass_label(pairs))}]"
        return f"{src} -> {dst}{attrs};"

    def _repeated_nodes(self, picture) -> set:
        """The node ids of this rolled picture that stand for more than one pass (a layer) or call (a module)."""
        if not self.rolled:
            return set()
        items, groups = self.structure.items, self.structure.groups
        shown = picture.items + picture.refs_in + picture.refs_out
        several = {items[i].key for i in shown if len(items[i].ops) > 1}
        several |= {"r" + key for key in several}
        return several | {groups[g].key for g in picture.collapsed if len(groups[g].calls) > 1}

    # ----- a whole picture ----------------------------------------------------------------------
    def write(self, picture, title=None, legend=None) -> str:
        bounded = f"nslimit={1 if picture.size > BUDGET else ITERATIONS_PER_NODE}, "
        lines = [
            "digraph torchlens {",
            f'graph [rankdir={self.direction}, nodesep=0.25, ranksep=0.35, {bounded}fontname="{FONT}", '
            'fontsize=11, bgcolor="white", id="tl-graph"];',
            f'node [fontname="{FONT}", fontsize=10, margin="0.1,0.04", height=0.3];',
            f'edge [fontname="{FONT}", fontsize=8, color="#555555", arrowsize=0.6];',
        ]
        if title or legend:
            lines.append(f"label={self.graph_label(title, legend)}; labelloc=t; labeljust=l;")
        aliases = self.port_aliases(picture)
        contents: dict = {}
        for node_id, lines_ in self._node_lines(picture, aliases):
            contents.setdefault(picture.placement[node_id], []).append(lines_)
        children: dict = {}
        drawn_boxes = set(picture.clusters)  # a set: one membership test per box, against every box drawn
        for g in picture.clusters:
            parent = self.structure.groups[g].parent
            children.setdefault(parent if parent in drawn_boxes else -1, []).append(g)
        self._emit(-1, contents, children, lines, 1)
        drawn, several = set(), self._repeated_nodes(picture)
        for (src, dst), pairs in picture.edges.items():
            repeated = src in several or dst in several
            if src in aliases:
                src = "%s:p%d" % aliases[src]
            dst = aliases[dst][0] if dst in aliases else dst  # every output has the same inputs: one edge
            if (src, dst) not in drawn:
                drawn.add((src, dst))
                lines.append("  " + self.edge(src, dst, pairs, repeated))
        lines.append("}")
        return "\n".join(lines) + "\n"

    def _node_lines(self, picture, aliases=None):
        aliases = aliases or {}
        ports: dict = {}
        for key, (node, port) in aliases.items():
            ports.setdefault(node, []).append((port, key))
        index_of = {self.structure.items[i].key: i for i in picture.items}
        for i in picture.items:
            key = self.structure.items[i].key
            if key in aliases and aliases[key][0] != key:
                continue  # drawn as a port of its call's first output
            shown = sorted((port, index_of[k]) for port, k in ports.get(key, ()))
            yield key, self.item_node(i, shown)
        for g in picture.collapsed:
            yield self.structure.groups[g].key, self.module_node(g)
        for i in picture.refs_in:
            yield "r" + self.structure.items[i].key, self.ref_node(i, True)
        for i in picture.refs_out:
            yield "r" + self.structure.items[i].key, self.ref_node(i, False)

    def _emit(self, g, contents, children, lines, level):
        pad = "  " * level
        for node in contents.get(g, ()):
            lines.append(pad + node)
        for child in children.get(g, ()):
            group = self.structure.groups[child]
            lines.append(f"{pad}subgraph cluster_{group.key} {{")
            lines.append(f'{pad}  id="c{group.key}"; class="tl-cluster"; label={quote(self.group_title(child))}; '
                         'style="rounded,dashed"; color="#7a6aa8"; fontsize=10; labeljust=l;')
            self._emit(child, contents, children, lines, level + 1)
            lines.append(pad + "}")

    def graph_label(self, title, legend) -> str:
        rows = []
        if title:
            rows.append(f'<tr><td align="left" colspan="2"><b>{esc(title)}</b></td></tr>')
        rows += [f'<tr><td align="left" colspan="2">{esc(note)}</td></tr>' for note in self.notes()]
        if self.changed:
            changed = counted(len(self.changed), "op")
            rows.append(f'<tr><td align="left" colspan="2"><font color="{CHANGED}">{changed} changed by '
                        "interventions (red border): their values are the actions', not the ops'</font></td></tr>")
        if legend:
            rows.append(f'<tr><td align="left" colspan="2">{esc(legend["title"])}: {esc(legend["note"])}</td></tr>')
            for colour, text in legend["entries"]:
                rows.append(f'<tr><td bgcolor="{colour}" width="14"> </td><td align="left">{esc(text)}</td></tr>')
        return '<<table border="0" cellspacing="1" cellpadding="2">' + "".join(rows) + "</table>>"
