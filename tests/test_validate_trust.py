"""Validation a user can trust: no false alarms, no false passes, no change to the model, one input rule.

Each test is a case that validation used to get wrong: a mismatch reported for a faithful trace, a pass
for a record that was wrong or never checked, a model or RNG left changed by validating, or inputs
unpacked by guesswork.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading

import numpy
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl
from torchlens.validate import outputs_equal
from trusted import assert_trusted  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ----- replay exactly as captured: grad mode, requires_grad, parameter values ---------------------------
@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU])
def test_two_layer_rnn_with_grad_replays_exactly(rnn):
    torch.manual_seed(0)
    model = rnn(8, 16, num_layers=2)
    result = tl.validate(model, torch.randn(5, 3, 8))
    assert_trusted(result)
    assert result.replayed >= 1 and not result.not_replayed


class CellOverTime(nn.Module):
    """An RNN cell stepped over the time axis: each step reads ``x[:, t]``, a view whose memory starts at an
    unaligned address, which vectorized kernels round differently from an aligned copy."""

    def __init__(self, cell):
        super().__init__()
        self.cell = cell(6, 8)

    def forward(self, x):
        h = torch.zeros(x.shape[0], 8)
        state = (h, h) if isinstance(self.cell, nn.LSTMCell) else h
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
        return state[0] if isinstance(self.cell, nn.LSTMCell) else state


@pytest.mark.parametrize("cell", [nn.RNNCell, nn.LSTMCell, nn.GRUCell])
def test_a_cell_stepped_over_time_slices_replays_exactly(cell):
    torch.manual_seed(0)
    result = tl.validate(CellOverTime(cell).eval(), torch.randn(2, 4, 6))
    assert_trusted(result)
    assert not result.not_replayed


def test_a_replay_copy_of_a_view_starts_as_far_from_an_aligned_address_as_the_view():
    from torchlens.copies import copy_with_layout

    x = torch.randn(2, 4, 6)
    for view in (x[:, 1], x[1], x[0, 0, 1:], x[:, :, 1:]):
        copy = copy_with_layout(view)
        assert copy.data_ptr() % 64 == view.data_ptr() % 64 and copy.stride() == view.stride()
        assert torch.equal(copy, view) and copy._base is None


class ParamMaskAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mask = nn.Parameter(torch.randn(6, 6))

    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=self.mask)


def test_sdpa_with_a_parameter_mask_replays_exactly():
    torch.manual_seed(0)
    assert_trusted(tl.validate(ParamMaskAttention(), torch.randn(2, 2, 6, 8)))


def test_eval_transformer_encoder_layer_replays_exactly():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True).eval()
    assert_trusted(tl.validate(layer, torch.randn(2, 5, 32)))


def _t5(encoder_only: bool):
    from transformers import T5Config, T5EncoderModel, T5Model

    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0)
    torch.manual_seed(0)
    return (T5EncoderModel if encoder_only else T5Model)(config).eval()


def test_t5_encoder_replays_exactly():
    ids = torch.randint(0, 64, (2, 7))
    assert_trusted(tl.validate(_t5(True), (), {"input_ids": ids}))


def test_t5_encoder_decoder_replays_exactly():
    ids = torch.randint(0, 64, (2, 7))
    assert_trusted(tl.validate(_t5(False), (), {"input_ids": ids, "decoder_input_ids": ids[:, :4]}))


def test_swin_replays_exactly():
    from transformers import SwinConfig, SwinModel

    config = SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1],
                        num_heads=[2, 2], window_size=4, mlp_ratio=2.0)
    torch.manual_seed(0)
    assert_trusted(tl.validate(SwinModel(config).eval(), torch.randn(1, 3, 32, 32)))


class AutocastInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.fc(x)
        with torch.no_grad():
            g = self.fc(x)
        return h.float() + g


def test_autocast_and_no_grad_opened_inside_forward_replay_as_they_ran():
    torch.manual_seed(0)
    assert_trusted(tl.validate(AutocastInside(), torch.randn(4, 16)))


class MomentumUpdate(nn.Module):
    """EMA-style: the forward updates a parameter in place, before and after reading it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        before = x @ self.w
        with torch.no_grad():
            self.w.mul_(0.5)
        return before + x @ self.w


