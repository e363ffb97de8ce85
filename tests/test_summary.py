"""``log.summary()``: the module tree table, with counts that are right where other summaries are not."""

from __future__ import annotations

import copy
import os
import pickle
import weakref

import pytest
import torch

import torchlens as tl
from torchlens.record.op import Op

from real_models import build
from test_io import _without_key
from zoo import MLP, SharedModule

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _tied_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval(), torch.randint(0, 100, (1, 5))


def test_tied_embedding_counts_once_and_flops_are_flops():
    model, ids = _tied_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie the count must not double
    log = tl.trace(model, ids)
    table = log.summary()
    root = table[0]
    assert root["params"] == sum(p.numel() for p in model.parameters())
    assert root["params"] < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert table["lm_head:1"]["params"] == model.lm_head.weight.numel()
    assert root["flops"] == int(log.flops)
    assert table["lm_head:1"]["flops"] == 2 * 5 * 32 * 100  # a (5x32)@(32x100) matmul: 2 FLOPs per multiply-add
    assert table["transformer.h.0:1"]["input_shapes"] == [(1, 5, 32), (1, 5)]  # then position_ids=, by keyword
    assert table["lm_head:1"]["output_shapes"] == [(1, 5, 100)]
    text = str(table)
    assert "FLOPs" in text and "MB" not in text and "lm_head:1" in text
    assert f"{root['params']:,}" in text


def test_rows_follow_module_calls_and_depth_limits_them():
    log = tl.trace(MLP(), torch.randn(2, 16))
    full = log.summary()
    assert [r["call"] for r in full.rows[1:]] == [c.label for c in log.module_calls]
    assert [r["call"] for r in log.summary(depth=1).rows] == ["MLP", "layers.0:1", "layers.1:1", "layers.2:1",
                                                              "head:1"]
    assert len(log.summary(depth=0)) == 1
    with pytest.raises(ValueError, match="depth"):
        log.summary(depth=-1)
    # summary[True] gave row 1, and summary[100] said only "list index out of range".
    with pytest.raises(TypeError, match=r"index a summary with a row number or a module call .* not a bool"):
        full[True]
    with pytest.raises(IndexError, match=rf"summary row 100 is out of range: this summary has {len(full)} rows"):
        full[100]
    # A misspelled call or a module's address listed the first eight rows only, and None or 1.5 read as a name.
    with pytest.raises(KeyError, match=r"no row 'layers\.0' in this summary \(a row is a module call, 'fc1:1'\); "
                                       r"closest: layers\.0:1"):
        full["layers.0"]
    with pytest.raises(KeyError, match=r"no row 'layres\.2:1' .*; closest: layers\.2:1"):
        full["layres.2:1"]
    with pytest.raises(KeyError, match=r"no row 'relu_1_2:1' .*; rows: MLP, layers\.0:1, "):
        full["relu_1_2:1"]
    for key in (None, 1.5):
        with pytest.raises(TypeError, match=rf"index a summary with a row number or a module call .* not "
                                            rf"{type(key).__name__}$"):
            full[key]
    layer = full["layers.0:1"]
    assert layer["class_name"] == "Linear" and layer["params"] == 16 * 16 + 16
    assert layer["activation_bytes"] == 2 * 16 * 4
    assert layer["ops"] == 1 and layer["duration"] > 0
    frame = full.to_pandas()
    assert list(frame["call"]) == [r["call"] for r in full.rows]
    assert "saved_for_backward_bytes" not in frame.columns


def test_a_module_called_twice_has_a_row_per_call():
    log = tl.trace(SharedModule(), torch.randn(2, 8))
    calls = [r["call"] for r in log.summary().rows]
    shared = [c.label for c in log.module_calls if c.module.num_calls > 1]
    assert shared and set(shared) <= set(calls)


