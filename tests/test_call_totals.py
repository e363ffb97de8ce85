"""A torch call that returns several tensors (``chunk``, ``split``, ``topk``) takes one duration: every total of
durations counts it once, as ``tl.debug.hot_path`` does.  Phi-3's MLP chunks its gate and up projections."""

import math
import re
import os

import pytest
import torch

import torchlens as tl
from torchlens.viz.metrics import format_value

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def phi3():
    transformers = pytest.importorskip("transformers")
    config = transformers.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=99, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    return tl.trace(model, (), {"input_ids": torch.randint(0, 99, (2, 8))})


def _chunk_ops(log):
    ops = [op for op in log.ops if op.func_name == "chunk"]
    assert ops and {op.multi_output_index for op in ops} == {0, 1}  # the case under test is there
    return ops


def test_the_ops_table_holds_a_calls_duration_once_so_its_column_sums_to_the_hot_path_total(phi3):
    frame = phi3.to_pandas().set_index("label")
    for op in _chunk_ops(phi3):
        shown = frame.loc[op.label, "duration"]
        if op.multi_output_index == 0:
            assert shown == op.duration > 0
        else:  # the call's time is on its first output's row; op.duration still gives it here
            assert math.isnan(shown) and op.duration > 0
    assert frame["duration"].sum() == pytest.approx(tl.debug.hot_path(phi3).total, rel=1e-12)


def test_the_layers_table_sums_to_the_hot_path_total_too(phi3):
    frame = phi3.layers.to_pandas()
    assert frame["duration"].sum() == pytest.approx(tl.debug.hot_path(phi3).total, rel=1e-12)


def test_a_collapsed_module_coloured_by_duration_shows_its_calls_time_counted_once(phi3):
    rows = {row["address"]: row["total"] for row in tl.debug.hot_path(phi3, group="module")}
    dot = phi3.render(color_by="duration", format="dot", depth=2)
    node = next(line for line in dot.splitlines() if "model.layers.0.mlp:1 (Phi3MLP)" in line)
    assert f">{format_value('duration', rows['model.layers.0.mlp:1'])}</font>" in node


class _Halves(torch.nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)  # one call, two outputs
        return a * 2, b + 1  # the module call returns both


class _HalvesLoop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.halves, self.fc = _Halves(), torch.nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(3):
            a, b = self.halves(x)
            x = self.fc(torch.cat([b, a], -1))
        return x


@pytest.fixture(scope="module")
def halves_loop():
    return tl.trace(_HalvesLoop(), torch.randn(2, 8))


def _node_values(dot) -> dict:
    """``{node title: duration shown}`` for the nodes of a dot drawing coloured by duration."""
    values = {}
    for line in dot.splitlines():
        title, value = re.search(r"<b>([^<]*)</b>", line), re.search(r'point-size="8">([0-9.]+ [mµn]?s)</font>', line)
        if "[id=" in line and title and value:
            values[title.group(1)] = value.group(1)
    return values


def test_rolled_nodes_of_a_multi_output_call_count_its_time_on_its_first_output(halves_loop):
    """A rolled node sums its passes' durations, each call once, on the output the tables and hot_path hold it
    on: the chunk node (drawn with its second output as a port) and the rolled module box agree with to_pandas."""
    log = halves_loop
    once = log.to_pandas().set_index("label")["duration"]
    chunk = [op for op in log.ops if op.func_name == "chunk"]
    assert len(chunk) == 6 and {op.multi_output_index for op in chunk} == {0, 1}
    first = [op.label for op in chunk if op.multi_output_index == 0]
    rolled = _node_values(log.render(format="dot", view="rolled", color_by="duration"))
    assert rolled[f"{chunk[0].layer_label} \u00d73"] == format_value("duration", once[first].sum())
    inside = [op.label for op in log.ops if op.module is not None and op.module.startswith("halves:")]
    boxed = _node_values(log.render(format="dot", view="rolled", color_by="duration", depth=0))
    assert boxed["halves (_Halves) \u00d73 calls"] == format_value("duration", once[inside].sum())
    assert once[inside].sum() == pytest.approx(sum(r["total"] for r in tl.debug.hot_path(log, group="module")
                                                   if r["address"].startswith("halves:")), rel=1e-12)
