"""What a picture claims about the trace it draws: the counts on collapsed modules and the passes on rolled edges."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.viz import graph

sys.path.insert(0, os.path.dirname(__file__))
from zoo import zoo  # noqa: E402

COLLAPSED = re.compile(r'^\s*(m\d+) \[id="m\d+", class="tl-node tl-module".*?<font point-size="8">(\d+) ops?'
                       r"(?:, (\d+) buffers?)?</font>", re.M)


@pytest.fixture(scope="module")
def traces():
    return {name: tl.trace(model, args, kwargs) for name, (model, args, kwargs) in zoo(0).items()}


@pytest.mark.parametrize("name, depth", [("batchnorm_eval", 0), ("batchnorm_train", 0), ("small_cnn", 0),
                                         ("small_cnn", 1)])
def test_a_collapsed_module_counts_every_node_it_hides_buffers_included(traces, name, depth):
    log = traces[name]
    structure = graph.build_structure(log, "unrolled")
    found = COLLAPSED.findall(log.render(depth=depth))
    assert found
    for key, ops, buffers in found:
        hidden = graph.items_inside(structure, int(key[1:]))  # the op and buffer nodes the box stands for
        assert int(ops) + int(buffers or 0) == len(hidden), key
    assert any(buffers for _, _, buffers in found)  # batch norm's running statistics are buffers


EDGE = re.compile(r"^\s*(\w+)(?::p\d+)? -> (\w+)(?: \[label=\"([^\"]*)\"\])?;", re.M)


class LoopOverABlock(nn.Module):
    """The input feeds only the first of three passes through ``block``; later passes read the last one's."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x):
        for _ in range(3):
            x = self.block(x) + x
        return x


@pytest.mark.parametrize("depth", [None, 0])
def test_a_rolled_edge_into_one_pass_of_a_repeated_node_says_which_pass(depth):
    log = tl.trace(LoopOverABlock(), (torch.randn(2, 4),))
    edges = EDGE.findall(log.render(view="rolled", depth=depth))
    from_input = [label for src, _, label in edges if src == "l0"]
    # into the linear (or the collapsed block) and the add, each only on pass 1 of 3: unlabelled, they would
    # read as feeding every pass
    assert from_input == ["1", "1"]
    assert all(label for _, _, label in edges)  # each edge here has an end of 3 passes
    assert all(label == "" for _, _, label in EDGE.findall(log.render(depth=depth)))  # unrolled: no passes


class CalledOnTwoShapes(nn.Module):
    """``block`` runs on the batch, then on its first row, where it skips its ReLU: calls that differ."""

    def __init__(self):
        super().__init__()
        self.block = Gated()

    def forward(self, x):
        return self.block(x).sum() + self.block(x[:1]).sum()


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return torch.relu(y) if x.shape[0] > 1 else y


def test_a_rolled_box_describes_every_call_it_stands_for_not_its_first():
    log = tl.trace(CalledOnTwoShapes(), (torch.randn(2, 4),))
    box = re.search(r'<b>block \(Gated\) \u00d72 calls</b><br/>(.*?)<br/><font point-size="8">(.*?)</font>',
                    log.render(view="rolled", depth=0)).groups()
    assert box == ("2x4 \u2192 2x4 | 1x4 \u2192 1x4", "1-2 ops")
    unrolled = log.render(depth=0)  # one call per box: its own shapes and count
    assert "<b>block:2 (Gated)</b><br/>1x4 \u2192 1x4<br/><font point-size=\"8\">1 op</font>" in unrolled


def viewer_data(page) -> dict:
    return json.loads(re.search(r'id="tl-data">(.*?)</script>', page, re.S).group(1).replace("<\\/", "</"))


def test_the_viewer_record_of_a_rolled_box_counts_ops_per_call():
    log = tl.trace(CalledOnTwoShapes(), (torch.randn(2, 4),))
    rolled = viewer_data(log.render(format="html", view="rolled", depth=0))
    block = next(rec for rec in rolled["groups"].values() if rec["label"] == "block")
    assert block["calls"] == ["block:1", "block:2"] and block["ops"] == "1-2 per call"
    unrolled = viewer_data(log.render(format="html"))
    assert sorted(rec["ops"] for rec in unrolled["groups"].values() if rec["class"] == "Gated") == [1, 2]