def _after_one_forward(make, x):
    model = make()
    model(x.clone())
    return model


class RenormedEmbedding(nn.Module):
    """``max_norm`` renormalises the looked-up rows of the weight in place, inside ``F.embedding``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4, max_norm=1.0)

    def forward(self, ids):
        return self.embed(ids).sum(-1) + self.embed.weight.sum()


@pytest.mark.parametrize("make", [MomentumUpdate, RenormedEmbedding],
                         ids=["in-place-update", "embedding-max-norm"])
def test_validating_never_writes_model_state(make):
    x = torch.randn(3, 4) if make is MomentumUpdate else torch.tensor([1, 2, 2, 7])
    torch.manual_seed(0)
    expected = _after_one_forward(make, x).state_dict()
    torch.manual_seed(0)
    model = make()
    log = tl.trace(model, x)
    for _ in range(3):
        assert_trusted(log.validate())
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    torch.manual_seed(0)
    model = make()
    assert_trusted(tl.validate(model, x))  # its untraced reference runs on a copy
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


class UnpredictedWrite(nn.Module):
    """``max_norm`` renormalises the rows it reads in place, inside ``F.embedding``: a parameter write
    capture cannot see coming."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4, 3, max_norm=1.0)
        nn.init.constant_(self.emb.weight, 2.0)

    def forward(self, i):
        y = self.emb.weight * 1.0
        return y + self.emb(i) + self.emb.weight * 1.0


def test_an_unpredicted_parameter_write_is_not_replayed_rather_than_mismatched():
    result = tl.validate(UnpredictedWrite(), torch.tensor([0, 1, 2, 3]))
    assert not result.mismatched and result.outputs_match
    changed = [label for label, reason in result.not_replayed if "parameter changed by the forward" in reason]
    # the read before the write, and the write itself; the read after it replays
    assert changed == ["mul_1_1:1", "embedding_1_2:1"], result.not_replayed
    assert result.replayed >= 2


def test_a_parameter_changed_after_the_trace_is_not_replayed():
    model = nn.Linear(4, 4)
    log = tl.trace(model, torch.randn(2, 4))
    with torch.no_grad():
        model.weight.add_(1.0)  # an optimizer step
    result = log.validate()
    assert not result.mismatched
    assert any("changed since the trace" in reason for _, reason in result.not_replayed)


def test_a_parent_saved_and_then_dropped_is_named_as_dropped_not_as_unsaved():
    # "parent t_1_1:1 was not saved" pointed at save= for a parent that was saved and then dropped.
    model = nn.Linear(4, 4)
    log = tl.trace(lambda x: x @ model.weight.t(), torch.randn(2, 4), root=model)
    with torch.no_grad():
        model.weight.add_(1.0)  # an optimizer step: t() returned a view of the weight
    reasons = dict(log.validate().not_replayed)
    assert reasons["matmul_1_2:1"].startswith("parent t_1_1:1 was saved, then dropped: its memory is parameter "
                                              "weight's"), reasons
    unsaved = tl.trace(model, torch.randn(2, 4), save="linear_1_1").validate().not_replayed
    assert unsaved == [("linear_1_1:1", "parent input_1:1 was not saved")]


# ----- no vacuous verdicts -----------------------------------------------------------------------------
def test_nothing_saved_is_nothing_to_replay_not_a_pass():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    for log in (tl.trace(model, torch.randn(2, 4), save="none"), tl.trace(model, torch.randn(2, 4))):
        if log._activations:
            log.cleanup()
        result = log.validate()
        assert result.status == "nothing to replay"
        assert not result.passed and not bool(result) and result.replayed == 0
        assert "NOTHING TO REPLAY" in str(result) and "passed" not in str(result)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: tuple


