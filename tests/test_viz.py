"""Rendering traces: DOT structure in both views, collapsing, colouring, formats and errors."""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens import viz
from torchlens.viz import graph, html, layout

sys.path.insert(0, os.path.dirname(__file__))
from zoo import zoo  # noqa: E402

NODE = re.compile(r'^\s*(\w+) \[id="\w+", class="tl-node tl-(\w+)"', re.M)
CLUSTER = re.compile(r"^\s*subgraph cluster_(\w+) \{", re.M)
EDGE = re.compile(r"^\s*(\w+)(?::p\d+)? -> (\w+)(?: \[label=\"([^\"]*)\"\])?;", re.M)


def nodes(dot):
    return dict(NODE.findall(dot))


def first_outputs(log) -> dict:
    """``{op index: index of the first output of its call}``: a multi-output call is drawn once, with ports."""
    first: dict = {}
    by_call: dict = {}
    for op in log.ops:
        key = (op.func_name, op.start_ns) if op.kind == "op" else ("node", op.index)
        first[op.index] = by_call.setdefault(key, op.index)
    return first


def call_chain(mc) -> tuple:
    return () if mc is None else call_chain(mc.parent) + (mc.address,)


@pytest.fixture(scope="module")
def traces():
    return {name: tl.trace(model, args, kwargs) for name, (model, args, kwargs) in zoo(0).items()}


@pytest.mark.parametrize("name", list(zoo(0)))
def test_unrolled_dot_has_every_op_and_module_call(traces, name):
    log = traces[name]
    dot = log.render()
    found = nodes(dot)
    first = first_outputs(log)
    drawn = sorted({first[i] for i in range(len(log))})
    assert sorted(found) == sorted(f"o{i}" for i in drawn)
    assert [found[f"o{i}"] for i in drawn] == [log.ops[i].kind for i in drawn]
    calls_with_ops = {f"m{mc.index}" for mc in log.module_calls if mc.ops}
    assert set(CLUSTER.findall(dot)) == calls_with_ops
    expected_edges = {(f"o{first[log[p].index]}", f"o{first[op.index]}") for op in log.ops for p in op.parents}
    assert {(a, b) for a, b, _ in EDGE.findall(dot)} == expected_edges


@pytest.mark.parametrize("name", list(zoo(0)))
def test_rolled_dot_has_one_node_per_layer_and_module_position(traces, name):
    log = traces[name]
    dot = log.render(view="rolled")
    found = nodes(dot)
    first = first_outputs(log)
    layer_of = {op.index: op.layer.first.index for op in log.ops}
    drawn = sorted({layer_of[first[layer.first.index]] for layer in log.layers})
    assert sorted(found) == sorted(f"l{i}" for i in drawn)
    positions = {call_chain(mc) for mc in log.module_calls if mc.ops}
    assert len(CLUSTER.findall(dot)) == len(positions)
    for layer in log.layers:
        if layer.num_passes > 1 and layer_of[first[layer.first.index]] == layer.first.index:
            assert f"{layer.layer_label} \u00d7{layer.num_passes}</b>" in dot


def test_rolled_loop_labels_passes_and_back_edge(traces):
    log = traces["loop_rnn"]
    dot = log.render(view="rolled")
    edges = {(a, b): label for a, b, label in EDGE.findall(dot)}
    key = {layer.layer_label: f"l{layer.first.index}" for layer in log.layers}
    linear, add, tanh, mul = (key[log[i].layer_label] for i in (2, 3, 4, 5))
    assert edges[(linear, add)] == "1-16"
    assert edges[(mul, add)] == "1-15\u219216-16".replace("16-16", "2-16")  # the loop's back edge
    assert edges[(add, tanh)] == "1-16"
    assert 'label="cell (Linear) \u00d716 calls"' in dot
    unrolled_edges = EDGE.findall(log.render())
    assert all(label == "" for _, _, label in unrolled_edges)


def test_shared_module_rolls_its_calls(traces):
    log = traces["shared_module"]
    dot = log.render(view="rolled")
    assert 'label="fc (Linear) \u00d73 calls"' in dot
    assert 'label="act (ReLU) \u00d72 calls"' in dot
    assert len(nodes(dot)) == len(log.layers) == 4


