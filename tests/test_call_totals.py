"""A torch call that returns several tensors (``chunk``, ``split``, ``topk``) takes one duration: every total of
durations counts it once, as ``tl.debug.hot_path`` does.  Phi-3's MLP chunks its gate and up projections."""

import math
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
