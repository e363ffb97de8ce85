"""In-place writes capture must see coming, on both capture paths: the value each op made stays saved, and
the ops after a write read the write."""

import numpy as np
import pytest
import torch
import torch.nn as nn

import torchlens as tl

from accel_paths import PATHS, on_path
from zoo import DoubledInPlace


@pytest.mark.parametrize("compiled", PATHS)
def test_a_write_whose_tensor_is_passed_by_keyword_keeps_the_value_before_it(compiled):
    # nn.init.constant_ hands its tensor on to capture as tensor=, with no positional argument.
    def forward(x):
        y = x * 2
        nn.init.constant_(y, 0.5)
        return y + 1

    x = torch.randn(2, 3)
    with on_path(compiled):
        log = tl.trace(forward, x)
    assert log["mul_1_1:1"].dropped_reason is None
    assert torch.equal(log["mul_1_1:1"].activation, x * 2)
    assert log["constant_1_2:1"].is_inplace and log["add_1_3:1"].parents == ["constant_1_2:1"]
    result = log.validate()
    assert result.passed and result.replayed == 3


@pytest.mark.parametrize("compiled", PATHS)
def test_a_base_written_through_its_view_as_an_out_tensor_is_not_taken_for_the_output(compiled):
    # max writes its values into a view of its own input: a then holds a value no op returned, so neither
    # the model's output nor mul's replay may take max's (2, 1) values for a.
    def forward(x):
        a = x.tanh()
        torch.max(a, 1, keepdim=True, out=(a[:, :1], torch.empty(0, dtype=torch.long)))
        return a * 1, a

    x = torch.randn(2, 3)
    with on_path(compiled):
        log = tl.trace(forward, x)
    expected = forward(x)
    assert [o.parents for o in log.outputs] == [["mul_1_6:1"], ["max_1_4:1"]]  # what last wrote each
    assert torch.equal(log.outputs[1].activation, expected[1])
    assert torch.equal(log["mul_1_6:1"].activation, expected[0])
    result = log.validate()
    assert result.status == "passed", result
    assert "mul_1_6:1: it read max_1_4:1's storage after a write through a view" in str(result)


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("foreach_mul_", [torch._foreach_mul_, torch.ops.aten._foreach_mul_.Scalar],
                         ids=["torch", "aten overload"])
def test_each_tensor_a_foreach_call_writes_is_the_output_that_wrote_it(compiled, foreach_mul_):
    # Called as an aten overload, whose name says in place but which returns nothing, it was no op.
    def forward(x):
        a = x * 1.0
        foreach_mul_([a[0], a[1]], 2.0)  # two views of a, written by the call's two outputs
        return a * 3

    with on_path(compiled):
        log = tl.trace(forward, torch.randn(2, 3))
    assert log["foreachmul_2_5:1"].multi_output_index == 1
    assert log["mul_2_6:1"].parents == ["foreachmul_2_5:1"]  # the last write, as for two separate mul_ calls
    assert log.validate().status == "passed"


@pytest.mark.parametrize("compiled", PATHS)
def test_a_tensor_a_foreach_call_writes_twice_was_last_written_by_its_last_place(compiled):
    def forward(x):
        a = x * 1.0
        b = a.detach()  # another tensor of a's storage, read after the writes
        torch._foreach_add_([a, a], 1.0)
        return b * 3

    with on_path(compiled):
        log = tl.trace(forward, torch.randn(2, 3))
    assert log["mul_2_5:1"].parents == ["foreachadd_2_4:1"]


@pytest.mark.parametrize("compiled", PATHS)
def test_a_view_given_as_the_value_of_a_write_to_its_base_is_not_taken_for_the_written_base(compiled):
    # v's counter moves with a's: v is an argument the call wrote through a, not the setitem's output
    # (all of a), so mul's replay must not be handed a in place of v.
    def forward(x):
        a = x * 1.0
        v = a[:1]
        a[1:2] = v
        return v * 1, a

    with on_path(compiled):
        log = tl.trace(forward, torch.randn(3, 2))
    assert log["mul_2_4:1"].parents == ["setitem_1_3:1"]
    result = log.validate()
    assert result.status == "passed", result


