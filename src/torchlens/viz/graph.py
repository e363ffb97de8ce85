"""The drawable structure of a trace: items, module groups and data-flow edges, for either view.

In the unrolled view an item is one op (one pass of one op site) and a group is one module call.  In the
rolled view an item is one layer (every pass of an op site) and a group is one module *position* (the
chain of module addresses), so the repeated calls of a module fold into one box that carries its call
count, and edges carry the pass ranges they occur on.

``project`` then cuts the structure into what one picture shows: the items inside one group (or the
whole model), with module groups down to a depth drawn as nested clusters and deeper ones collapsed into
a single node.  Everything here is plain indices and lists; nothing lays anything out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..record.columns import Kind
from ..record.modules import call_depths, enclosing_calls

KIND_NAMES = {kind: kind.label for kind in Kind}
VIEWS = ("unrolled", "rolled")


@dataclass
class Item:
    """One drawable op (unrolled) or layer (rolled)."""

    key: str
    label: str
    kind: str
    group: int
    ops: list


@dataclass
class Group:
    """One module call (unrolled) or module position (rolled)."""

    key: str
    label: str
    class_name: str
    parent: int
    depth: int
    calls: list = field(default_factory=list)  # ModuleCall indices this group stands for
    children: list = field(default_factory=list)
    items: list = field(default_factory=list)  # the items it holds itself, not those of the groups inside it


@dataclass
class Structure:
    view: str
    items: list
    groups: list
    edges: dict  # (src item, dst item) -> list of (src pass, dst pass)
    out_edges: list  # item -> list of dst items
    in_edges: list  # item -> list of src items
    op_item: list  # op index -> item index
    # Rolled view: (src item, dst item, group) for edges from one call of a module position to another call
    # of it (a loop through the module), which stay drawn, as a back edge, when the group is collapsed.
    between_calls: set = field(default_factory=set)


def build_structure(trace, view: str = "unrolled") -> Structure:
    if view not in VIEWS:
        raise ValueError(f"view must be one of {', '.join(map(repr, VIEWS))}, not {view!r}")
    op_call = _op_module_calls(trace)
    if view == "unrolled":
        groups, call_group = _call_groups(trace)
        items, op_item = _op_items(trace, op_call, call_group)
    else:
        groups, call_group = _position_groups(trace)
        items, op_item = _layer_items(trace, op_call, call_group)
    for index, item in enumerate(items):
        if item.group >= 0:
            groups[item.group].items.append(index)
    if view == "rolled":
        _count_calls_drawn_from_other_positions(trace, groups, items, op_call, call_group)
    edges: dict = {}
    passes = trace.pass_numbers
    for child, parents in enumerate(trace.op_parents):
        dst = op_item[child]
        for _, parent in parents:
            if parent >= 0:
                pairs = edges.setdefault((op_item[parent], dst), [])
                pair = (passes[parent], passes[child])
                if not pairs or pairs[-1] != pair:
                    pairs.append(pair)
    out_edges: list = [[] for _ in items]
    in_edges: list = [[] for _ in items]
    for src, dst in edges:
        out_edges[src].append(dst)
        in_edges[dst].append(src)
    between = _edges_between_calls(trace, op_call, call_group, op_item) if view == "rolled" else set()
    return Structure(view, items, groups, edges, out_edges, in_edges, op_item, between)


def _edges_between_calls(trace, op_call, call_group, op_item) -> set:
    """``(src item, dst item, group)`` where an op in one call of a rolled group feeds an op in another call of
    it: the recurrence that collapsing the group must not swallow as if it were inside one call."""
    parent_of, depths = trace.module_call_parents.__getitem__, call_depths(trace)
    between = set()
    for child, parents in enumerate(trace.op_parents):
        for _, parent in parents:
            if parent < 0:
                continue
            # A group only one side ran in counts too: a module shared by two positions is drawn in its first,
            # so its call from the other position sits inside a group none of whose calls it ran in.
            for c in _calls_apart(op_call[parent], op_call[child], parent_of, depths):
                between.add((op_item[parent], op_item[child], call_group[c]))
    return between


def _calls_apart(a, b, parent_of, depths) -> list:
    """The module calls around call ``a`` or call ``b`` (each itself included) but not around both: the two walk up
    to their innermost common call and no further, where listing both chains up to the root cost the depth per
    edge.  A call's group has the call's depth, so the groups of the common calls are the ones both share."""
    apart = []
    while a != b:
        if (depths[a] if a >= 0 else -1) >= (depths[b] if b >= 0 else -1):
            apart.append(a)
            a = parent_of(a)
        else:
            apart.append(b)
            b = parent_of(b)
    return apart


def _op_module_calls(trace) -> list:
    """The module call each op is drawn inside; buffers sit with the module that owns them."""
    calls = list(trace.module_call_indices)
    children = None
    for i, kind in enumerate(trace.kinds):
        if kind != Kind.BUFFER:
            continue
        if children is None:
            children = trace.op_children
        path = trace.io_paths.get(i) or ""
        consumers = children[i]
        call = trace.module_calls[calls[consumers[0]]] if consumers and calls[consumers[0]] >= 0 else None
        while call is not None and not path.startswith(call.address + "."):
            call = call.parent
        calls[i] = call.index if call is not None else -1
    return calls


def _call_groups(trace):
    groups = []
    for mc in trace.module_calls:
        parent = mc.parent.index if mc.parent is not None else -1
        groups.append(Group(f"m{mc.index}", mc.label, mc.module.class_name, parent, mc.depth, [mc.index]))
        if parent >= 0:
            groups[parent].children.append(mc.index)
    return groups, list(range(len(groups)))


def _position_groups(trace):
    """One group per chain of module addresses; every call along the same chain lands in it."""
    groups, by_path, call_group = [], {}, []
    for mc in trace.module_calls:
        parent = call_group[mc.parent.index] if mc.parent is not None else -1
        path = (parent, mc.address)
        g = by_path.get(path)
        if g is None:
            g = by_path[path] = len(groups)
            groups.append(Group(f"m{g}", mc.address, mc.module.class_name, parent, mc.depth))
            if parent >= 0:
                groups[parent].children.append(g)
        groups[g].calls.append(mc.index)
        call_group.append(g)
    return groups, call_group


def _count_calls_drawn_from_other_positions(trace, groups, items, op_call, call_group) -> None:
    """Add to each rolled group the calls of its module made from another position whose ops it draws.

    A module shared by two parents (``p1.a is p2.a``) has a position under each, but its layers are drawn
    once, in the position of their first pass: that box draws the passes of both calls, so it stands for
    both (``p1.a (Linear) x2 calls``, as a module called twice from one parent reads), not for one."""
    calls, parent_of = trace.module_calls, trace.module_call_parents.__getitem__
    reentered = _reentered_calls(trace)
    drawn: dict = {}  # group -> the calls of its module whose ops it draws, from other positions
    for item in items:
        for op in item.ops:
            call = op_call[op]
            if call < 0 or (call_group[call] == item.group and not reentered[call]):
                continue  # ran in the position its layer is drawn in, each call around it its module's only one
            chain = {}  # module address -> the call of it the op ran in, innermost first
            for c in enclosing_calls(call, parent_of):
                chain.setdefault(calls[c].address, c)
            g = item.group
            while g >= 0:
                c = chain.get(groups[g].label, -1)
                if c >= 0 and call_group[c] != g:
                    drawn.setdefault(g, set()).add(c)
                g = groups[g].parent
    for g, more in drawn.items():
        groups[g].calls = sorted(set(groups[g].calls) | more)


def _reentered_calls(trace) -> list:
    """Whether each module call runs inside another call of its module (a module calling itself, at any depth), in
    one pass over the calls in the order they began, which puts each call's calls right after it: only such a call's
    chain of calls can name one module twice."""
    addresses = [call.address for call in trace.module_calls]
    parent_of = trace.module_call_parents.__getitem__
    reentered: list = []
    open_calls: list = []
    open_count: dict = {}  # address -> calls of it open around the call met
    for c, address in enumerate(addresses):
        parent = parent_of(c)
        while open_calls and open_calls[-1] != parent:  # the calls that ended before this one began
            open_count[addresses[open_calls.pop()]] -= 1
        reentered.append(open_count.get(address, 0) > 0 or (parent >= 0 and reentered[parent]))
        open_calls.append(c)
        open_count[address] = open_count.get(address, 0) + 1
    return reentered


def _op_items(trace, op_call, call_group):
    labels, kinds = trace.labels, trace.kinds
    items = [Item(f"o{i}", labels[i], KIND_NAMES[kinds[i]], call_group[c] if c >= 0 else -1, [i])
             for i, c in enumerate(op_call)]
    return items, list(range(len(items)))


def _layer_items(trace, op_call, call_group):
    items, op_item, by_layer = [], [], {}
    for i, layer in enumerate(trace.op_layer_labels):
        index = by_layer.get(layer)
        if index is None:
            index = by_layer[layer] = len(items)
            c = op_call[i]
            items.append(Item(f"l{i}", layer, KIND_NAMES[trace.kinds[i]], call_group[c] if c >= 0 else -1, []))
        items[index].ops.append(i)
        op_item.append(index)
    return items, op_item


# ----- projecting one picture ------------------------------------------------------------------------
@dataclass
class Picture:
    """What one drawing shows: node ids are item keys, group keys, or ``r``+item key for references."""

    focus: int  # the group this picture is the inside of (-1: the whole model)
    depth: object  # groups this many levels below the focus are collapsed (None: nothing collapsed)
    items: list  # visible item indices
    collapsed: list  # collapsed group indices
    clusters: list  # expanded group indices (drawn as boxes), outer before inner
    refs_in: list  # item indices outside the focus that feed it
    refs_out: list  # item indices outside the focus that it feeds
    edges: dict  # (src node id, dst node id) -> list of (src pass, dst pass)
    placement: dict = field(default_factory=dict)  # node id -> enclosing cluster group (-1: top level)

    @property
    def size(self) -> int:
        """How many nodes the picture draws: ops or layers, collapsed modules and references."""
        return len(self.items) + len(self.collapsed) + len(self.refs_in) + len(self.refs_out)


def items_inside(structure, g) -> list:
    """The items drawn inside group ``g``, those of the groups nested in it included, in item order (every item for
    -1, the whole model): derived when a picture or a box asks, as each group holds its own items alone, where every
    group holding all those inside it put each item in every group around it."""
    if g < 0:
        return list(range(len(structure.items)))
    groups = structure.groups
    return sorted(i for h in (g, *_descendants(structure, g)) for i in groups[h].items)


def _relative_depth(structure, focus):
    base = structure.groups[focus].depth + 1 if focus >= 0 else 0
    return lambda g: structure.groups[g].depth - base


def auto_depth(structure, focus: int, budget: int) -> int:
    """The deepest level whose picture still has at most ``budget`` nodes (at least level 0)."""
    rel = _relative_depth(structure, focus)
    inside = items_inside(structure, focus)
    below = list(_descendants(structure, focus))
    if not below:
        return 0
    deepest = max(rel(g) for g in below)
    # Nodes at depth k = items whose innermost group is shallower than k + groups exactly at level k.
    items_at = [0] * (deepest + 2)
    groups_at = [0] * (deepest + 2)
    for i in inside:
        g = structure.items[i].group
        items_at[rel(g) + 1 if g != focus else 0] += 1
    for g in below:
        groups_at[rel(g)] += 1
    best, shown = 0, 0
    for k in range(deepest + 2):
        shown += items_at[k]
        if shown + groups_at[k] <= budget:
            best = k
        else:
            break
    return best


def _descendants(structure, focus):
    groups = structure.groups
    stack = list(groups[focus].children) if focus >= 0 else [g for g, grp in enumerate(groups) if grp.parent < 0]
    while stack:
        g = stack.pop()
        yield g
        stack.extend(groups[g].children)


def _representatives(structure, focus, depth, rel):
    """``representative(group)``: the collapsed group that swallows an item in ``group``, None when the item is
    drawn itself, ``False`` when the group lies outside the focus.  Each group's answer is its parent's, or itself
    when it is the first collapsed on the way down, derived once: walking every item's chain up to the focus cost
    the depth per item."""
    groups, known = structure.groups, {focus: None}

    def parent_of(g):
        return groups[g].parent

    def representative(group):
        chain = enclosing_calls(group, parent_of, known)  # the groups whose answer is not known yet
        above = known.get(parent_of(chain[-1]), False) if chain else None
        for g in reversed(chain):  # outermost first
            if above is None and depth is not None and rel(g) >= depth:
                above = g
            known[g] = above
        return known.get(group, False)

    return representative


def project(structure, focus: int = -1, depth=None) -> Picture:
    """The picture of ``focus``'s inside with groups ``depth`` levels down collapsed.

    Edges from or to items outside the focus end at reference nodes; edges that fall inside one
    collapsed group disappear into it.
    """
    groups, items = structure.groups, structure.items
    rel = _relative_depth(structure, focus)
    inside = items_inside(structure, focus)
    representative = _representatives(structure, focus, depth, rel)
    node_of: dict = {}
    collapsed_as: dict = {}  # item -> the collapsed group it is drawn as
    visible, collapsed, clusters = [], [], set()
    placement: dict = {}
    for i in inside:
        rep = representative(items[i].group)
        if rep is None:
            node_of[i] = items[i].key
            visible.append(i)
            g = items[i].group
            placement[items[i].key] = g if g != focus else -1
            _add_boxes_around(clusters, groups, g, focus)
        else:
            key = groups[rep].key
            node_of[i] = key
            collapsed_as[i] = rep
            if key not in placement:
                collapsed.append(rep)
                parent = groups[rep].parent
                placement[key] = parent if parent != focus else -1
                _add_boxes_around(clusters, groups, parent, focus)
    edges: dict = {}
    refs_in, refs_out = [], []
    for i in inside:
        dst = node_of[i]
        for src_item in structure.in_edges[i]:
            src = node_of.get(src_item)
            if src is None:
                src = "r" + items[src_item].key
                if src not in placement:
                    placement[src] = -1
                    refs_in.append(src_item)
            if src == dst and src != items[i].key and (src_item, i, collapsed_as[i]) not in structure.between_calls:
                continue  # an edge swallowed inside one call of a collapsed module
            edges.setdefault((src, dst), []).extend(structure.edges[(src_item, i)])
        for dst_item in structure.out_edges[i]:
            if dst_item in node_of:
                continue
            ref = "r" + items[dst_item].key
            if ref not in placement:
                placement[ref] = -1
                refs_out.append(dst_item)
            edges.setdefault((dst, ref), []).extend(structure.edges[(i, dst_item)])
    ordered_clusters = sorted(clusters, key=lambda g: (groups[g].depth, g))
    return Picture(focus, depth, visible, collapsed, ordered_clusters, refs_in, refs_out, edges, placement)


def _add_boxes_around(clusters: set, groups, g: int, focus: int) -> None:
    """Add group ``g`` and the groups enclosing it, up to ``focus``, to the boxes drawn (``clusters``); a group
    already there has its enclosing ones there too."""
    while g >= 0 and g != focus and g not in clusters:
        clusters.add(g)
        g = groups[g].parent


def pass_ranges(passes) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3,5"``."""
    values = sorted(set(passes))
    parts, start = [], None
    for a, b in zip(values, values[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            parts.append(str(a) if start == a else f"{start}-{a}")
            start = None
    return ",".join(parts)


def edge_pass_label(pairs) -> str:
    """A rolled edge's label: the passes it occurs on (``src->dst`` when the two sides differ)."""
    src = pass_ranges(p for p, _ in pairs)
    dst = pass_ranges(q for _, q in pairs)
    return src if src == dst else f"{src}\u2192{dst}"