def test_depth_collapses_modules_into_nodes_with_shapes(traces):
    log = traces["small_cnn"]
    dot = log.render(depth=0)
    found = nodes(dot)
    top = [mc for mc in log.module_calls if mc.parent is None and mc.ops]
    assert sorted(k for k, kind in found.items() if kind == "module") == sorted(f"m{mc.index}" for mc in top)
    inside = {log[label].index for mc in top for label in mc.op_labels}
    # buffers are drawn with the module that owns them
    inside |= {op.index for op in log.ops if op.kind == "buffer" and op.io_path.startswith("features.")}
    assert sorted(k for k, kind in found.items() if kind != "module") == \
        sorted(f"o{i}" for i in range(len(log)) if i not in inside)
    assert CLUSTER.findall(dot) == []
    assert "features:1 (Sequential)</b><br/>2x3x8x8 \u2192 2x8x4x4" in dot
    one = log.render(depth=1)
    assert set(CLUSTER.findall(one)) == {f"m{mc.index}" for mc in top}
    assert f'm{log.module_calls[0].children[-1].index} [id=' in one  # features.4:1 collapsed at depth 1


def test_buffers_sit_with_their_module(traces):
    log = traces["batchnorm_eval"]
    dot = log.render()
    bn = next(mc for mc in log.module_calls if mc.address == "bn")
    block = re.search(r"subgraph cluster_m%d \{(.*?)\n  \}" % bn.index, dot, re.S).group(1)
    buffers = [op for op in log.ops if op.kind == "buffer"]
    owned = [op for op in buffers if op.io_path.startswith("bn.")]
    assert len(owned) == 2 and all(f"o{op.index} [" in block for op in owned)
    root = next(op for op in buffers if op.io_path == "scale")
    assert f"o{root.index} [" not in block and f"o{root.index} [" in dot
    assert all(re.search(rf'o{op.index} \[[^\n]*shape=cylinder', dot) for op in buffers)
    collapsed = log.render(depth=0)
    assert not any(f"o{op.index} [" in collapsed for op in owned)


def test_kinds_are_drawn_distinctly(traces):
    dot = traces["dict_io"].render()
    log = traces["dict_io"]
    for op in log.ops:
        line = re.search(rf"^\s*o{op.index} \[.*$", dot, re.M).group(0)
        shape = {"input": "shape=ellipse", "output": "peripheries=2", "op": "shape=box"}[op.kind]
        assert shape in line
        if op.params:
            assert "bold" in line and "params: weight, bias" in line


def test_svg_and_png_from_the_layout_engine(traces, tmp_path):
    log = traces["mlp"]
    svg = log.render(tmp_path / "mlp.svg")
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") or "<svg" in text[:300]
    for i in range(len(log)):
        assert f'id="o{i}"' in text
    png = log.render(tmp_path / "mlp.png", view="rolled")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert isinstance(log.render(format="png"), bytes)


def _page_data(page: str) -> dict:
    raw = re.search(r'<script type="application/json" id="tl-data">(.*?)</script>', page, re.S).group(1)
    return json.loads(raw)


def test_html_is_self_contained_and_holds_every_record(traces, tmp_path):
    log = traces["transformer_fastpath"]
    path = log.render(tmp_path / "t.html")
    page = path.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    assert "<script src" not in page and "<link" not in page
    data = _page_data(page)
    assert len(data["items"]) == len(log)
    assert {rec["label"] for rec in data["items"].values()} == {op.label for op in log.ops}
    rec = data["items"][f"o{log['linear_1_7'].index}"]
    assert rec["shape"] == "2x5x64" and rec["params"] == ["layers.0.linear1.weight", "layers.0.linear1.bias"]
    assert rec["modules"] == ["layers.0:1 (TransformerEncoderLayer)", "layers.0.linear1:1 (Linear)"]
    assert {"min", "max", "mean", "std"} <= set(rec["activation"])
    act = log["linear_1_7"].activation
    assert rec["activation"]["max"] == pytest.approx(float(act.max()), rel=1e-5)
    assert len(re.findall(r'<script type="text/x-tl-svg" id="tl-view-', page)) == len(data["views"])