def test_a_kept_summary_holds_no_trace_and_pickles_and_copies_as_a_table(tmp_path, no_collector):
    # The summary held its trace: a list of summaries kept every trace's activations and model alive, and pickling
    # or deep-copying one was refused as "a Trace cannot be pickled".
    model, ids = _tied_gpt2()
    log = tl.trace(model, ids, intervene={"transformer.h.0": tl.zero_ablate()})
    table = log.summary()
    trace, activation = weakref.ref(log), weakref.ref(log["transformer.h.1"].activation)
    del log
    assert trace() is None and activation() is None
    torch.save(table, tmp_path / "summary.pt")
    for copied in (pickle.loads(pickle.dumps(table)), copy.deepcopy(table), copy.copy(table),
                   torch.load(tmp_path / "summary.pt", weights_only=False)):
        assert copied.rows == table.rows and copied.columns == table.columns and str(copied) == str(table)
    # The notes on the parameter count are kept with it (a callable traced without root= has no model to count).
    head = model.lm_head
    rootless = tl.trace(lambda x: head(x).relu(), torch.randn(2, 32)).summary()
    assert "<lambda> was traced without root=" in str(pickle.loads(pickle.dumps(rootless)))


def test_a_call_label_is_in_the_summary_it_indexes():
    # `"layers.0:1" in table` was False while table["layers.0:1"] found the row: `in` fell back to comparing the
    # label with each row dict.
    model, ids = _tied_gpt2()
    table = tl.trace(model, ids).summary()
    assert table["lm_head:1"]["call"] == "lm_head:1" and "lm_head:1" in table and table[3] in table
    assert "GPT2LMHeadModel" in table and "lm_head" not in table and "nope:1" not in table and 3 not in table
    assert list(table) == table.rows


def test_summary_survives_cleanup():
    log = tl.trace(MLP(), torch.randn(2, 16))
    before = log.summary().rows
    log.cleanup()
    after = log.summary().rows
    assert [(r["call"], r["params"], r["flops"]) for r in after] == [(r["call"], r["params"], r["flops"])
                                                                      for r in before]


def test_saved_for_backward_column_appears_when_the_trace_recorded_it():
    model = MLP()
    log = tl.trace(model, torch.randn(2, 16, requires_grad=True), saved_for_backward=True)
    table = log.summary()
    assert "saved_for_backward_bytes" in table.columns
    # The root row counts every distinct storage autograd kept once, as the trace-wide total does.
    assert table[0]["saved_for_backward_bytes"] == log.saved_for_backward_bytes > 0
    # A Linear keeps its input for the weight gradient: the head's row has bytes, and no more than the whole.
    assert 0 < table["head:1"]["saved_for_backward_bytes"] <= table[0]["saved_for_backward_bytes"]
    assert "Saved for bwd" in str(table)


def _per_module_counts(model) -> dict:
    return {address: sum(p.numel() for p in module.parameters()) for address, module in model.named_modules()}


def test_parameter_counts_are_the_forwards_even_when_the_model_grows_afterwards():
    model, ids = _tied_gpt2()
    expected = _per_module_counts(model)  # plain PyTorch, before anything changes
    log = tl.trace(model, ids)
    # After the trace, an adapter is added inside an attention layer and the tied head is replaced.
    attn = model.transformer.h[0].attn
    attn.register_parameter("adapter", torch.nn.Parameter(torch.zeros(1000)))
    model.lm_head = torch.nn.Linear(32, 100, bias=True)
    table = log.summary()
    for row in table.rows[1:]:
        address = row["call"].rsplit(":", 1)[0]
        assert row["params"] == expected[address], row["call"]
    assert table[0]["params"] == expected[""]
    assert table["transformer:1"]["params"] <= table[0]["params"]