def _qat_linear():
    """A Linear prepared for quantization-aware training: its weight and its output pass through fused
    observe-and-fake-quantize kernels, which update the observers' buffers (resizing the per-channel ones)."""
    import torch.ao.quantization as quantization

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8)).train()
    model.qconfig = quantization.get_default_qat_qconfig("fbgemm")
    return quantization.prepare_qat(model)


@pytest.mark.parametrize("compiled", PATHS)
def test_buffers_a_fused_fake_quantize_kernel_updates_keep_the_values_it_read(compiled, tmp_path):
    model, x = _qat_linear(), torch.randn(2, 4)
    before = {name: b.clone() for name, b in model.named_buffers()}
    with on_path(compiled):
        log = tl.trace(model, x)
    buffers = [op for op in log.ops if op.is_buffer]
    assert {op.io_path for op in buffers} >= {"0.weight_fake_quant.activation_post_process.min_val",
                                              "0.weight_fake_quant.scale"}
    for op in buffers:
        assert op.activation.shape == op.shape  # the per-channel min and max were empty when read
        assert torch.equal(op.activation, before[op.io_path]), op.io_path
    log.save(tmp_path / "qat")
    assert torch.equal(tl.load(tmp_path / "qat")["buffer_3:1"].activation, before[buffers[2].io_path])


class ReadsTheScaleItUpdates(nn.Module):
    """A fused fake-quantize module whose output is then scaled by the scale its kernel has just written."""

    def __init__(self):
        super().__init__()
        import torch.ao.quantization as quantization

        self.fq = quantization.FusedMovingAvgObsFakeQuantize(observer=quantization.MovingAverageMinMaxObserver)

    def forward(self, x):
        return self.fq(x) * self.fq.scale


@pytest.mark.parametrize("compiled", PATHS)
def test_a_read_of_a_buffer_the_fused_fake_quantize_kernel_wrote_names_that_call(compiled):
    model, x = ReadsTheScaleItUpdates(), torch.randn(2, 4)
    with on_path(compiled):
        log = tl.trace(model, x)
    fake_quant, product = log.ops[-3], log.ops[-2]
    assert fake_quant.type == "fusedmovingavgobsfakequant" and product.type == "mul"
    assert product.parents == [fake_quant.label, fake_quant.label]  # not the scale as first read (1.0)
    assert torch.equal(log["buffer_5:1"].activation, torch.ones(1)) and log["buffer_5:1"].io_path == "fq.scale"
    result = log.validate()
    assert not result.mismatched and result.passed
    assert [label for label, _ in result.not_replayed] == [product.label]


@pytest.mark.parametrize("compiled", PATHS)
def test_a_call_that_makes_no_tensor_passes_no_read_through_an_alias_to_the_op_after_it(compiled):
    # torch.equal reads a, written through its view v: no op holds that value, but torch.equal makes no
    # tensor and is no op, so the exp after it, reading v as add_ made it, replays.
    def forward(x):
        a = x * 1
        v = a[0]
        v.add_(1)
        torch.equal(a, a)
        return v.exp(), a.sum()

    with on_path(compiled):
        log = tl.trace(forward, torch.randn(2, 3))
    result = log.validate()
    assert result.passed and [label for label, _ in result.not_replayed] == ["sum_1_5:1"], result


@pytest.mark.parametrize("compiled", PATHS)
def test_the_first_read_of_what_a_dirty_marking_function_returned_replays(compiled):
    # With grads= the trace knows the version move apply makes is no write: the first op reading the
    # Function's output reads what its in-place op made, as the second one does.
    def forward(x):
        out = DoubledInPlace.apply(x + 1)
        return out.exp(), out.argmax(-1)

    with on_path(compiled):
        log = tl.trace(forward, torch.randn(2, 3, requires_grad=True), grads=True)
    assert log["exp_1_3:1"].parents == log["argmax_1_4:1"].parents == ["mul_1_2:1"]
    result = log.validate()
    assert result.status == "passed" and result.replayed == 4 and not result.not_replayed, result


# ----- running statistics written in a kernel ----------------------------------------------------------
class _SharedBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        a = self.bn(x)
        b = self.bn(x * 2)
        return a + b + self.bn.running_mean