def test_the_viewer_record_of_a_rolled_box_gives_the_inputs_and_outputs_of_every_call():
    log = tl.trace(CalledOnTwoShapes(), (torch.randn(2, 4),))
    rolled = viewer_data(log.render(format="html", view="rolled", depth=0))
    block = next(rec for rec in rolled["groups"].values() if rec["label"] == "block")
    calls = [call for call in log.module_calls if call.address == "block"]
    assert block["inputs"] == [f"{c.label}: {op} ({'x'.join(map(str, log[op].shape))})"
                               for c in calls for op in c.input_ops]
    assert [line.split(" (")[-1] for line in block["outputs"]] == ["2x4)", "1x4)"]  # the first call's alone: 2x4
    assert block["duration"].endswith(" over 2 calls (host, instrumented)")
    unrolled = viewer_data(log.render(format="html"))
    second = next(rec for rec in unrolled["groups"].values() if rec["label"] == "block:2")
    assert second["outputs"] == [f"{op} (1x4)" for op in calls[1].output_ops]


class ThroughAnIdentity(nn.Module):
    def __init__(self):
        super().__init__()
        self.skip = nn.Identity()  # runs no torch op: nothing of it can be drawn
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.skip(x))


@pytest.mark.parametrize("view", ["unrolled", "rolled"])
def test_a_module_call_that_ran_no_op_is_named_since_no_box_can_show_it(view):
    log = tl.trace(ThroughAnIdentity(), (torch.randn(2, 4),))
    name = "skip:1" if view == "unrolled" else "skip"
    note = f"1 module call ran no torch op and has no box: {name} (Identity)"
    assert note in log.render(view=view)
    assert note in log.render(view=view, format="html")
    assert "no box" not in tl.trace(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),)).render(view=view)


def test_a_shared_module_drawn_in_its_first_position_is_not_called_empty_in_its_second():
    from test_viz_shared_modules import SharedOutsideItsFirstBox

    log = tl.trace(SharedOutsideItsFirstBox(), (torch.randn(2, 4),))
    assert "no box" not in log.render(view="rolled") + log.render(view="rolled", format="html")


class ShrinkingLoop(nn.Module):
    """``fc`` runs three passes, on two rows and then on one."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        for rows in (2, 1, 1):
            x = torch.tanh(self.fc(x[:rows]))
        return x


def test_the_viewer_record_of_a_rolled_layer_says_which_numbers_are_totals_and_which_per_pass():
    log = tl.trace(ShrinkingLoop(), (torch.randn(2, 8),))
    records = viewer_data(log.render(format="html", view="rolled"))["items"]
    linear = next(rec for rec in records.values() if rec["label"] == "linear_1_2")
    assert linear["memory"] == "32 B to 64 B per pass" and linear["shape"] == "1x8, 2x8"
    assert re.fullmatch(r"\d+ over 3 passes", linear["flops"])
    assert linear["duration"].endswith("over 3 passes (host, instrumented)")


class LoopIntoNaN(nn.Module):
    """``cell`` runs three passes; the log of a negative number makes NaN from the first pass's log on, so
    ``cell``'s own output is finite on pass 1 and NaN on passes 2 and 3."""

    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(4, 4)

    def forward(self, x):
        for _ in range(3):
            x = torch.log(self.cell(x) - 5.0)
        return x


@pytest.fixture(scope="module")
def nan_loop():
    torch.manual_seed(0)
    model, x = LoopIntoNaN(), torch.randn(2, 4)
    clean = tl.trace(model, (x,), record_finite=True, grads=True)
    clean.output.nan_to_num().sum().backward()
    return clean, tl.trace(model, (x,), intervene={"cell:3": tl.zero_ablate()})


def rolled_linear(log) -> dict:
    records = viewer_data(log.render(format="html", view="rolled"))["items"]
    return next(rec for rec in records.values() if rec["label"] == "linear_1_1")