def test_parameter_sizes_are_those_the_forward_read_when_resized_or_cast_in_place_later():
    """A weight resized or cast in place after the trace once showed its new size in a table or log.params not yet
    read: the sizes, shapes and dtypes are those the forward read, whenever they are first read."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    unread, read = tl.trace(model, torch.randn(2, 4)), tl.trace(model, torch.randn(2, 4))
    assert read.summary()[0]["params"] == 30 and read.params[2].dtype == torch.float32
    with torch.no_grad():
        model[2].weight.requires_grad_(False).resize_(8, 4)
    model.double()
    for log in (unread, read):
        assert log.summary()[0]["params"] == 30 and log.params[2].shape == (2, 4)
        assert log.params[2].dtype == torch.float32


def test_param_records_keep_the_requires_grad_the_forward_used():
    """Freezing a block after the trace (as a fine-tuning notebook does) leaves the trace's parameter records
    with the flags the forward ran under."""
    model, ids = _tied_gpt2()
    before = {name: p.requires_grad for name, p in model.named_parameters()}
    log = tl.trace(model, ids)
    model.transformer.h[0].requires_grad_(False)  # frozen after the trace
    assert all(before.values()) and not model.transformer.h[0].attn.c_attn.weight.requires_grad
    assert {p.address: p.requires_grad for p in log.params} == before
    assert {p.address: p.requires_grad for p in tl.trace(model, ids).params} != before  # a new trace: frozen


def test_a_loaded_trace_shows_the_live_parameter_counts(tmp_path):
    model, ids = _tied_gpt2()
    live = tl.trace(model, ids).summary()
    loaded = tl.load(tl.trace(model, ids).save(tmp_path / "t")).summary()
    assert [r["call"] for r in loaded.rows] == [r["call"] for r in live.rows]
    assert loaded[0]["params"] == live[0]["params"]  # the tied weight still once
    assert loaded["lm_head:1"]["params"] == live["lm_head:1"]["params"]
    assert loaded["transformer.h.0:1"]["params"] == live["transformer.h.0:1"]["params"]
    assert [r["flops"] for r in loaded.rows] == [r["flops"] for r in live.rows]
    assert "counts the parameters its ops used" not in str(loaded)  # the live counts were saved


def test_a_trace_saved_after_cleanup_keeps_its_parameter_counts_or_says_they_are_unknown(tmp_path):
    import json

    from torchlens.io.format import sha256_of

    log = tl.trace(MLP(), torch.randn(2, 16))
    live = log.summary()
    log.cleanup()
    folder = log.save(tmp_path / "c")
    table = tl.load(folder).summary()
    assert table[0]["params"] == live[0]["params"] and table["head:1"]["params"] == live["head:1"]["params"]
    assert table[0]["flops"] == live[0]["flops"]
    # A folder written before saved traces kept their parameter table and counts: unknown, never 0.
    path = os.path.join(folder, "trace.json")
    with open(path) as fh:
        record = json.load(fh)
    del record["params"], record["module_param_counts"]
    with open(path, "w") as fh:
        json.dump(record, fh)
    manifest_path = os.path.join(folder, "manifest.json")
    with open(manifest_path) as fh:
        manifest = json.load(fh)
    manifest["files"]["trace.json"] = {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}
    with open(manifest_path, "w") as fh:
        json.dump(manifest, fh)
    old = tl.load(folder).summary()
    assert old[0]["params"] is None and old["head:1"]["params"] is None
    assert old[0]["flops"] == live[0]["flops"]
    assert "Parameters: unknown" in str(old)


def _loaded_without_parameter_table(tmp_path):
    """A small BERT's trace, saved and loaded as a torchlens from before the parameter table wrote it."""
    model, args, kwargs = build("bert")
    folder = tl.trace(model.eval(), args, kwargs).save(tmp_path / "old")
    for key in ("params", "module_param_counts"):
        _without_key(folder, key)
    return tl.load(folder)


def test_a_trace_from_a_file_without_the_parameter_table_saved_again_keeps_its_parameter_counts(tmp_path):
    # The copy was written with an empty table, read as a model without parameters: Parameters: 0, 0 on every row.
    old = _loaded_without_parameter_table(tmp_path)
    again = tl.load(old.save(tmp_path / "again"))
    assert old.summary()[0]["params"] > 0
    assert again.summary().rows == old.summary().rows
    assert str(again.summary()) == str(old.summary())


def test_the_parameters_of_a_trace_whose_file_has_no_parameter_table_are_refused_not_listed_as_none(tmp_path):
    # log.params was an empty list, as if the model had no parameters, beside a summary counting 23,554.
    old = _loaded_without_parameter_table(tmp_path)
    with pytest.raises(tl.TorchlensError, match=r"log\.params: the trace loaded from .* was saved by an earlier "
                                                "torchlens, which kept no table of the model's parameters"):
        old.params
    assert old.summary()[0]["params"] > 0  # counted from the parameters the ops used


def test_counts_of_one_read_in_the_singular():
    # The texts read "1 torch calls, 1 inputs", "used by 1 ops" and, in the graph, "1 ops" for a module box.
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = torch.nn.Linear(3, 3), torch.nn.ReLU()

        def forward(self, x):
            return self.act(self.lin(x))

    log = tl.trace(Head(), torch.randn(2, 3))
    text = str(log)
    assert "4 ops (2 torch calls, 1 input, 1 output), 4 layers" in text
    assert "2 modules, 2 module calls" in text and "4 activations saved" in text
    assert repr(log.params[0]) == "<Param lin.weight (3, 3), used by 1 op>"
    assert repr(log.layers[1]).endswith("(linear, 1 pass)>")
    assert "1 op<" in log.render(format="dot", depth=0) and "1 ops" not in log.render(format="dot", depth=0)