def test_a_running_statistic_read_after_a_training_batchnorm_comes_from_the_call_that_wrote_it():
    x = torch.randn(3, 4)
    model = _SharedBatchNorm().train()
    first_read = model.bn.running_mean.clone()
    log = tl.trace(model, x)
    norms = [op for op in log if op.func_name == "batch_norm"]
    assert [op.module for op in norms] == ["bn:1", "bn:2"]
    # The running mean as first read is the model's value before the forward.
    mean_node = next(op for op in log if op.is_buffer and op.io_path == "bn.running_mean")
    assert torch.equal(mean_node.activation, first_read)
    # Each later read names the call whose kernel last wrote it.
    assert norms[1].parents[1] == norms[0].label
    last = log.outputs[0].parents[0]  # the add that read the running mean
    assert log[last].parents[-1] == norms[1].label
    # Replay never compares the sum against the statistic's stale value.
    result = tl.validate(_SharedBatchNorm().train(), x)
    assert result.outputs_match and not result.mismatched, result.mismatched


class _AtenBatchNorm(nn.Module):
    """Training-mode batch norms called as aten operators, as decomposed code calls them."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        bn, aten = self.bn, torch.ops.aten
        a = aten.native_batch_norm.default(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, 0.1, 1e-5)[0]
        b = aten.batch_norm(x * 2, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, 0.1, 1e-5, False)
        return a + b + bn.running_mean


class _TorchLevelBatchNorm(nn.Module):
    """Training-mode batch norms called through the torch-level names of aten operators, as torch's OpInfo
    samples call them (``torch.native_batch_norm``, ``torch._native_batch_norm_legit``)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        bn = self.bn
        a = torch.native_batch_norm(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, 0.1, 1e-5)[0]
        b = torch._native_batch_norm_legit(x * 2, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, 0.1,
                                           1e-5)[0]
        return a + b + bn.running_mean


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("model_class, second_type", [(_AtenBatchNorm, "batchnorm"),
                                                      (_TorchLevelBatchNorm, "nativebatchnormlegit")])
def test_running_statistics_a_batch_norm_kernel_writes_keep_their_value_as_first_read(model_class, second_type,
                                                                                       compiled):
    # Neither the aten schemas nor the torch-level Python signatures mark the statistics written, and the kernel
    # moves no version counter: the running mean's node held the value a later call had left in it, and its
    # readers named that node.
    x = torch.randn(3, 4)
    model = model_class().train()
    first_read = model.bn.running_mean.clone()
    with on_path(compiled):
        log = tl.trace(model, x)
    assert torch.equal(log.output, model_class().train()(x))
    mean_node = next(op for op in log if op.is_buffer and op.io_path == "bn.running_mean")
    assert torch.equal(mean_node.activation, first_read)
    first = next(op for op in log if op.type == "nativebatchnorm")
    second = next(op for op in log if op.type == second_type)
    assert second.parents[1:] == [first.label, first.label]  # the statistics as the first call left them
    assert log[log.outputs[0].parents[0]].parents[-1] == second.label
    result = log.validate()
    assert result.passed and not result.mismatched, result


class _UpdateStats(nn.Module):
    """batch_norm_update_stats, which updates the running statistics at every call (it has no training flag)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        bn = self.bn
        mean = torch.batch_norm_update_stats(x, bn.running_mean, bn.running_var, 0.1)[0]
        mean2 = torch.ops.aten.batch_norm_update_stats(x * 2, bn.running_mean, bn.running_var, 0.1)[0]
        return mean + mean2 + bn.running_mean


def test_running_statistics_batch_norm_update_stats_writes_keep_their_value_as_first_read():
    x = torch.randn(3, 4)
    model = _UpdateStats()
    first_read = model.bn.running_mean.clone()
    log = tl.trace(model, x)
    assert torch.equal(log.output, _UpdateStats()(x))
    mean_node = next(op for op in log if op.is_buffer and op.io_path == "bn.running_mean")
    assert torch.equal(mean_node.activation, first_read)
    first, second = [op for op in log if op.type == "batchnormupdatestats"][::2]  # (each makes two ops)
    assert second.parents[1:] == [first.label, first.label]  # the statistics as the first call left them
    assert log[log.outputs[0].parents[0]].parents[-1] == second.label
    result = log.validate()
    assert result.passed and not result.mismatched, result


# ----- calls that write out= tensors and return nothing ------------------------------------------------
class SplitsInto(nn.Module):
    """FSDP2's split-copy, in miniature: ``split_with_sizes_copy`` returns None and writes its out= list."""

    def forward(self, x):
        first, second = torch.empty(2, 4), torch.empty(1, 4)
        torch.split_with_sizes_copy(x * 2, [2, 1], 0, out=[first, second])
        return first + 1, second.sum()