def test_html_pictures_drill_down_and_cover_each_op_once(traces):
    log = traces["transformer_fastpath"]
    structure = graph.build_structure(log)
    pictures = html.build_pictures(structure, budget=8)
    assert len(pictures) > 1
    drawn = [i for picture, _ in pictures for i in picture.items]
    assert sorted(drawn) == list(range(len(log)))
    focuses = {picture.focus for picture, _ in pictures}
    for picture, parent in pictures:
        assert parent is None or picture.focus in pictures[parent][0].collapsed
        assert all(g in focuses for g in picture.collapsed)
    first = pictures[0][0]
    assert len(first.items) + len(first.collapsed) <= 8 or first.depth == 0


def test_auto_depth_is_the_deepest_level_within_budget(traces):
    log = traces["small_cnn"]
    structure = graph.build_structure(log)
    pictures = {k: graph.project(structure, -1, k) for k in range(4)}
    sizes = {k: len(p.items) + len(p.collapsed) for k, p in pictures.items()}  # the nodes drawn, references aside
    assert sizes[0] < sizes[1] < sizes[2] <= sizes[3] == len(log)
    for budget in range(sizes[0], len(log) + 1):
        chosen = graph.auto_depth(structure, -1, budget)
        assert sizes[chosen] <= budget and (chosen == 3 or sizes[chosen + 1] > budget)


def test_color_by_duration_and_memory_fill_ops_and_explain(traces):
    log = traces["mlp"]
    dot = log.render(color_by="duration")
    assert "instrumented" in dot and "torch.utils.benchmark.Timer" in dot
    fills = re.findall(r'^\s*o\d+ \[[^\n]*fillcolor="(#\w+)"', dot, re.M)
    assert len(set(fills)) > 2
    slowest = max((op for op in log.ops if op.kind == "op"), key=lambda op: op.duration)
    line = re.search(rf"^\s*o{slowest.index} \[.*$", dot, re.M).group(0)
    assert 'fillcolor="#8c2d04"' in line and 'fontcolor="white"' in line
    memory = log.render(color_by="memory")
    assert "bytes of the tensor each op produced" in memory
    head = next(op for op in log.ops if op.func_name == "linear" and op.shape == (4, 4))
    assert "64 B" in re.search(rf"^\s*o{head.index} \[.*$", memory, re.M).group(0)


