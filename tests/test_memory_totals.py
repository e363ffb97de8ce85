"""Activation memory is counted one way everywhere: the bytes of the tensor each op produced, 0 for an in-place op
(it wrote into a tensor another op produced).  ``log.summary()``'s Act. mem, ``hot_path(by="memory")`` and
``color_by="memory"`` agree on Swin-v2, whose position-bias MLP runs ``nn.ReLU(inplace=True)``."""

import os

import pytest
import torch

import torchlens as tl
from torchlens.record.summary import human_bytes

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_MLP = "swinv2.encoder.layers.0.blocks.0.attention.self.continuous_position_bias_mlp:1"


@pytest.fixture(scope="module")
def swinv2():
    transformers = pytest.importorskip("transformers")
    config = transformers.Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                       window_size=4, num_labels=3)
    torch.manual_seed(0)
    model = transformers.Swinv2ForImageClassification(config).eval()
    return tl.trace(model, torch.randn(1, 3, 32, 32))


def _inplace_relus(log):
    ops = [op for op in log.ops if op.is_inplace and op.func_name == "relu"]
    assert ops and all(op.nbytes > 0 for op in ops)  # the case under test is there
    return ops


def test_hot_path_by_memory_gives_an_inplace_op_no_new_bytes(swinv2):
    rows = {row["address"]: row["total"] for row in tl.debug.hot_path(swinv2, by="memory")}
    for op in _inplace_relus(swinv2):
        assert rows[op.label] == 0
        assert rows[op.parents[0]] == swinv2[op.parents[0]].nbytes  # the tensor it wrote into, counted once


def test_every_module_row_of_the_summary_agrees_with_hot_path_by_memory(swinv2):
    _inplace_relus(swinv2)
    hot = tl.debug.hot_path(swinv2, by="memory", group="module")
    totals = {row["address"]: row["total"] for row in hot}
    table = swinv2.summary()
    assert table[0]["activation_bytes"] == hot.total
    summed = {row["call"]: row["activation_bytes"] for row in table.rows[1:]}
    assert set(totals) <= set(summed)
    assert summed == {call: totals.get(call, 0) for call in summed}  # a call that ran no op has no hot row
    assert "an in-place op adds 0" in str(table) and "an in-place op adds 0" in hot.note


def test_a_collapsed_module_coloured_by_memory_shows_its_summary_bytes(swinv2):
    _inplace_relus(swinv2)
    dot = swinv2.render(color_by="memory", format="dot", depth=6)
    node = next(line for line in dot.splitlines() if f"{_MLP} (Sequential)" in line)
    assert f">{human_bytes(swinv2.summary()[_MLP]['activation_bytes'])}</font>" in node