def test_a_call_that_returns_nothing_but_writes_its_out_tensors_is_the_op_its_readers_read():
    model, x = SplitsInto(), torch.randn(3, 4)
    log = tl.trace(model, x)
    ops = {op.func_name: op for op in log.ops if op.kind == "op"}
    splits = [op for op in log.ops if op.func_name == "split_with_sizes_copy"]
    assert [tuple(op.shape) for op in splits] == [(2, 4), (1, 4)]
    assert all(ops["mul"].label in op.parents for op in splits)
    assert ops["add"].parents == [splits[0].label] and ops["sum"].parents == [splits[1].label]
    assert torch.equal(splits[0].activation, (x * 2)[:2]) and torch.equal(splits[1].activation, (x * 2)[2:])
    assert all(torch.equal(a, b) for a, b in zip(log.output, model(x)))
    result = tl.validate(model, x)
    assert result.passed and result.replayed == 4, str(result)  # mul, the split (one call), add and sum


def test_an_in_place_write_to_an_inference_tensor_is_recorded_as_one():
    # An inference tensor has no version counter: the write is known by the function's name alone.
    def f(x):
        y = x * 2
        y.add_(1)
        return y * 3

    with torch.inference_mode():
        log = tl.trace(f, torch.ones(2))
    assert [op.is_inplace for op in log] == [False, False, True, False, False]
    assert log["mul_1_1"].activation.tolist() == [2.0, 2.0] and log["add_1_2"].activation.tolist() == [3.0, 3.0]


def test_a_call_writing_its_out_tensor_is_an_in_place_op():
    def f(x):
        y = x * 2
        torch.mul(x, 3, out=y)
        return y + 1

    log = tl.trace(f, torch.ones(2))
    assert [op.is_inplace for op in log if op.kind == "op"] == [False, True, False]
    assert log["add_1_3"].parents == ["mul_2_2:1"] and log["mul_1_1"].activation.tolist() == [2.0, 2.0]


@pytest.mark.parametrize("compiled", PATHS)
def test_each_tensor_a_foreach_call_writes_in_place_is_an_in_place_output_and_keeps_its_old_value(compiled):
    def forward(a):
        return torch._foreach_add_([a * 1, a * 2], 1)

    a = torch.tensor([1.0, 2.0])
    with on_path(compiled):
        log = tl.trace(forward, a)
    ops = [op for op in log if op.kind == "op"]
    assert [(op.label, op.is_inplace) for op in ops] == [
        ("mul_1_1:1", False), ("mul_2_2:1", False), ("foreachadd_1_3:1", True), ("foreachadd_2_4:1", True)]
    assert log["mul_1_1:1"].activation.tolist() == [1.0, 2.0]  # as made, before the call wrote it
    assert log["mul_2_2:1"].activation.tolist() == [2.0, 4.0]
    assert log["foreachadd_2_4:1"].activation.tolist() == [3.0, 5.0]
    result = log.validate()
    assert result.passed and result.replayed == 3, str(result)  # two muls and the call


