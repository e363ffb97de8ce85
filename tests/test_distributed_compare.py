"""tl.distributed.compare on traces taken in one process: what it compares by value, what it leaves out
(uninitialized memory), and how it names a divergence in the graph or in the values.  The comparisons of
traces gathered from real ranks are in test_distributed.py."""

from __future__ import annotations

import pickle

import pytest
import torch

import torchlens as tl


class FillsEmpty(torch.nn.Module):
    """Writes into a ``torch.empty_like`` buffer, as Mixtral's router does with its sort inverse."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        y = self.fc(x)
        buffer = torch.empty_like(y)
        buffer[:] = y * 2
        return self.head(buffer + 1)


def test_compare_does_not_read_a_view_of_uninitialized_memory_as_a_divergence():
    # Its transpose, and the output returning it, hold the allocator's bits as the buffer does: they were
    # compared, and two agreeing ranks reported diverging.
    def scratch(x):
        return x * 2, torch.empty(8, 3).t()

    x = torch.randn(3, 8)
    first, second = (tl.distributed.RankTrace.of(tl.trace(scratch, x), activations=True) for _ in range(2))
    for label in ("empty_1_2:1", "t_1_3:1", "output_2:1"):  # other garbage on the other rank
        second.activations[label] = second.activations[label] + 1
    (row,) = tl.distributed.compare([first, second]).to_dict("records")
    assert not row["diverges"] and row["ops_compared"] == 3, row  # the input, mul and the first output


def test_compare_does_not_read_uninitialized_memory_as_a_divergence():
    model, x = FillsEmpty(), torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    first, second = tl.trace(model, x), tl.trace(model, x)
    (empty,) = [op.label for op in first.ops if op.func_name == "empty_like"]
    # What torch.empty_like returns is whatever the allocator left there: two agreeing ranks see different
    # garbage.  Make sure they do here.
    second[empty].activation.copy_(first[empty].activation + 1)
    assert not torch.equal(first[empty].activation, second[empty].activation)
    (row,) = tl.distributed.compare([first, second]).to_dict("records")
    assert not row["diverges"]
    assert row["ops_compared"] == len(first.ops) - 1  # every op but the uninitialized one, by value
    assert row["reason"].endswith(f"{len(first.ops) - 1} ops agree by value and 1 was not compared "
                                  "(not saved on both ranks, or uninitialized memory)")

    with torch.no_grad():
        model.head.bias[1] += 1e-3  # a real difference, after the uninitialized buffer
    third = tl.trace(model, x)
    third[empty].activation.copy_(first[empty].activation - 1)
    differing = [op.label for op in first.ops if op.label != empty and op.has_activation
                 and not torch.equal(op.activation, third[op.label].activation)]
    (row,) = tl.distributed.compare([first, third]).to_dict("records")
    assert (row["first_op"], row["module"], row["reason"]) == (differing[0], "head:1", "values differ")
    assert row["origin"] == "here"  # its parent, buffer + 1, was compared and agreed


class MaybeSkips(torch.nn.Module):
    """Rank-dependent control flow that keeps every op's label: ``fc2`` reads ``fc1``'s output or the input."""

    def __init__(self, through: bool):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.through = through

    def forward(self, x):
        y = self.fc1(x)
        return self.fc2(y if self.through else x) + y


def test_compare_finds_ops_that_read_different_inputs_under_the_same_labels():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    reference, rewired = tl.trace(MaybeSkips(True), x), tl.trace(MaybeSkips(False), x)
    assert [op.label for op in reference.ops] == [op.label for op in rewired.ops]
    rewired_at = [a.label for a, b in zip(reference.ops, rewired.ops) if a.parents != b.parents]
    for activations in (False, True):  # metadata alone must show it too
        traces = [tl.distributed.RankTrace.of(t, activations=activations) for t in (reference, rewired)]
        (row,) = tl.distributed.compare(traces).to_dict("records")
        assert (row["diverges"], row["first_op"], row["module"]) == (True, rewired_at[0], "fc2:1")
        assert row["reason"].startswith("the graph differs") and "input_1:1 here" in row["reason"]


def test_an_agreement_without_values_says_no_values_were_compared():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(6))
    traces = [tl.distributed.RankTrace.of(tl.trace(MaybeSkips(True), x), activations=False) for _ in range(2)]
    (row,) = tl.distributed.compare(traces).to_dict("records")
    assert (row["diverges"], row["ops_compared"]) == (False, 0)
    assert row["reason"].startswith("no values compared: the graph, shapes and dtypes agree")
    full = [tl.trace(MaybeSkips(True), x) for _ in range(2)]
    (row,) = tl.distributed.compare(full).to_dict("records")
    assert (row["diverges"], row["reason"], row["ops_compared"]) == (False, None, len(full[0].ops))


def test_a_rank_trace_of_labels_not_saved_leaves_them_out_and_activations_of_no_kind_are_refused():
    # RankTrace.of (what gather sends) read op.activation, which is None where nothing was saved, and failed with
    # "'NoneType' object has no attribute 'detach'": under torchrun that rank raised while the others waited at
    # the gather.  activations=5 failed on "'int' object is not iterable".
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(6))
    selected = tl.trace(FillsEmpty(), x, save=["head"])
    sent = tl.distributed.RankTrace.of(selected, activations=["linear_1_1:1", "linear_2_6:1"])
    assert list(sent.activations) == ["linear_2_6:1"]
    assert torch.equal(sent.activations["linear_2_6:1"], selected["linear_2_6:1"].activation)
    assert tl.distributed.RankTrace.of(tl.trace(FillsEmpty(), x, save="none"), activations=True).activations == {}
    for activations in (5, [1, 2]):
        with pytest.raises(TypeError, match=r"^gather: activations=.* is not understood; give False \(metadata only\), "
                                            r"True \(every saved activation\) or a list of op labels"):
            tl.distributed.gather(selected, activations=activations)  # refused before any process group is read


def test_a_divergence_after_an_uncompared_parent_has_unknown_origin():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(7))
    reference, changed = tl.trace(MaybeSkips(True), x), MaybeSkips(True)
    with torch.no_grad():
        changed.fc2.bias[0] += 1e-3
    changed = tl.trace(changed, x)
    (fc1,) = [op.label for op in reference.ops if op.module == "fc1:1"]
    (fc2,) = [op.label for op in reference.ops if op.module == "fc2:1"]
    for left_out, origin in ((fc1, "unknown"), (None, "here")):
        # fc2 reads fc1's output: unsent, fc1 may already have differed, so the change is not placed at fc2
        traces = [tl.distributed.RankTrace.of(t, activations=[op.label for op in t.ops if op.label != left_out])
                  for t in (reference, changed)]
        (row,) = tl.distributed.compare(traces).to_dict("records")
        assert (row["diverges"], row["first_op"], row["origin"]) == (True, fc2, origin)


def test_compare_names_a_dtype_change_and_a_nan_against_a_number_as_the_largest_difference():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(8))
    double, nan = x.double(), x.clone()
    nan[0, 0] = float("nan")
    reference = tl.trace(lambda t: t * 2, x)
    (row,) = tl.distributed.compare([reference, tl.trace(lambda t: t * 2, double)]).to_dict("records")
    assert row["diverges"] and row["reason"] == "(3, 8) torch.float32 on the reference, (3, 8) torch.float64 here"
    (row,) = tl.distributed.compare([reference, tl.trace(lambda t: t * 2, nan)]).to_dict("records")
    assert (row["reason"], row["max_abs_diff"]) == ("values differ", float("inf"))


class Doubles(torch.nn.Module):
    """Returns ``g + g`` (one tensor read twice), or ``g + x`` in its place."""

    def __init__(self, twice=True):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3, 3)
        self.twice = twice

    def forward(self, x):
        g = self.fc(x)
        return g + g if self.twice else g + x


def test_an_op_reading_one_tensor_twice_agrees_with_itself_and_not_with_one_reading_two(tmp_path):
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(8))
    twice, once_each = tl.trace(Doubles(), x), tl.trace(Doubles(twice=False), x)
    assert [op.label for op in twice.ops] == [op.label for op in once_each.ops]
    twice.save(tmp_path / "twice")
    (row,) = tl.distributed.compare([tl.load(tmp_path / "twice"), twice]).to_dict("records")
    assert (row["diverges"], row["reason"], row["ops_compared"]) == (False, None, len(twice.ops))
    for activations in (False, True):  # the two reads of g are the graph, with or without values
        traces = [tl.distributed.RankTrace.of(t, activations=activations) for t in (twice, once_each)]
        (row,) = tl.distributed.compare(traces).to_dict("records")
        origin = "here" if activations else "unknown"  # without values, g may already have differed
        assert (row["diverges"], row["first_op"], row["origin"]) == (True, "add_1_2:1", origin)
        assert row["reason"] == ("the graph differs: add_1_2:1 reads linear_1_1:1, linear_1_1:1 on the reference, "
                                 "linear_1_1:1, input_1:1 here")
    changed = Doubles()
    with torch.no_grad():
        changed.fc.bias[1] += 0.5
    (row,) = tl.distributed.compare([twice, tl.trace(changed, x)]).to_dict("records")
    assert (row["first_op"], row["origin"], row["max_abs_diff"]) == ("linear_1_1:1", "here", 0.5)


class ScaledCausalScores(torch.nn.Module):
    """Attention scores masked with -inf above the diagonal, then scaled by a learned temperature."""

    def __init__(self):
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.ones(()))

    def forward(self, scores):
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        return (scores.masked_fill(causal, float("-inf")) * self.temperature).softmax(-1)


def test_infinities_both_ranks_hold_do_not_hide_the_largest_difference():
    # The masked -inf entries agree, but inf - inf is NaN, which read as a difference made max_abs_diff inf.
    scores = torch.randn(4, 4, generator=torch.Generator().manual_seed(8))
    reference, nudged = ScaledCausalScores(), ScaledCausalScores()
    with torch.no_grad():
        nudged.temperature += 1e-3
    (row,) = tl.distributed.compare([tl.trace(reference, scores), tl.trace(nudged, scores)]).to_dict("records")
    (mul,) = [op for op in tl.trace(reference, scores).ops if op.func_name == "mul"]
    finite = scores.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), 0.0)
    assert (row["first_op"], row["origin"]) == (mul.label, "here")
    assert row["max_abs_diff"] == float((finite * nudged.temperature.detach() - finite).abs().max())
    nan = scores.clone()  # a NaN both hold agrees too; one against a number stays the largest difference
    nan[0, 0] = float("nan")
    (row,) = tl.distributed.compare([tl.trace(reference, nan), tl.trace(nudged, nan)]).to_dict("records")
    assert row["max_abs_diff"] < 1e-2


def test_an_activation_viewing_part_of_a_larger_tensor_is_sent_without_the_rest():
    """gather pickles each rank's activations, and a tensor pickles with its whole storage: a split attention head,
    or one row of a matrix, sent the whole matrix (a 1 KB row sent 1 MB).  Such a view now travels as its own
    elements; a tensor covering its storage (a transpose) travels as it is."""
    class Rows(torch.nn.Module):
        def forward(self, x):
            big = x.repeat(1000, 1)
            return big[0] * 2, big.t()

    log = tl.trace(Rows(), torch.randn(1, 256))
    sent = tl.distributed.RankTrace.of(log, activations=["getitem_1_2:1", "t_1_4:1"])
    row, transposed = sent.activations["getitem_1_2:1"], sent.activations["t_1_4:1"]
    assert torch.equal(row, log["getitem_1_2:1"].activation)
    assert row.untyped_storage().nbytes() == 256 * 4
    assert transposed.untyped_storage().data_ptr() == log["t_1_4:1"].activation.untyped_storage().data_ptr()
    received = pickle.loads(pickle.dumps(sent))
    assert torch.equal(received.activations["getitem_1_2:1"], row)
    assert received.activations["t_1_4:1"].stride() == (1, 256)
