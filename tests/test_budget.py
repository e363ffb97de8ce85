"""``max_saved_bytes``: saving stops at the budget, with a warning naming the first unsaved op, while
every op's metadata is still recorded and the model's result is untouched.  Each ``@CASE`` returns its
row of docs/reliability.md.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from torchlens.validate import outputs_equal  # noqa: E402
from reliability_cases import case, outcome, titles  # noqa: E402
from untouched import assert_clean_process  # noqa: E402

CASE = case("Memory budget")


class Deep(nn.Module):
    """``depth`` rounds of linear -> relu -> in-place scale on a (4, 256) float tensor (4 KiB each)."""

    def __init__(self, depth: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(256, 256)
        self.depth = depth

    def forward(self, x):
        for _ in range(self.depth):
            x = torch.relu(self.fc(x))
            x.mul_(0.5)
        return x


def trace_with_budget(model, x, budget, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log = tl.trace(model, x, max_saved_bytes=budget, **kwargs)
    messages = [str(w.message) for w in caught if "max_saved_bytes" in str(w.message)]
    return log, messages


@CASE
def budget_stops_saving_midway():
    """A budget that holds the first few activations of a deeper model."""
    x = torch.randn(4, 256)
    budget = 5 * 4096
    log, messages = trace_with_budget(Deep(), x, budget)
    assert outputs_equal(log.output, Deep()(x))
    saved = [op.has_activation for op in log.ops if op.kind != "output"]
    first_unsaved = saved.index(False)
    assert all(saved[:first_unsaved]) and not any(saved[first_unsaved:]), "saving must stop, not skip"
    label = log.ops[first_unsaved].label
    assert messages == [f"max_saved_bytes reached: activations from {label} on were not saved"], messages
    assert log.saved_bytes <= budget
    assert all(op.shape == (4, 256) for op in log.ops[1:])  # metadata of unsaved ops is complete
    result = log.validate()
    assert result.passed and {reason for _, reason in result.not_replayed} == {"its own output was not saved"}
    assert_clean_process()
    return (f"saved {first_unsaved} of {len(saved)} activations ({log.saved_bytes} of {budget} bytes); "
            f"warning names {label}; every op's metadata recorded")


@CASE
def zero_budget():
    """A budget of zero bytes."""
    log, messages = trace_with_budget(Deep(2), torch.randn(4, 256), 0)
    assert not any(op.has_activation for op in log.ops) and log.saved_bytes == 0
    assert messages == ["max_saved_bytes reached: activations from input_1:1 on were not saved"]
    return "nothing saved; the warning names the input as the first unsaved tensor"


@CASE
def ample_budget():
    """A budget larger than everything the model produces."""
    log, messages = trace_with_budget(Deep(3), torch.randn(4, 256), 10**9)
    assert messages == [] and all(op.has_activation for op in log.ops)
    return "everything saved, no warning"


@CASE
def budget_with_selection():
    """A budget combined with save=[op types]."""
    log, messages = trace_with_budget(Deep(6), torch.randn(4, 256), 2 * 4096, save=["relu"])
    saved = [op.label for op in log.ops if op.has_activation]
    assert saved == ["relu_1_2:1", "relu_1_2:2"], saved
    assert messages == ["max_saved_bytes reached: activations from relu_1_2:3 on were not saved"], messages
    return "only selected ops count against the budget; the warning names the first selected op left out"


@CASE
def budget_bounds_a_large_trace():
    """2,000 ops of 64 KiB each (125 MiB if all were kept) under a 1 MiB budget."""
    class Wide(nn.Module):
        def forward(self, x):
            for _ in range(1000):
                x = (x * 0.5).add(1.0)  # tends to 2: no denormals to slow it down
            return x

    budget = 1 << 20
    log, messages = trace_with_budget(Wide(), torch.randn(128, 128), budget)
    assert len(log.ops) == 2002 and log.saved_bytes <= budget and len(messages) == 1
    kept = sum(op.has_activation for op in log.ops)
    return f"kept {kept} activations ({log.saved_bytes} bytes), stopped at {messages[0].split()[4]}"


@pytest.mark.parametrize("title", titles("Memory budget"))
def test_case(title):
    assert outcome("Memory budget", title)


def test_a_sparse_tensor_counts_the_indices_and_values_it_stores():
    # A 1000 x 1000 adjacency of three entries was counted as its dense four megabytes: a 100 kB budget
    # refused to save it (and everything after it), and log.saved_bytes reported bytes nobody held.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adj = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [1, 2, 0]]), torch.ones(3), (1000, 1000)).coalesce()
        log = tl.trace(lambda a: (a * 2, a.to_sparse_csr()), adj, max_saved_bytes=100_000)
    assert all(op.has_activation for op in log)
    coo, csr = log["mul_1_1:1"].activation, log["tosparsecsr_1_2:1"].activation
    stored = sum(p.numel() * p.element_size() for t in (adj, coo) for p in (t.indices(), t.values()))
    stored += sum(p.numel() * p.element_size() for p in (csr.crow_indices(), csr.col_indices(), csr.values()))
    assert log.saved_bytes == stored < 100_000
    assert log["mul_1_1:1"].nbytes == 4_000_000  # the op's own size stays that of its dense shape


def _four_block_gpt2():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=99, n_positions=16)
    return GPT2Model(config).eval(), torch.randint(0, 99, (2, 8), generator=torch.Generator().manual_seed(1))


def test_a_selection_of_every_block_holds_one_blocks_inner_ops_at_a_time():
    # save= every block (tl.extract's usual layers=): each block's inner ops were held until the forward ended,
    # so the selection held as much as save="all" until then; they are let go as each block returns.
    model, ids = _four_block_gpt2()
    blocks = [f"h.{i}" for i in range(4)]
    everything = tl.trace(model, ids)
    budget = everything.saved_bytes // 2  # about two blocks' ops: the whole forward's no longer fits
    log, messages = trace_with_budget(model, ids, budget, save=blocks)
    assert messages == []
    kept = sorted(log.saved_activations)
    assert kept == sorted(i for mc in everything.module_calls if mc.module.address in blocks for i in mc._output_nodes)
    assert all(torch.equal(log.ops[i].activation, everything.ops[i].activation) for i in kept)


def test_a_selected_module_inside_a_selected_module_keeps_its_output_as_the_outer_call_lets_go():
    model, ids = _four_block_gpt2()
    log = tl.trace(model, ids, save=["h.1", "h.1.attn", "h.1.mlp.act"])
    selected = ("h.1", "h.1.attn", "h.1.mlp.act")
    calls = {mc.module.address: mc for mc in log.module_calls if mc.module.address in selected}
    outputs = {i for mc in calls.values() for i in mc._output_nodes}
    assert len(calls) == 3 and len(outputs) >= 3 and sorted(log.saved_activations) == sorted(outputs)


def test_an_op_a_selected_call_kept_aside_and_a_later_one_returned_is_saved():
    class Keeps(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            self.kept = h * 2  # not returned: let go as this call returns ...
            return h + 1

    class Returns(nn.Module):
        def forward(self, keeper):
            return keeper.kept  # ... and returned by the next selected call

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Keeps(), Returns()

        def forward(self, x):
            return self.a(x), self.b(self.a)

    model, x = Model(), torch.randn(2, 4)
    log = tl.trace(model, x, save=["a", "b"])
    op = log["mul_1_2:1"]
    assert op.has_activation and op.dropped_reason is None and torch.equal(op.activation, model.a.kept)
    assert not log["linear_1_1:1"].has_activation  # a's inner op, which no selected call returned


def test_a_tensor_saved_for_two_ops_counts_once_as_log_saved_bytes_counts_it():
    # Dropout in eval mode returns its input itself, so its op saves the tensor its parent saved: the budget
    # counted it twice, and a budget of the trace's own log.saved_bytes stopped saving partway.
    model, ids = _four_block_gpt2()
    with torch.no_grad():
        everything = tl.trace(model, ids)
        log, messages = trace_with_budget(model, ids, everything.saved_bytes)
    assert messages == [] and len(log.saved_activations) == len(everything.saved_activations)
    assert log.saved_bytes == everything.saved_bytes


def test_an_op_returning_a_tensor_that_requires_grad_counts_once_beside_its_parent():
    # With gradients on, each op is saved as its output's detach(): eval-mode dropout, returning the linear's
    # output itself, saved a second object over the same elements, which log.saved_bytes and the budget counted
    # again, so a budget of the trace's own size stopped saving before the last op.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.ReLU()).eval()
    x = torch.randn(2, 4)
    everything = tl.trace(model, x)
    assert everything["dropout_1_2:1"].activation.requires_grad is False
    assert everything.saved_bytes == 3 * 2 * 4 * 4  # the input, the linear's output (twice saved) and the relu's
    log, messages = trace_with_budget(model, x, everything.saved_bytes)
    assert messages == [] and len(log.saved_activations) == len(everything.saved_activations)
    assert log.saved_bytes == everything.saved_bytes
    assert_clean_process()


def test_a_copy_made_before_an_in_place_write_counts_beside_the_written_tensor():
    def forward(x):
        y = x * 2
        y.add_(1)  # y's record now holds a copy of the value before the write; add_'s holds y itself
        return y

    x = torch.randn(64, 64)
    with torch.no_grad():
        everything = tl.trace(forward, x)
        assert everything.saved_bytes == 3 * x.numel() * 4  # the input, the copy, the written tensor
        _, messages = trace_with_budget(forward, x, everything.saved_bytes - 1)
        assert messages == ["max_saved_bytes reached: activations from add_1_2:1 on were not saved"]
        _, messages = trace_with_budget(forward, x, everything.saved_bytes)
        assert messages == []


class _DropoutThenWrite(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.drop = nn.Linear(64, 64), nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(self.fc(x))  # in eval mode the dropout's op saves the linear's tensor itself
        h.relu_()  # a write into the tensor both ops saved: each must keep its value from before it
        return h * 2


def test_ops_that_saved_one_tensor_share_one_copy_before_a_write_and_the_budget_counts_it():
    # The linear's and the dropout's records saved one tensor, counted once; the write made a copy for each, and
    # the budget moved its one count to the copies: it counted one tensor where two were held, so a budget one byte
    # under the trace's own log.saved_bytes saved everything, past its limit, with no warning.
    model, x = _DropoutThenWrite().eval(), torch.randn(16, 64)
    tensor = x.numel() * 4
    with torch.no_grad():
        everything = tl.trace(model, x)
        linear, dropout = everything["linear_1_1:1"].activation, everything["dropout_1_2:1"].activation
        assert linear is dropout and torch.equal(linear, model.fc(x))  # one copy, of the value before the write
        assert everything.saved_bytes == 4 * tensor  # the input, the one copy, the written tensor, the product
        log, messages = trace_with_budget(model, x, everything.saved_bytes - 1)
        assert messages == ["max_saved_bytes reached: activations from mul_1_4:1 on were not saved"]
        assert log.saved_bytes <= everything.saved_bytes - 1
        _, messages = trace_with_budget(model, x, everything.saved_bytes)
        assert messages == []


def test_a_saved_tensor_dropped_for_an_unpredicted_write_leaves_the_budget():
    # A write capture could not predict drops what was saved in that memory mid-forward; the dropped tensor
    # stayed counted, so later ops met a budget that memory no longer held.
    from torchlens.capture.state import CaptureState

    state = CaptureState(save_mode=1, max_saved_bytes=1000)
    t = torch.zeros(100)  # 400 bytes
    state.save(0, t, False)
    assert state.budget.used == 400
    state._drop(0, "overwritten in place by a write capture could not predict")
    assert state.budget.used == 0 and 0 not in state.saved and 0 in state.clobbered
    state.save(1, torch.zeros(200), False)  # 800 bytes: fits now
    assert 1 in state.saved and state.budget_exhausted_at is None


def _wide_then_narrow():
    """4 -> 1000 -> 2: the middle activations (4 KB each) dwarf the last one (8 bytes)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 1000), nn.ReLU(), nn.Linear(1000, 2)), torch.randn(1, 4)