@pytest.mark.parametrize("compiled", PATHS)
def test_both_out_tensors_a_call_writes_are_in_place_outputs_and_keep_their_old_values(compiled):
    def forward(x):
        v, i = x.sum(1), x.sum(1).long()
        torch.max(x, 1, out=(v, i))
        return v + 1, i

    x = torch.tensor([[1.0, 5.0, 2.0], [7.0, 3.0, 4.0]])
    with on_path(compiled):
        log = tl.trace(forward, x)
    assert [(op.label, op.is_inplace) for op in log if op.func_name == "max"] == [("max_1_4:1", True),
                                                                                 ("max_2_5:1", True)]
    assert not any(op.is_inplace for op in log if op.func_name != "max")
    assert log["sum_1_1:1"].activation.tolist() == [8.0, 14.0]  # the value max overwrote
    assert log["max_1_4:1"].activation.tolist() == [5.0, 7.0] and log["max_2_5:1"].activation.tolist() == [1, 0]
    assert log["add_1_6:1"].parents == ["max_1_4:1"]
    result = log.validate()
    assert result.passed, str(result)




class _NumPyWriter(nn.Module):
    """Doubles its hidden activation and its input through NumPy arrays made by ``np.from_dlpack``, which move
    no version counter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x).relu()
        np.from_dlpack(y.detach())[...] *= 2
        np.from_dlpack(x)[...] *= 2
        return y + 1


@pytest.mark.parametrize("compiled", PATHS)
def test_a_write_through_a_dlpack_numpy_array_leaves_what_was_saved_as_it_was_made(compiled):
    # np.from_dlpack(t) shares t's memory as t.numpy() does, through t.__dlpack__: the relu and the input, saved
    # by reference, would read the doubled values as what relu made and what was passed.
    model, x = _NumPyWriter(), torch.randn(2, 4)
    passed = x.clone()
    with torch.no_grad():
        made = model.fc(passed).relu()
    with on_path(compiled):
        log = tl.trace(model, x)
    assert torch.equal(log["relu_1_2:1"].activation, made)
    assert torch.equal(log["input_1"].activation, passed)
    assert torch.equal(log.output, made * 2 + 1) and torch.equal(x, passed * 2)


class _AliasWriter(nn.Module):
    """Zeroes its hidden activation, then adds 2, through a tensor of its own on ``y``'s bytes (``share(y)``:
    ``torch.from_dlpack(y)``, ``torch.from_numpy(y.numpy())``), whose writes move its own version counter, not
    ``y``'s nor that of ``y``'s views."""

    def __init__(self, share):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.share = share

    def forward(self, x):
        y = self.fc(x)
        tail = y[1:]
        alias = self.share(y)
        alias.mul_(0)
        zeroed = y.relu()
        alias.add_(2)
        return zeroed, tail.exp(), y * 3


def _traced_alias_writer(share, compiled) -> tuple:
    """A trace of ``_AliasWriter(share)`` on ``compiled``'s path, and the linear's output made untraced, which
    the trace must have saved as it was before the writes through the alias."""
    model, x = _AliasWriter(share), torch.randn(3, 4)
    with torch.no_grad():
        made = model.fc(x)
        with on_path(compiled):
            log = tl.trace(model, x)
    assert torch.equal(log["linear_1_1:1"].activation, made)
    return log, made


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("share", [torch.from_dlpack, lambda y: torch.from_numpy(y.numpy())],
                         ids=["from_dlpack", "from_numpy"])
def test_a_write_through_a_tensor_sharing_memory_but_no_version_counter_is_the_parent_of_later_reads(compiled,
                                                                                                       share):
    # The ops reading y or its view after a write through the alias read the written values: they named the
    # linear, whose saved value is from before the write, and validation reported them as mismatches.
    log, made = _traced_alias_writer(share, compiled)
    assert log["relu_1_4:1"].parents == ["mul_1_3:1"]
    assert log["exp_1_6:1"].parents == ["add_1_5:1"] and log["mul_2_7:1"].parents == ["add_1_5:1"]
    zeroed, tail, tripled = log.output
    assert not zeroed.any() and torch.equal(tail, torch.full((2, 4), 2.0).exp()) and torch.equal(tripled, made * 0 + 6)
    result = log.validate()
    assert result.passed, str(result)


def _dlpack_of_rows(y):
    return torch.from_dlpack(y[1:])


def _set_on_rows(y):
    # Tensor.set_ reaches no __torch_function__: only y.untyped_storage() tells capture the bytes left.
    return torch.empty(0).set_(y.untyped_storage(), 4, (2, 4), (4, 1))  # y[1:] of a contiguous (3, 4) y


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("share", [_dlpack_of_rows, _set_on_rows], ids=["from_dlpack_of_a_view", "set_on_storage"])
def test_a_write_through_a_tensor_on_part_of_another_s_memory_is_the_parent_of_later_reads(compiled, share):
    # The alias holds y's last rows in a storage of its own (from_dlpack of a view) or in y's storage (set_):
    # reads of y and of its earlier view named the linear, whose saved value predates both writes.
    log, made = _traced_alias_writer(share, compiled)
    assert log["relu_1_5:1"].parents == ["mul_1_4:1"]
    assert log["exp_1_7:1"].parents == ["add_1_6:1"] and log["mul_2_8:1"].parents == ["add_1_6:1"]
    zeroed, tail, tripled = log.output
    assert torch.equal(zeroed[0], made[0].relu()) and not zeroed[1:].any()
    assert torch.equal(tail, torch.full((2, 4), 2.0).exp()) and torch.equal(tripled[1:], torch.full((2, 4), 6.0))
    result = log.validate()
    assert result.passed, str(result)


class _ArrayArgument(nn.Module):
    """Makes a tensor from a NumPy array on its hidden activation's memory, then zeroes it in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        u = torch.asarray(y.detach().numpy())
        u.mul_(0)
        return y.relu()