def test_the_viewer_record_of_a_rolled_layer_speaks_for_every_pass_not_its_first(nan_loop):
    clean, ablated = nan_loop
    assert [clean[f"linear_1_1:{k}"].finite[0] for k in (1, 2, 3)] == [False, True, True]
    linear = rolled_linear(clean)
    assert linear["finite"] == {"nan": True, "inf": False}  # pass 1 alone would say finite
    assert linear["modules"] == [f"linear_1_1:{k}: cell:{k} (Linear)" for k in (1, 2, 3)]
    assert [line.split(":")[1] for line in linear["gradient"]] == ["1", "2", "3"]
    assert "intervention" not in linear
    changed = rolled_linear(ablated)  # the action replaced pass 3's output only
    assert changed["intervention"] == ["linear_1_1:3: zero_ablate() at cell:3"]


def test_the_viewer_record_of_a_rolled_layer_adds_up_the_device_times_of_its_passes(nan_loop):
    clean, _ = nan_loop
    times = {"linear_1_1:2": 2e-3, "linear_1_1:3": 1e-3}
    page = clean.render(format="html", view="rolled", color_by="device_time", device_times=times)
    records = viewer_data(page)["items"].values()
    linear = next(rec for rec in records if rec["label"] == "linear_1_1")
    assert linear["device_time"] == "3 ms over 2 of 3 passes"  # pass 1 has no time: neither it nor 0 stands for all
    log_op = next(rec for rec in records if rec["label"] == "log_1_3")
    assert log_op["device_time"] == "unknown"


class Scored(nn.Module):
    """A linear head (a FLOPs formula) and a cross-entropy (none) in one module call."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 3)

    def forward(self, x, target):
        return nn.functional.cross_entropy(self.head(x), target)


class ScoredNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.scored = Scored()

    def forward(self, x, target):
        return self.scored(x, target)


def node_value(dot, title) -> str:
    """The value row under a node's title and counts (the last small-font row of its label)."""
    line = next(line for line in dot.splitlines() if f"<b>{title}" in line)
    return re.findall(r'<font point-size="8">([^<]*)</font>', line)[-1]


def test_a_node_whose_sum_leaves_out_ops_with_no_value_marks_it_a_lower_bound():
    log = tl.trace(ScoredNet(), (torch.randn(2, 4), torch.tensor([0, 2])))
    rows = {row["call"]: row for row in log.summary().rows}
    collapsed = log.render(depth=0, color_by="flops")  # the linear's FLOPs, and a cross-entropy with none
    assert node_value(collapsed, "scored:1") == f"{rows['scored:1']['flops']}+"
    assert node_value(log.render(depth=1, color_by="flops"), "scored.head:1") == str(rows["scored.head:1"]["flops"])
    assert "marked + when some of them have no value" in collapsed
    loop = tl.trace(LoopIntoNaN(), (torch.randn(2, 4),))
    timed = loop.render(view="rolled", color_by="device_time", device_times={"linear_1_1:2": 2e-3})
    assert node_value(timed, "linear_1_1 ") == "2 ms+"  # passes 1 and 3 were not timed
    full = {f"linear_1_1:{k}": 1e-3 for k in (1, 2, 3)}
    assert node_value(loop.render(view="rolled", color_by="device_time", device_times=full), "linear_1_1 ") == "3 ms"


class LogBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(self.fc(x) - 5.0)  # NaN: the linear's outputs are far below 5


def test_a_collapsed_module_with_unchecked_ops_is_not_drawn_checked_finite():
    from torchlens.viz.metrics import FINITE_FILL, ORIGIN_FILL, UNKNOWN_FILL

    model, x = nn.Sequential(LogBlock()), torch.randn(2, 4)
    fill = re.compile(r'fillcolor="([^"]+)".*<b>0:1 \(LogBlock\)</b>')
    # only the linear was saved: it is finite, the unsaved log that made the NaN is unchecked
    partly = tl.trace(model, (x,), save=["linear"])
    assert fill.search(partly.render(depth=0, color_by="nonfinite")).group(1) == UNKNOWN_FILL
    checked = tl.trace(model, (x,), record_finite=True)
    assert fill.search(checked.render(depth=0, color_by="nonfinite")).group(1) == ORIGIN_FILL  # the NaN began inside
    finite = tl.trace(nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU())), (x,), record_finite=True)
    assert re.search(rf'fillcolor="{FINITE_FILL}".*<b>0:1 \(Sequential\)</b>', finite.render(depth=0,
                                                                                          color_by="nonfinite"))