def test_color_by_nonfinite_marks_the_nan_ops():
    class MakesNaN(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = torch.log(self.fc(x) - 100.0)  # log of a negative: NaN
            return y.relu() + 1

    log = tl.trace(MakesNaN().eval(), torch.randn(2, 4), save="none", record_finite=True)
    dot = log.render(color_by="nonfinite")
    fill = {int(i): f for i, f in re.findall(r'^\s*o(\d+) \[[^\n]*fillcolor="(#\w+)"', dot, re.M)}
    log_op = next(op for op in log.ops if op.func_name == "log")
    linear = next(op for op in log.ops if op.func_name == "linear")
    assert fill[linear.index] == "#ccf2f4"  # checked finite (cyan: green is the input colour)
    assert fill[log_op.index] == "#c0001a"  # the origin tl.debug.nonfinite_origin names
    relu = next(op for op in log.ops if op.func_name == "relu")
    assert fill[relu.index] == "#f4a3a3"  # carried the NaN on
    assert "output held NaN or Inf" in dot and "origin: first op" in dot
    saved = tl.trace(MakesNaN().eval(), torch.randn(2, 4))  # no flags: read from saved activations
    fill = {int(i): f for i, f in re.findall(r'^\s*o(\d+) \[[^\n]*fillcolor="(#\w+)"',
                                            saved.render(color_by="nonfinite"), re.M)}
    assert fill[relu.index] == "#f4a3a3" and fill[linear.index] == "#ccf2f4"


def test_color_by_device_time_mapping(traces):
    log = traces["loop_rnn"]
    times = {"linear_1_2:3": 2e-3, "tanh_1_4:1": 1e-6}
    dot = log.render(color_by=times)
    assert "device time per op" in dot
    line = re.search(rf"^\s*o{log['linear_1_2:3'].index} \[.*$", dot, re.M).group(0)
    assert "2 ms" in line
    untimed = re.search(rf"^\s*o{log['linear_1_2:4'].index} \[.*$", dot, re.M).group(0)
    assert 'fillcolor="#eeeeee"' in untimed and "unknown" in untimed
    page = _page_data(log.render(format="html", color_by=times))
    assert page["items"][f"o{log['linear_1_2:3'].index}"]["device_time"] == "2 ms"
    assert page["items"][f"o{log['linear_1_2:4'].index}"]["device_time"] == "unknown"
    with pytest.raises(ValueError, match="16 passes"):
        log.render(color_by="device_time", device_times={"linear_1_2": 1.0})
    with pytest.raises(KeyError, match="no op"):
        log.render(color_by={"nope_9_9:1": 1.0})
    with pytest.raises(ValueError, match="device_times="):
        log.render(color_by="device_time")
    # device_times= without color_by= colored nothing, without a word; a NaN or "2ms" time failed or drew nonsense.
    with pytest.raises(ValueError, match=r"device_times= colors the graph only with color_by='device_time'"):
        log.render(device_times=times)
    with pytest.raises(ValueError, match=r"render: device_times\['linear_1_2:3'\]=nan is not a number \(NaN\); give "
                                         r"the op's device time in seconds"):
        log.render(color_by={"linear_1_2:3": float("nan")})
    with pytest.raises(TypeError, match=r"render: device_times\['linear_1_2:3'\]='2ms' is a str"):
        log.render(color_by={"linear_1_2:3": "2ms"})


def test_color_by_flops_when_the_registry_is_installed(traces):
    pytest.importorskip("torchlens.report.flops", reason="FLOPs registry not installed")
    log = traces["mlp"]
    dot = log.render(color_by="flops")
    assert "multiply-add counts 2" in dot


def test_bad_arguments_say_what_to_do(traces, tmp_path):
    log = traces["mlp"]
    with pytest.raises(ValueError, match="view must be one of"):
        log.render(view="sideways")
    with pytest.raises(ValueError, match=r"render: depth=-1 is negative; give a module depth, 0 or more"):
        log.render(depth=-1)
    with pytest.raises(TypeError, match=r"render: depth=1\.0 is a float, not an int"):
        log.render(depth=1.0)
    with pytest.raises(ValueError, match=r"cannot tell the format.*\.dot \(or \.gv\).*\.html \(or \.htm\)"):
        log.render(tmp_path / "graph.pdf")
    assert [viz.format_of(None, "htm"), viz.format_of("g.htm"), viz.format_of(None, "gv")] == ["html", "html", "dot"]
    with pytest.raises(ValueError, match="color_by must be one of"):
        log.render(color_by="loudness")
    with pytest.raises(TypeError, match="needs a Trace"):
        viz.render(object())
    # format=3 failed on "'int' object has no attribute 'lower'"; max_ops="10" on a comparison, -1 drew no graph.
    with pytest.raises(TypeError, match=r"format= takes the name of a picture format, one of dot \(or gv\), svg, "
                                        r"png, html \(or htm\), got int 3"):
        log.render(tmp_path / "graph", format=3)
    with pytest.raises(TypeError, match=r"notebook_html: max_ops='10' is a str, not an int"):
        viz.notebook_html(log, max_ops="10")
    with pytest.raises(ValueError, match=r"notebook_html: max_ops=-1 is negative"):
        viz.notebook_html(log, max_ops=-1)
    assert not list(tmp_path.iterdir())


def test_missing_layout_engine_names_both_ways_to_get_one(traces, tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv(layout.ENGINE_ENV, raising=False)
    monkeypatch.setattr(layout.sysconfig, "get_path", lambda name: str(empty))
    monkeypatch.setattr(layout.sys, "executable", str(empty / "python"))
    log = traces["mlp"]
    with pytest.raises(layout.LayoutEngineMissing) as missing:
        log.render(tmp_path / "g.svg")
    assert "apt-get install graphviz" in str(missing.value) and "pip install torchlens[viz]" in str(missing.value)
    assert not (tmp_path / "g.svg").exists()
    assert "digraph" in log.render(tmp_path / "g.dot").read_text()  # DOT needs no engine
    assert "apt-get install graphviz" in log._repr_html_()


def test_cleaned_up_trace_still_renders_from_metadata():
    model, args, kwargs = zoo(0)["small_cnn"]
    log = tl.trace(model, args, kwargs)
    log.cleanup()
    page = log.render(format="html")
    data = _page_data(page)
    assert len(data["items"]) == len(log)
    assert all(rec["activation"].startswith("not saved: the trace was cleaned up") for rec in data["items"].values())


def test_notebook_html_and_show(traces, monkeypatch):
    log = traces["mlp"]
    snippet = log._repr_html_()
    assert snippet.startswith("<div><pre") and "Open the interactive viewer" in snippet and "Trace of MLP" in snippet
    assert "tlOpenViewer" not in viz.notebook_html(log, max_ops=5) and ".show()" in viz.notebook_html(log, max_ops=5)
    opened = []
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr("webbrowser.open", lambda url: opened.append(url) or True)
    path = log.show(view="rolled")
    try:
        assert opened == [path.resolve().as_uri()] and "tl-data" in path.read_text()
    finally:
        path.unlink()


def test_left_to_right_layout(traces):
    log = traces["mlp"]
    assert "rankdir=LR" in log.render(format="dot", direction="LR")
    assert "rankdir=TB" in log.render(format="dot")
    with pytest.raises(ValueError, match="direction must be 'TB'"):
        log.render(format="dot", direction="sideways")


def test_checked_finite_is_not_the_input_colour(traces):
    from torchlens.viz.dot import KIND_FILL
    from torchlens.viz.metrics import FINITE_FILL, NONFINITE_FILL, UNKNOWN_FILL

    assert len({FINITE_FILL, NONFINITE_FILL, UNKNOWN_FILL} | set(KIND_FILL.values())) == len(KIND_FILL) + 3
    dot = traces["mlp"].render(format="dot", color_by="nonfinite")
    assert f'fillcolor="{FINITE_FILL}"' in dot and f'fillcolor="{KIND_FILL["input"]}"' in dot


def test_a_multi_output_call_is_one_node_with_a_port_per_output():
    class UsesAll(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.fc = nn.LSTM(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            out, (h, c) = self.lstm(x)
            return self.fc(out) + self.fc(h) + c.sum()

    log = tl.trace(UsesAll(), torch.randn(2, 1, 4))
    dot = log.render(format="dot")
    outputs = [op for op in log.ops if op.func_name == "lstm"]
    assert len(outputs) == 3
    lstm = f"o{outputs[0].index}"
    assert set(nodes(dot)) & {f"o{op.index}" for op in outputs} == {lstm}  # drawn once
    assert dot.count("weight_ih_l0") == 1  # its parameters listed once, not per output
    for port, op in enumerate(outputs):
        assert f'port="p{port}"' in dot and f"{op.label} " in dot
        for child in op.children:
            assert f"{lstm}:p{port} -> o{log[child].index};" in dot  # each edge leaves its output's port
    page = log.render(format="html") if _has_engine() else None
    if page is not None:
        data = json.loads(re.search(r'<script type="application/json" id="tl-data">(.*?)</script>', page, re.S)
                          .group(1).replace("<\\/", "</"))
        assert data["alias"] == {f"o{op.index}": lstm for op in outputs[1:]}


def _has_engine() -> bool:
    try:
        layout.find_engine()
    except layout.LayoutEngineMissing:
        return False
    return True


@pytest.mark.skipif(not _has_engine(), reason="needs Graphviz's dot or the graphviz-pure wheel")
def test_pictures_laid_out_in_batches_are_those_laid_out_one_by_one_and_a_bad_one_is_named():
    texts = [f'digraph g{i} {{ a{i} -> b; b -> "c {i}"; }}\n' for i in range(7)]
    engine = layout.find_engine()
    assert layout.layout(texts, "svg") == [layout._run(engine, text, "svg") for text in texts]
    with pytest.raises(layout.LayoutFailed, match="syntax error"):
        layout.layout(texts[:3] + ["digraph broken { a -> ; }\n"] + texts[3:], "svg")


CHANGED_NODE = re.compile(r'^\s*(\w+) \[id="\w+", class="tl-node [^\n]*color="#c62828", penwidth=2.5', re.M)


def test_an_intervened_op_is_marked_in_every_picture_and_in_its_record(tmp_path):
    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    model = small_gpt2_lm()
    ids = torch.tensor([[5, 9, 13, 21, 7, 30]])
    assert not CHANGED_NODE.findall(tl.trace(model, ids).render())
    log = tl.trace(model, ids, intervene={"transformer.h.0": tl.zero_ablate()})
    (applied,) = log.interventions
    op = next(op for op in log.ops if op.label == applied.label)
    node = f"o{op.index}"
    dot = log.render()
    assert CHANGED_NODE.findall(dot) == [node]
    assert "changed: zero_ablate()" in next(line for line in dot.splitlines() if line.strip().startswith(node + " "))
    # Collapsed, the module holding it carries the mark; rolled, the layer does.
    outer = next(mc for mc in log.module_calls if mc.label == "transformer:1")
    assert CHANGED_NODE.findall(log.render(depth=0)) == [f"m{outer.index}"]
    assert len(CHANGED_NODE.findall(log.render(view="rolled"))) == 1
    records = _page_data(log.render(format="html"))["items"]
    assert [key for key, rec in records.items() if "intervention" in rec] == [node]
    assert records[node]["intervention"].startswith("zero_ablate() at transformer.h.0")
    assert records[node]["activation"]["max"] == 0.0
    assert records[node]["original"]["max"] == pytest.approx(float(op.original.max()), rel=1e-5)
    log.save(tmp_path / "run")
    assert CHANGED_NODE.findall(tl.load(tmp_path / "run").render()) == [node]


def test_an_intervened_second_output_marks_the_node_it_is_a_port_of():
    from real_models import build

    model, args, kwargs = build("lstm")
    reference = tl.trace(model, args, kwargs)
    lstm = [op for op in reference.ops if op.func_name == "lstm"]
    assert len(lstm) > 1
    log = tl.trace(model, args, kwargs, intervene={lstm[1].label: tl.zero_ablate()}, reference=reference)
    assert CHANGED_NODE.findall(log.render()) == [f"o{lstm[0].index}"]


def test_a_collapsed_module_called_in_a_loop_keeps_its_back_edge_in_the_rolled_view():
    """ALBERT runs one shared layer group once per layer: collapsed in the rolled view, the group's box still
    shows the loop (call 1's output feeding call 2); one call of a module is never drawn feeding itself."""
    pytest.importorskip("transformers")
    from real_models import build

    model, args, kwargs = build("albert")
    log = tl.trace(model, args, kwargs)
    shared = next(mc for mc in log.module_calls if mc.address == "albert.encoder.albert_layer_groups.0")
    depth = shared.depth  # collapses the group
    rolled = log.render(view="rolled", depth=depth)
    (node,) = re.findall(r'^\s*(m\d+) \[[^\n]*albert\.encoder\.albert_layer_groups\.0 \(AlbertLayerGroup\) '
                         r'\u00d72 calls', rolled, re.M)
    loops = [(a, b, label) for a, b, label in EDGE.findall(rolled) if a == b]
    assert loops == [(node, node, "1\u21922")]
    assert not [edge for edge in EDGE.findall(log.render(depth=depth)) if edge[0] == edge[1]]
    # Modules called once (the encoder around the loop) swallow the loop: it runs inside their one call.
    assert not [edge for edge in EDGE.findall(log.render(view="rolled", depth=depth - 1)) if edge[0] == edge[1]]


def test_a_stopped_forward_says_so_in_the_picture():
    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    model = small_gpt2_lm()
    ids = torch.tensor([[5, 9, 13, 21, 7, 30]])
    log = tl.trace(model, ids, stop_after="transformer.h.0")
    assert "stopped after transformer.h.0:1 (stop_after=)" in log.render()
    assert "stopped after" not in tl.trace(model, ids).render()


def test_a_tensor_from_outside_the_trace_is_named_on_the_op_that_read_it():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = torch.full((4,), 2.0)  # a plain attribute, not a buffer: no op makes it

        def forward(self, x):
            return self.fc(x) * self.scale

    log = tl.trace(Scaled(), torch.randn(2, 4))
    mul = next(op for op in log.ops if op.func_name == "mul")
    assert mul.unattributed_args == 1 and len(mul.parents) == 1
    dot = log.render()
    marked = [line.split()[0] for line in dot.splitlines() if "tl-node" in line and "from outside the trace" in line]
    assert marked == [f"o{mul.index}"]
    assert "+1 tensor argument from outside the trace" in dot
    assert "1 tensor argument came from outside the trace (no op made it)" in dot  # the heading (was "arguments")
    records = _page_data(log.render(format="html"))["items"]
    assert [key for key, rec in records.items() if "outside" in rec] == [f"o{mul.index}"]


def test_an_op_without_a_saved_value_says_why_in_its_record():
    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    model = small_gpt2_lm()
    ids = torch.tensor([[5, 9, 13, 21, 7, 30]])
    with pytest.warns(UserWarning, match="max_saved_bytes"):
        log = tl.trace(model, ids, max_saved_bytes=20_000)
    stop = log.budget_exhausted_at
    records = _page_data(log.render(format="html"))["items"]
    unsaved = [op for op in log.ops if not op.has_activation]
    assert unsaved and all(op.index >= stop for op in unsaved)
    assert {records[f"o{op.index}"]["activation"] for op in unsaved} == {
        f"not saved: max_saved_bytes was reached at {log.labels[stop]}; nothing from there on was saved"}
    chosen = tl.trace(model, ids, save=["transformer.h.0"])
    records = _page_data(chosen.render(format="html"))["items"]
    skipped = next(op for op in chosen.ops if not op.has_activation)
    assert records[f"o{skipped.index}"]["activation"] == "not saved: save= did not select this op"
    chosen.cleanup()
    records = _page_data(chosen.render(format="html"))["items"]
    assert all(rec["activation"].startswith("not saved: the trace was cleaned up") for rec in records.values())


class SharedByTwoParents(nn.Module):
    """One Linear held by two Sequentials (``p1[0] is p2[0]``): called once from each."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        shared = nn.Linear(4, 4)
        self.p1, self.p2 = nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared, nn.Tanh())

    def forward(self, x):
        return self.p2(self.p1(x))


def test_a_rolled_module_shared_by_two_parents_counts_both_calls_as_its_layer_does():
    from torchlens.viz.records import RecordBuilder

    log = tl.trace(SharedByTwoParents(), torch.randn(2, 4))
    assert [c.label for c in log.module_calls if c.address == "p1.0"] == ["p1.0:1", "p1.0:2"]
    rolled = log.render(view="rolled")
    # Its layer is drawn once, with both passes, inside the box of its first call: the box stands for both calls.
    assert "linear_1_1 \u00d72" in rolled and 'label="p1.0 (Linear) \u00d72 calls"' in rolled
    structure = graph.build_structure(log, "rolled")
    (box,) = [g for g in structure.groups if g.label == "p1.0" and g.items]
    assert RecordBuilder(log).group_record(box)["calls"] == ["p1.0:1", "p1.0:2"]  # the viewer's panel too


class _CountedIndex(int):
    """A group index that counts the equality tests made against it."""

    compared = 0

    def __eq__(self, other):
        _CountedIndex.compared += 1
        return int(self) == other

    __hash__ = int.__hash__


def test_nesting_the_module_boxes_compares_each_box_a_bounded_number_of_times(tmp_path, monkeypatch):
    # Placing each drawn module box inside its parent's box tested the parent against the list of every box,
    # n * n / 2 comparisons for n boxes (a model of 4,000 blocks spent seconds there); now a set answers.
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(150)])
    log = tl.trace(model, torch.randn(2, 4), save="none")
    real_project = graph.project

    def counted_project(*args, **kwargs):
        picture = real_project(*args, **kwargs)
        picture.clusters = [_CountedIndex(g) for g in picture.clusters]
        return picture

    monkeypatch.setattr(graph, "project", counted_project)
    _CountedIndex.compared = 0
    dot = log.render(tmp_path / "model.dot")
    boxes = len(CLUSTER.findall(pathlib.Path(dot).read_text()))
    assert boxes == len(log.module_calls) == 450
    assert _CountedIndex.compared <= 4 * boxes