@pytest.mark.parametrize("compiled", PATHS)
def test_an_array_argument_is_recorded_as_the_op_read_it_not_as_a_later_write_left_it(compiled):
    # The array was recorded by reference: after the write through u it showed zeros as what asarray read,
    # and validation, replaying asarray on it, reported the op's saved output as a mismatch.
    model, x = _ArrayArgument(), torch.randn(3, 4)
    with torch.no_grad():
        made = model.fc(x)
    with on_path(compiled):
        log = tl.trace(model, x)
    (read,) = log["asarray_1_3:1"].args
    assert torch.equal(torch.from_numpy(read), made) and torch.equal(log["asarray_1_3:1"].activation, made)
    assert not log.output.any()
    result = log.validate()
    assert result.passed, str(result)


class _SetWriter(nn.Module):
    """Puts an empty tensor on its hidden activation's memory with ``u.set_(y)``, which reaches no
    ``__torch_function__`` and shares no version counter, and zeroes it through that tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        tail = y[1:]
        u = torch.empty(0).set_(y)
        u.mul_(0)
        return y.relu(), tail * 3


@pytest.mark.parametrize("compiled", PATHS)
def test_a_write_through_a_tensor_set_on_another_is_the_parent_of_later_reads(compiled):
    # The reads of y and of its earlier view named the linear, whose saved value predates the write.
    model, x = _SetWriter(), torch.randn(3, 4)
    with torch.no_grad():
        made = model.fc(x)
        with on_path(compiled):
            log = tl.trace(model, x)
    assert torch.equal(log["linear_1_1:1"].activation, made)
    assert log["relu_1_5:1"].parents == ["mul_1_4:1"] and log["mul_2_6:1"].parents == ["mul_1_4:1"]
    assert not log.output[0].any() and not log.output[1].any()
    result = log.validate()
    assert result.passed, str(result)


def _wrap_then_write(x):
    from torch.testing._internal.two_tensor import TwoTensor

    pair = TwoTensor(x.clone(), (x * 2).clone())  # wraps the two clones' outputs themselves
    pair.add_(1)  # writes both below autograd: neither clone's version counter moves
    return pair.a + 0, pair.b + 0


@pytest.mark.parametrize("compiled", PATHS)
def test_a_write_to_a_wrapper_subclass_keeps_what_every_tensor_it_wraps_held(compiled):
    # Copy-on-write before a write to a wrapper subclass kept the first tensor it wraps (the one its memory is named
    # by) and not the others: the second clone's activation read as x * 2 + 1, a value its op never made, with no
    # warning, since the write moves no version counter.
    x = torch.randn(3, 4)
    with on_path(compiled):
        log = tl.trace(_wrap_then_write, x)
    assert torch.equal(log["clone_1_1"].activation, x)
    assert torch.equal(log["clone_2_3"].activation, x * 2)
    assert torch.equal(log.output[1], x * 2 + 1)
