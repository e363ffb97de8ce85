"""A ``save=`` selection of module addresses holds none of the ops inside each selected call: it saves what the call
returns as it returns (``SelectedModuleOutputs`` in capture/saving.py).  What it does not keep must be freed as an
untraced forward frees it, and what it keeps must be what a ``save="all"`` trace holds for it."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from real_models import build


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.inner = []  # a weak reference to each call's first inner op, which the call does not return

    def forward(self, x):
        h = self.a(x)
        self.inner.append(weakref.ref(h))
        return self.b(torch.relu(h)) + x


class _Blocks(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block() for _ in range(n))
        self.alive_at_end = None

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        # The blocks' inner ops, as the forward ends: nothing but the trace could hold them now.
        self.alive_at_end = [r() is not None for block in self.blocks for r in block.inner]
        return x


def test_the_ops_a_selected_call_lets_go_are_freed_as_it_returns_without_a_budget():
    # Without max_saved_bytes (tl.extract's case) a saved op's binding held the tensor itself, so what a selected
    # call let go stayed in memory until the forward ended: the selection held every block's inner ops at once.
    model, x = _Blocks(), torch.randn(4, 16)
    with torch.no_grad():  # (autograd holds no inner op either)
        log = tl.trace(model, x, save=[f"blocks.{i}" for i in range(3)])
        assert model.alive_at_end == [False, False, False]
        everything = tl.trace(model, x)
    kept = sorted(log.saved_activations)
    assert [log.labels[i] for i in kept] == ["add_1_4:1", "add_2_8:1", "add_3_12:1", "output_1:1"]
    assert all(torch.equal(log.ops[i].activation, everything.ops[i].activation) for i in kept)


class _WideInside(nn.Module):
    """A block whose inner ops alone are 37 wide, the first written in place: none is alive once it returns."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 37), nn.Linear(37, 16)

    def forward(self, x):
        h = self.up(x)
        h.relu_()  # a write predicted before the call: a saved value would be copied first
        return self.down(h * 2) + x


def _storages_of_width(width: int) -> set:
    """The storages of the live tensors ``width`` wide (no Parameter)."""
    return {o.untyped_storage().data_ptr() for o in gc.get_objects()
            if type(o) is torch.Tensor and o.dim() and o.shape[-1] == width}


def _inner_alive_as_each_returns(model, blocks, width: int) -> list:
    """Run ``model`` (traced or not) noting, as each of ``blocks`` returns, how many storages of tensors ``width``
    wide that the run made are alive: those only its inner ops made, which nothing outside it holds."""
    seen, before = [], _storages_of_width(width)

    def count(module, args, output):
        seen.append(len(_storages_of_width(width) - before))

    handles = [block.register_forward_hook(count) for block in blocks]
    try:
        model()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_a_selected_module_holds_none_of_its_inner_ops_nor_copies_them_while_it_runs():
    # Every op inside a selected call was held until the call returned (which one it returns was known only
    # then), and one written in place was copied first: selecting the layers of a transformer held each layer's
    # inner activations (attention scores among them) beside the untraced forward's, near twice its peak.  Its
    # output is saved as the call returns, as a selected module's output made outside it always was.
    blocks = nn.Sequential(_WideInside(), _WideInside())
    x = torch.randn(4, 16)
    with torch.no_grad():
        untraced = _inner_alive_as_each_returns(lambda: blocks(x), blocks, 37)
        traced = _inner_alive_as_each_returns(lambda: tl.trace(blocks, x, save=["0", "1"]), blocks, 37)
        log = tl.trace(blocks, x, save=["0", "1"])
        everything = tl.trace(blocks, x)
    assert untraced == [0, 0] and traced == untraced
    kept = sorted(log.saved_activations)
    assert [log.labels[i] for i in kept] == ["add_1_5:1", "add_2_10:1", "output_1:1"]
    assert all(torch.equal(log.ops[i].activation, everything.ops[i].activation) for i in kept)


def test_a_gpt2_selection_of_its_blocks_holds_no_inner_activation_while_each_runs():
    model, args, kwargs = build("gpt2")
    blocks, width = model.transformer.h, model.config.n_embd * 4  # only the MLP's inner ops are this wide
    with torch.no_grad():
        untraced = _inner_alive_as_each_returns(lambda: model.eval()(*args, **kwargs), blocks, width)
        traced = _inner_alive_as_each_returns(
            lambda: tl.trace(model, args, kwargs, save=["transformer.h.0", "transformer.h.1"]), blocks, width)
    assert untraced == [0, 0] and traced == untraced