def test_counts_of_one_read_in_the_singular_in_the_command_line_module_tree():
    # The command line's module tree read "1 ops" for an nn.ReLU's call.
    from torchlens.cli import module_tree

    log = tl.trace(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()), torch.randn(2, 3))
    tree = module_tree(log, 2)
    assert "    1 op  " in tree and "1 ops" not in tree, tree


def test_the_table_keeps_its_columns_in_line_past_long_call_labels():
    # Columns were capped at 48 characters: T5's deepest calls (encoder.block.0.layer.0.SelfAttention.q:1, indented
    # five levels) pushed their parameters, shapes, ops, FLOPs, time and bytes out of line with every other row.
    pytest.importorskip("transformers")
    import real_models

    model, args, kwargs = real_models.build("t5")
    with real_models.in_mode(model, "eval"):
        table = tl.trace(model, args, kwargs).summary()
    lines = str(table).splitlines()[: len(table) + 2]  # the header, its rule and one line per row
    assert max(len("  " * (row["depth"] + 1) + row["call"]) for row in table.rows) > 48
    # Every column is right-aligned up to the last, "Act. mem": rows in line all end at the same place.
    assert len({len(line) for line in lines}) == 1


@pytest.mark.parametrize("n, count, short, size", [
    (999, "999", "999", "999 B"),
    (999_994, "999.99 k", "1M", "976.6 KiB"),
    (999_999, "1.00 M", "1M", "976.6 KiB"),
    (1_048_575, "1.05 M", "1.05M", "1.0 MiB"),
    (999_999_999, "1.00 G", "1G", "953.7 MiB"),
    (999.5, "999", "1k", "1000 B"),
    (999_995, "1.00 M", "1M", "976.6 KiB"),
    (999_999_999_999, "1000.00 G", "1T", "931.3 GiB"),
    (999_999_999_999_999, "1000000.00 G", "1P", "931322.6 GiB"),
    (-999_999, "-1.00 M", "-1M", "-976.6 KiB"),
])
def test_a_figure_that_rounds_up_to_a_thousand_of_its_unit_is_shown_in_the_next(n, count, short, size):
    # 999,999 FLOPs read "1000.00 k" in the summary and "1e+03k" in a rendered node, and 1,048,575 bytes
    # "1024.0 KiB": each rounded in its unit, chosen before rounding.
    from torchlens.record.module_table import human_count
    from torchlens.record.summary import human_bytes
    from torchlens.viz.metrics import format_count

    assert (human_count(n), format_count(n), human_bytes(n)) == (count, short, size)


def test_both_count_forms_take_their_unit_from_one_chooser(monkeypatch):
    # The summary's "1.00 M" and a node's "1M" pick the unit by one rule: a chooser that moves up a unit
    # changes both, and the byte form through the same rule with its 1024 steps.
    from torchlens.record import module_table, summary
    from torchlens.viz import metrics

    calls = []
    real = summary.unit_for
    monkeypatch.setattr(module_table, "unit_for", lambda *a: calls.append("table") or real(*a))
    monkeypatch.setattr(metrics, "unit_for", lambda *a: calls.append("node") or real(*a))
    assert (module_table.human_count(1500), metrics.format_count(1500)) == ("1.50 k", "1.5k")
    assert calls == ["table", "node"]


def test_the_op_count_of_print_log_names_every_part_it_counts_buffers_included():
    # Granite's rotary embedding reads its inv_freq buffer: print(log) said "156 ops (149 torch calls, 1 input,
    # 5 outputs)", parts adding up to 155, the buffer op left unnamed.
    import re

    transformers = pytest.importorskip("transformers")
    config = transformers.GraniteConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=99)
    log = tl.trace(transformers.GraniteForCausalLM(config).eval(), torch.randint(0, 99, (1, 6)))
    kinds = [op.kind for op in log.ops]
    head = re.search(r"(\d+) ops \((\d+) torch calls, (\d+) input, (\d+) buffer, (\d+) outputs\)", str(log))
    assert head is not None and kinds.count("buffer") >= 1
    total, *parts = map(int, head.groups())
    assert total == len(log.ops) == sum(parts)
    assert parts == [kinds.count(kind) for kind in ("op", "input", "buffer", "output")]