@pytest.mark.parametrize("save", ["linear_2_3:1", lambda op: op.label == "linear_2_3:1"], ids=["label", "predicate"])
def test_a_budget_spent_on_held_ops_names_the_first_selected_op_left_unsaved(save):
    # A label or predicate selection holds every output until the forward ends, and those count against the
    # budget: it ran out at linear_1_1:1, which the selection never asked for, and the warning named that op.
    model, x = _wide_then_narrow()
    log, messages = trace_with_budget(model, x, 100, save=save)
    assert not log["linear_2_3:1"].has_activation and log.budget_exhausted_at == log["linear_2_3:1"].index
    assert len(messages) == 1 and messages[0].startswith(
        "max_saved_bytes reached: activations from linear_2_3:1 on were not saved (save= holds every op"), messages
    assert "saving stopped at linear_2_3:1 (max_saved_bytes)" in str(log)


def test_a_budget_spent_after_every_selected_op_was_saved_warns_of_nothing():
    # The held ops passed the budget only after the one selected op was saved: nothing asked for was left out, yet
    # the warning and log.budget_exhausted_at named an op the selection let go as where saving stopped.
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 2), nn.ReLU(), nn.Linear(2, 1000)), torch.randn(1, 4)
    log, messages = trace_with_budget(model, x, 100, save="relu_1_2:1")
    assert messages == [] and log.budget_exhausted_at is None
    assert [op.label for op in log.ops if op.has_activation] == ["relu_1_2:1"]
    assert torch.equal(log["relu_1_2:1"].activation, model[1](model[0](x)))
    assert "saving stopped" not in str(log)


def test_a_budget_spent_on_held_ops_says_so_when_the_op_it_stopped_at_was_selected():
    # The linear's output (48 bytes) alone fits a budget of 48, but a label selection holds every op, the input
    # (48 bytes) among them: the budget ran out at the selected linear itself, and the warning named it without
    # saying that what was held had spent the budget.
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(3, 4)
    log, messages = trace_with_budget(model, x, 48, save="linear_1_1:1")
    assert not log["linear_1_1:1"].has_activation and log.budget_exhausted_at == log["linear_1_1:1"].index
    assert len(messages) == 1 and messages[0].startswith(
        "max_saved_bytes reached: activations from linear_1_1:1 on were not saved (save= holds every op"), messages


def test_a_module_selection_spends_the_budget_on_its_outputs_alone():
    # It held the input too (which a module may return as it is), and the budget of the linear's output ran out
    # at that output; the module's call saves what it returns as it returns, and holds nothing else.
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(3, 4)
    log, messages = trace_with_budget(model, x, 48, save="0")
    assert messages == [] and log.budget_exhausted_at is None
    assert [op.label for op in log.ops if op.has_activation] == ["linear_1_1:1"]