def test_a_module_selection_spends_the_budget_on_the_outputs_it_keeps_alone():
    # Each selected call held its inner ops until it returned, and they counted against max_saved_bytes: a budget
    # of two blocks' outputs ran out inside the first block's call, and no output was saved.
    model, x = _Blocks(4), torch.randn(4, 16)
    with torch.no_grad():
        everything = tl.trace(model, x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            log = tl.trace(model, x, save=[f"blocks.{i}" for i in range(4)],
                           max_saved_bytes=everything["blocks.0"].nbytes * 2)
    assert [str(w.message) for w in caught] == [
        f"max_saved_bytes reached: activations from {log['blocks.2'].label} on were not saved"]
    kept = sorted(log.saved_activations)
    assert kept == [log["blocks.0"].index, log["blocks.1"].index]  # nothing from the stop on: block 3's neither
    assert all(torch.equal(log.ops[i].activation, everything.ops[i].activation) for i in kept)


class _KeepsAside(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        self.kept = h * 2  # not returned: no longer referred to as this call returns, returned by _Returns' call
        return h + 1


class _Returns(nn.Module):
    def forward(self, keeper):
        return keeper.kept


class _WideThenAside(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wide, self.a, self.b = nn.Linear(4, 1000), _KeepsAside(), _Returns()

    def forward(self, x):
        return self.wide(x), self.a(x), self.b(self.a)


def test_no_op_from_the_one_the_budget_stopped_at_on_is_saved_as_a_later_selected_call_returns_it():
    # "wide" reaches the budget; "a" then makes what it keeps aside, which "b" returns: after the stop, unsaved,
    # and for the budget, not because "a" let it go (no dropped_reason sending the user to add its label to save=).
    model, x = _WideThenAside(), torch.randn(2, 4)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        log = tl.trace(model, x, save=["wide", "a", "b"], max_saved_bytes=1000)
    assert log.labels[log.budget_exhausted_at] == "linear_1_1:1"  # wide's output
    assert not log.saved_activations
    kept_aside = log["mul_1_3:1"]
    assert not kept_aside.has_activation and kept_aside.dropped_reason is None
    unlimited = tl.trace(model, x, save=["wide", "a", "b"])  # with room, it is saved again as b returns
    assert torch.equal(unlimited["mul_1_3:1"].activation, model.a.kept)


class _Fills(nn.Module):
    """Writes its result into the list it is given and returns nothing."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.inner = []

    def forward(self, x, into: list):
        h = self.fc(x)
        self.inner.append(weakref.ref(h))
        into.append(torch.relu(h) + 1)


class _FillsThenReads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fill, self.after = _Fills(), nn.Linear(16, 16)
        self.alive_after_fill = None

    def forward(self, x):
        into: list = []
        self.fill(x, into)
        self.alive_after_fill = [r() is not None for r in self.fill.inner]
        return self.after(into[0])


def test_a_selected_call_that_returns_nothing_lets_go_of_its_inner_ops_as_it_returns():
    # A call returning None was passed over by the hook, so its inner ops were held until the forward ended.
    model, x = _FillsThenReads(), torch.randn(4, 16)
    with torch.no_grad():
        log = tl.trace(model, x, save=["fill", "after"])
    assert model.alive_after_fill == [False]
    assert [log.labels[i] for i in sorted(log.saved_activations)] == ["linear_2_4:1", "output_1:1"]


class _ScaledInput(nn.Module):
    """A selected call whose input a forward pre-hook of the model's own makes (as torch.nn.utils.weight_norm
    makes a weight): the hook's ops run inside the call."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 16)
        self.made = []
        self.fc.register_forward_pre_hook(self._scale)
        self.alive_after_fc = None

    def _scale(self, module, args):
        scaled = args[0] * 2
        self.made.append(weakref.ref(scaled))
        return (scaled,)

    def forward(self, x):
        h = self.fc(x)
        self.alive_after_fc = [r() is not None for r in self.made]
        return self.head(h)


def test_the_ops_of_a_selected_modules_own_forward_pre_hooks_are_let_go_as_its_call_returns():
    # The call's first record was noted after the model's own pre-hooks had run, so their ops, inside the call,
    # were held until the forward ended.
    model, x = _ScaledInput(), torch.randn(4, 16)
    with torch.no_grad():
        log = tl.trace(model, x, save=["fc"])
        assert model.alive_after_fc == [False]
        everything = tl.trace(model, x)
    assert [log.labels[i] for i in sorted(log.saved_activations)] == ["linear_1_2:1"]
    assert torch.equal(log["fc"].activation, everything["fc"].activation)


class _ReturnsThenWritesUnseen(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = _KeepsAside(), _Returns()

    def forward(self, x):
        self.a(x)
        kept = self.b(self.a)  # what a kept aside and let go: saved again as b returns
        with torch._C.DisableTorchFunction():
            kept.add_(1)  # then written where capture cannot see
        return kept


def test_an_op_saved_again_and_then_written_unseen_is_named_for_the_write():
    # The op b saved again stayed listed as let go by a, so the write's reason was replaced by one telling the
    # user to add its label to save=, which would have kept nothing more.
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        log = tl.trace(_ReturnsThenWritesUnseen(), torch.randn(2, 4), save=["a", "b"])
    kept_aside = log["mul_1_2:1"]
    assert not kept_aside.has_activation
    assert kept_aside.dropped_reason.startswith("mutated after capture saved it, by a write capture could not see")


class _KeepsThenReturns(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.ident, self.head = _KeepsAside(), _Returns(), nn.Identity(), nn.Linear(4, 4)

    def forward(self, x):
        self.a(x)
        return self.head(self.ident(self.b(self.a)))


def test_a_forward_stopped_after_a_selected_module_keeps_that_calls_output():
    # The interventions' hooks ran before the selection's, so a stop_after= at a selected module stopped the
    # forward before the call's outputs were kept: one an op outside the call made (nn.Identity's input, what an
    # earlier selected call kept aside and let go) was left unsaved.
    model, x = _KeepsThenReturns(), torch.randn(2, 4)
    log = tl.trace(model, x, save=["a", "b"], stop_after="b")
    kept_aside = log["mul_1_2:1"]
    assert kept_aside.dropped_reason is None and torch.equal(kept_aside.activation, model.a.kept)
    log = tl.trace(model, x, save=["ident"], stop_after="ident")
    assert [log.labels[i] for i in sorted(log.saved_activations)] == ["mul_1_2:1"]
    assert torch.equal(log["ident"].activation, model.a.kept)


class _WritesUnseenThenReturns(nn.Module):
    def __init__(self, through_view: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.through_view = _KeepsAside(), _Returns(), through_view

    def forward(self, x):
        self.a(x)
        if self.through_view:
            self.a.kept[0].add_(5)  # a write capture sees: save= the label keeps the value the op made
        else:
            with torch._C.DisableTorchFunction():
                self.a.kept.add_(5)  # a write capture cannot see: the value the op made is gone
        return self.b(self.a)


def test_an_op_let_go_and_written_unseen_before_a_later_call_returns_it_is_named_for_the_write():
    # Its dropped_reason told the user to add its label to save=, which keeps nothing: the unseen write is what
    # lost the value, as a save="all" trace says.
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log = tl.trace(_WritesUnseenThenReturns(False), x, save=["a", "b"])
    reason = log["mul_1_2:1"].dropped_reason
    assert reason.startswith("mutated after capture saved it, by a write capture could not see"), reason
    assert any("mul_1_2:1" in str(w.message) and "did not route through capture" in str(w.message) for w in caught)
    everything = tl.trace(_WritesUnseenThenReturns(False), x)
    assert everything["mul_1_2:1"].dropped_reason == reason
    # A write capture saw, through a view: b returns no op's value (the op's is from before the write, the
    # write's is the view it wrote), so selecting b selects nothing, and says why; the label keeps the op's.
    with pytest.raises(tl.UnmatchedSelection, match="written through a view or its base"):
        tl.trace(_WritesUnseenThenReturns(True), x, save=["a", "b"])
    assert tl.trace(_WritesUnseenThenReturns(True), x, save=["a", "mul_1_2:1"])["mul_1_2:1"].has_activation


def test_an_op_kept_aside_by_a_selected_call_and_returned_by_a_later_one_is_saved_within_the_budget():
    # a held its inner ops until it returned, and saved the input besides: a budget of a's output and what it kept
    # aside was spent on the input and a's linear, and a's output was left unsaved, with a warning saying so.
    model, x = _KeepsThenReturns(), torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log = tl.trace(model, x, save=["a", "b"], max_saved_bytes=2 * 32)  # a's output and its mul
    assert [str(w.message) for w in caught] == []
    assert [log.labels[i] for i in sorted(log.saved_activations)] == ["mul_1_2:1", "add_1_3:1"]
    assert torch.equal(log["mul_1_2:1"].activation, model.a.kept)


def test_an_op_kept_aside_that_the_budget_refuses_as_a_later_call_returns_it_is_where_saving_stopped():
    # a's output fitted the budget and was saved as a returned; what a kept aside, made before it and returned by b,
    # did not: the warning said activations from that op on were not saved, while a's output, after it, was.
    model, x = _KeepsThenReturns(), torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log = tl.trace(model, x, save=["a", "b"], max_saved_bytes=32)  # one of them
    assert [str(w.message) for w in caught] == ["max_saved_bytes reached: activations from mul_1_2:1 on were not saved"]
    assert log.budget_exhausted_at == log["mul_1_2:1"].index and not log.saved_activations


def test_save_true_keeps_every_activation_and_save_false_or_none_keeps_none():
    # The pages promise these spellings: save=True is save="all", save=False and save=None are save="none".
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    assert all(op.has_activation for op in tl.trace(model, x, save=True))
    for nothing in (False, None):
        assert not any(op.has_activation for op in tl.trace(model, x, save=nothing))