def test_output_comparison_walks_dataclasses_instead_of_comparing_types():
    a = Out(torch.ones(2), (torch.zeros(1),))
    assert outputs_equal(a, Out(torch.ones(2), (torch.zeros(1),)))
    assert not outputs_equal(a, Out(torch.ones(2) * 2, (torch.zeros(1),)))
    assert not outputs_equal(a, Out(torch.ones(2), (torch.ones(1),)))


class Detector(nn.Module):
    """Returns its scores as a tensor and, post-processed for the caller, as a NumPy array of labels and a
    Python float that is NaN when no box passes the threshold."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 3)

    def forward(self, x, threshold: float):
        scores = self.head(x).softmax(-1)
        kept = scores.max(-1).values > threshold
        labels = scores.argmax(-1)[kept].numpy()
        return {"scores": scores, "labels": labels, "mean_kept_score": float(scores.max(-1).values[kept].mean())}


@pytest.mark.parametrize("threshold", [0.0, 1.0], ids=["boxes kept", "none kept: a NaN mean"])
def test_output_comparison_reads_numpy_arrays_and_nan_floats_by_value(threshold):
    """A NumPy array's == is elementwise (no truth value) and NaN != NaN: two runs returning the same array or
    both a NaN were reported as 'outputs differ'."""
    result = tl.validate(Detector().eval(), (torch.randn(5, 4), threshold))
    assert_trusted(result)
    assert result.outputs_match is True
    assert not outputs_equal({"labels": numpy.array([1, 2])}, {"labels": numpy.array([1, 0])})
    assert not outputs_equal(float("nan"), 1.0)


# ----- the untraced reference runs on a copy -----------------------------------------------------------
class Stateful(nn.Module):
    def __init__(self, lock: bool = False):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(3), persistent=False)
        self.calls = 0
        if lock:
            self.lock = threading.Lock()  # cannot be deep-copied

    def forward(self, x):
        self.calls += 1
        self.seen.add_(x.sum(0))
        return self.fc(x) * self.calls + self.seen


@pytest.mark.parametrize("lock", [False, True], ids=["copied", "restored"])
def test_reference_run_leaves_python_attributes_and_buffers_alone(lock):
    torch.manual_seed(0)
    model, x = Stateful(lock), torch.randn(2, 3)
    once = copy.deepcopy(model) if not lock else None
    result = tl.validate(model, x)
    assert_trusted(result)
    assert result.outputs_match is True
    assert model.calls == 1  # as after one traced forward
    assert torch.equal(model.seen, x.sum(0))
    if once is not None:
        once(x)
        assert torch.equal(model.fc.weight, once.fc.weight)


# ----- complete graphs ---------------------------------------------------------------------------------
class KeywordAndNested(nn.Module):
    def forward(self, x):
        a, b = x + 1, x * 2
        joined = torch.cat(tensors=[a, b])
        idx = torch.tensor([0, 2])
        picked = joined[..., idx]
        return torch.stack((picked, picked * 3), dim=0)


def test_tensors_anywhere_in_arguments_are_parents():
    log = tl.trace(KeywordAndNested(), torch.randn(2, 3))
    cat = log["cat_1_3:1"]
    assert cat.parent_arg_positions == {("tensors", 0): "add_1_1:1", ("tensors", 1): "mul_1_2:1"}
    getitem = log["getitem_1_5:1"]
    assert set(getitem.parents) == {"cat_1_3:1", "tensor_1_4:1"}
    assert getitem.parent_arg_positions[(1, 1)] == "tensor_1_4:1"
    assert_trusted(log.validate())


class MutatesItsShape(nn.Module):
    def forward(self, x):
        shape = [2, 6]
        y = x.reshape(shape)
        shape[:] = [6, 2]  # the record holds the argument by value
        return y.reshape(shape)


def test_list_arguments_are_recorded_by_value():
    log = tl.trace(MutatesItsShape(), torch.randn(3, 4))
    assert log["reshape_1_1:1"].shape == (2, 6)
    assert_trusted(log.validate())


class NumpyWriteAfterRandom(nn.Module):
    def forward(self, x):
        r = torch.rand(3)
        r.numpy()[0] = 5.0  # bumps no version counter
        return x + r


def test_a_numpy_write_after_a_random_op_does_not_validate():
    torch.manual_seed(0)
    drawn = torch.rand(3)
    torch.manual_seed(0)
    log = tl.trace(NumpyWriteAfterRandom(), torch.zeros(3))
    assert torch.equal(log["rand_1_1:1"].activation, drawn)  # what rand returned, not what NumPy wrote
    result = log.validate()
    assert not result.passed
    assert [label for label, _ in result.mismatched] == ["add_1_2:1"]


# ----- one input rule ----------------------------------------------------------------------------------
def test_a_list_is_one_positional_argument_whatever_its_length():
    def total(xs):
        return sum(x.sum() for x in xs)

    for n in (1, 2):
        xs = [torch.ones(2) * (i + 1) for i in range(n)]
        log = tl.trace(total, xs)
        assert torch.equal(log.output, total(xs))
        assert [op.io_path for op in log.inputs] == [f"input.xs.{i}" for i in range(n)]
        assert_trusted(tl.validate(total, xs))
    pair = (torch.ones(2), torch.ones(2))
    assert torch.equal(tl.trace(torch.add, pair).output, torch.add(*pair))  # a tuple is the arguments


class SumsAList(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, xs):
        return self.fc(xs[0] + xs[1])


def test_extract_follows_the_same_rule(tmp_path):
    model = SumsAList().eval()
    batches = [[torch.randn(4, 3), torch.randn(4, 3)] for _ in range(2)]  # each batch: one list argument
    tl.extract(model, batches, ["fc"], tmp_path / "x", progress=False)
    rows = torch.from_numpy(numpy.array(tl.load_extracted(tmp_path / "x")["fc"]))
    with torch.no_grad():
        expected = torch.cat([model(b) for b in batches])
    assert torch.equal(rows, expected)


def test_a_bound_method_is_validated_on_a_copy_of_its_module():
    torch.manual_seed(0)
    model, x = Stateful(), torch.randn(2, 3)
    result = tl.validate(model.forward, x)
    assert_trusted(result)
    assert result.outputs_match is True and model.calls == 1


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        h = x * 1.0  # an op output passed as query, key and value: one tensor, three times
        return self.attn(h, h, h, need_weights=False)[0]


def test_a_tensor_passed_twice_replays_as_one_tensor():
    torch.manual_seed(0)
    result = tl.validate(SelfAttention(), torch.randn(2, 5, 16))
    assert_trusted(result)
    assert not result.not_replayed


class AutocastDtypeInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)  # the trace-wide autocast: bfloat16
        with torch.autocast("cpu", enabled=False):
            f = self.fc(x)
        return h.float() + f


def test_autocast_changed_inside_a_traced_autocast_region_replays_as_it_ran():
    torch.manual_seed(0)
    model, x = AutocastDtypeInside(), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log = tl.trace(model, x)
    assert [op.dtype for op in log.ops if op.type == "linear"] == [torch.bfloat16, torch.float32]
    result = log.validate()  # outside the region: each op gets its own autocast state back
    assert_trusted(result)
    assert not result.not_replayed


def test_parameters_replay_with_the_requires_grad_flag_they_had_in_the_forward():
    torch.manual_seed(0)
    model = ParamMaskAttention()
    log = tl.trace(model, torch.randn(2, 2, 6, 8))
    model.requires_grad_(False)  # frozen after the trace: replay still runs the kernel the forward ran
    assert_trusted(log.validate())


def test_validating_inside_inference_mode_replays_with_the_kinds_of_tensors_the_ops_had():
    """A GRU on CPU rounds differently when its weights are inference tensors: copies made for replay inside
    torch.inference_mode() were, so a faithful trace reported a mismatch."""
    torch.manual_seed(0)
    model, x = nn.GRU(12, 32, num_layers=2, batch_first=True).eval(), torch.randn(2, 8, 12)
    with torch.inference_mode():
        log = tl.trace(model, x)
        result = log.validate()
    assert result.passed and not result.mismatched and result.replayed >= 1, result


def test_a_model_built_inside_inference_mode_traces_and_validates():
    """Parameters made inside torch.inference_mode() are inference tensors, with no version counter: reading
    theirs crashed every trace at its end, and validate's replay and flops_vs_dispatch's restore after it."""
    torch.manual_seed(0)
    with torch.inference_mode():
        model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.BatchNorm1d(4)).eval(), torch.randn(2, 4)
        inside = tl.trace(model, x)
        assert torch.equal(inside.output, model(x)) and inside.validate().passed
    with torch.no_grad():  # outside the mode, inference parameters cannot enter autograd
        log = tl.trace(model, x)
        assert torch.equal(log.output, model(x))
        assert log.validate().passed and tl.validate(model, x).passed
        tl.report.flops_vs_dispatch(model, x)
        zeroed = tl.trace(model, x, intervene={"relu_1_2:1": tl.zero_ablate()})
        assert torch.equal(zeroed.output, model[2](torch.zeros(2, 4)))


def test_extra_runs_leave_the_parameters_version_counters_alone():
    """tl.validate and flops_vs_dispatch put the model back after their runs by copying only what changed:
    a copy bumps a version counter, which an earlier trace's validate reads as a parameter changed since."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.BatchNorm1d(4)).eval(), torch.randn(2, 4)
    log = tl.trace(model, x)
    versions = [p._version for p in model.parameters()]
    assert tl.validate(model, x).passed
    tl.report.flops_vs_dispatch(model, x)
    assert [p._version for p in model.parameters()] == versions
    result = log.validate()
    assert result.passed and not result.not_replayed, result


