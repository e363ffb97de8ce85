"""What ``print(log)`` and the hot path say: counts that agree, words that fit, paths a reader can use."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl
from torchlens.record.summary import short_path
from zoo import LoopRNN, SharedModule


def test_print_and_hot_path_count_torch_calls_alike():
    log = tl.trace(nn.LSTM(4, 4), torch.randn(2, 1, 4))  # lstm returns three tensors from one call
    calls = len({op.func_name + str(op.start_ns) for op in log.ops if op.kind == "op"})
    tensors = sum(1 for op in log.ops if op.kind == "op")
    assert tensors > calls
    assert f"{tensors} tensors from {calls} torch calls" in str(log)
    for by in ("duration", "memory", "flops"):
        assert f": {calls} torch calls," in str(tl.debug.hot_path(log, by=by))

    class Unknown(nn.Module):  # an op no FLOPs formula covers is excluded, and the count says of how many
        def forward(self, x):
            return torch.linalg.det(x).relu()

    unknown = tl.trace(Unknown(), torch.randn(3, 3))
    ranked = tl.debug.hot_path(unknown, by="flops")
    assert ranked.excluded and "1 of 2 torch calls" in str(ranked) and "(2 torch calls" in str(unknown)


def test_the_roster_says_how_to_see_what_it_cut():
    text = str(tl.trace(LoopRNN(), torch.randn(2, 8)))
    assert "more ops (every op: log.ops, or log.to_pandas())" in text


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


class ReusedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        x = self.block(x)
        return self.block(x)  # the same module again, from another line: reuse, not a loop


def test_a_module_reused_from_several_lines_is_reused_not_recurrent():
    for model in (SharedModule(), ReusedBlock()):
        text = str(tl.trace(model, torch.randn(2, 8)))
        assert "reused modules" in text and "recurrent" not in text
    assert "recurrent (up to 16 passes" in str(tl.trace(LoopRNN(), torch.randn(2, 8)))


class TwiceOneWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        x = F.linear(x, self.weight)
        return F.linear(x, self.weight)  # one parameter on two lines: no module is called twice


class Countdown(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, n):
        return self.fc(x) if n == 0 else self(x + 1, n - 1)


def test_a_parameter_used_on_two_lines_is_not_called_a_reused_module():
    # It read "reused modules (a module called from several places ...)" for a model that calls no module.
    assert "; reused parameters (a parameter used from several places: up to 2 passes of one layer; no loop)" in \
        str(tl.trace(TwiceOneWeight(), torch.randn(2, 8)))
    shared, twice = SharedModule(), TwiceOneWeight()
    both = tl.trace(lambda x: twice(shared(x)), torch.randn(2, 8))
    assert "reused modules and parameters (a module called, or a parameter used, from several" in str(both)
    # The root forward is the root module's first call: a forward calling itself again reuses that module.
    countdown = tl.trace(Countdown(), (torch.randn(2, 4), 2))
    assert [op.label for op in countdown if op.func_name == "add"] == ["add_1_1:1", "add_1_1:2"]
    assert "; reused modules (a module called from several places" in str(countdown)


def test_source_paths_are_relative_to_the_working_directory_or_the_import_root():
    functional = torch.nn.functional.__file__
    assert short_path(functional) == os.path.join("torch", "nn", "functional.py")
    assert short_path(os.path.abspath(__file__)) == os.path.relpath(__file__)


def test_a_while_loop_body_groups_every_op_it_runs():
    def halve_until_small(x):
        while x.mean() > 0:
            x = x - 0.1
        return x

    log = tl.trace(halve_until_small, torch.ones(3))
    # The test runs once more than the body, its first run too (compiled apart, before the loop): one layer.
    passes = [(layer.first.func_name, layer.num_passes) for layer in log.layers if layer.first.kind == "op"]
    assert passes == [("mean", 11), ("gt", 11), ("sub", 10)]


def test_a_single_op_chain_stays_separate_layers():
    def add_three_times(x):
        for _ in range(3):
            x = x + 1
        return x

    log = tl.trace(add_three_times, torch.ones(3))
    assert [layer.num_passes for layer in log.layers if layer.first.kind == "op"] == [1, 1, 1]


def test_inputs_buffers_and_outputs_are_shown_by_their_place_not_a_function_they_lack():
    """An input, buffer or output record was made by no torch function: its repr and its layer's named it
    ``none(...)``; they name the place it sat in, as ``print(log)`` does."""
    model = nn.BatchNorm1d(3).eval()
    log = tl.trace(model, torch.randn(2, 3))
    assert repr(log["input_1:1"]) == "<Op input_1:1 input.input (2x3, float32)>"
    assert repr(log["buffer_1:1"]) == "<Op buffer_1:1 running_mean (3, float32)>"
    assert repr(log["output_1"]) == "<Layer output_1 (output, 1 pass)>"
    assert repr(log["batchnorm_1_1:1"]) == "<Op batchnorm_1_1:1 batch_norm(2x3, float32)>"
    assert "none" not in " ".join(repr(op) for op in log.ops)


def test_the_roster_keeps_its_columns_in_line_past_long_entries():
    # The label and function columns were capped (40 and 32 characters): GPT-2's cache outputs
    # (output.past_key_values.layers.0.keys) pushed their shapes out of line with every other op's.
    import pytest

    pytest.importorskip("transformers")
    import real_models

    model, args, kwargs = real_models.build("gpt2")
    with real_models.in_mode(model, "eval"):
        log = tl.trace(model, args, dict(kwargs, use_cache=True))  # the cache's tensors are outputs
    rows = [line for line in str(log).split("\nOps:\n")[1].splitlines() if not line.lstrip().startswith("...")]
    assert any(len(op.io_path or "") > 32 for op in log.outputs)
    starts = set()
    for line in rows:
        rest = line.split("  @")[0].rstrip()  # the module call, where there is one, comes after the shape
        starts.add(len(rest) - len(rest.split()[-1]))
    assert len(rows) == 35 and len(starts) == 1  # the first 30 ops and the last 5