class _GradientPenalty(nn.Module):
    """Differentiates through its own graph inside forward, as a gradient penalty or a physics-informed loss does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        y = torch.tanh(self.fc(x)).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        return (g ** 2).sum() + y


def test_a_gradient_taken_inside_forward_is_skipped_with_its_reason():
    torch.manual_seed(0)
    model, x = _GradientPenalty(), torch.randn(3, 4, requires_grad=True)
    log = tl.trace(model, x)
    assert torch.equal(log.output, model(x))
    result = log.validate()
    assert result.passed and not result.mismatched
    assert [(label, why.split(",")[0]) for label, why in result.not_replayed] == \
        [("grad_1_4:1", "it differentiates through the forward's autograd graph")]


# ----- a slice whose bound is a tensor: held by value, so its bound may have moved since the call -------------
def _read_then_advance(x, position):
    start = position[0]  # a view of position: the write below moves it
    window = x[:, start:start + 2]
    position[0] += 2
    return window * 1


def test_a_slice_bounded_by_a_tensor_written_later_is_listed_as_not_replayed():
    x, position = torch.arange(12.0).reshape(2, 6), torch.tensor([1])
    log = tl.trace(_read_then_advance, (x, position.clone()))
    window = next(op for op in log.ops if op.func_name == "__getitem__" and op.shape == (2, 2))
    assert torch.equal(window.activation, x[:, 1:3])  # the record holds what the op read
    result = log.validate()
    assert_trusted(result)
    assert "a slice bound is a tensor" in dict(result.not_replayed)[window.label]


def test_whisper_generate_validates_though_it_slices_its_features_by_a_counter_it_advances():
    pytest.importorskip("transformers")
    import real_models

    torch.manual_seed(0)
    model, _, kwargs = real_models.CORPUS["whisper"]()
    features = kwargs["input_features"][:1]  # one sequence: the path that slices by the `seek` counter
    call = {"input_features": features, "max_new_tokens": 2, "do_sample": False, "pad_token_id": 0}
    result = tl.validate(model.eval().generate, (), call)
    assert_trusted(result)
    log = tl.trace(model.generate, (), call)
    window = next(op for op in log.ops if op.parents == ["input_1:1"] and op.func_name == "__getitem__")
    assert torch.equal(window.activation, features[:, :, 0:features.shape[-1]])
    assert "a slice bound is a tensor" in dict(log.validate().not_replayed)[window.label]
