"""Capture on real models: labels, parents, module calls, source lines, in-place writes and faithfulness."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import pytest

import torchlens as tl
from torchlens.record.dropped import WRITTEN_AFTER_TRACE
from zoo import zoo


def labels(log):
    return [op.label for op in log]


def run_untraced(model, args, kwargs):
    return model(*args, **kwargs)


@pytest.mark.parametrize("name", sorted(zoo()))
def test_outputs_are_bit_identical_to_an_untraced_run(name):
    model, args, kwargs = zoo()[name]
    torch.manual_seed(1)
    expected = run_untraced(model, args, kwargs)
    model, args, kwargs = zoo()[name]
    torch.manual_seed(1)
    log = tl.trace(model, args, kwargs)
    assert tl.validate is not None
    from torchlens.validate import outputs_equal

    assert outputs_equal(log.output, expected)


@pytest.mark.parametrize("name", sorted(zoo()))
def test_every_op_replays_from_its_saved_parents(name):
    result = tl.validate(*zoo()[name])
    assert result.outputs_match, name
    assert not result.mismatched, result.mismatched
    for label, reason in result.not_replayed:  # anything not replayed says why
        assert reason


def test_mlp_labels_modules_and_params():
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args)
    assert labels(log) == ["input_1:1", "linear_1_1:1", "relu_1_2:1", "linear_2_3:1", "relu_1_2:2",
                           "linear_3_4:1", "relu_1_2:3", "linear_4_5:1", "output_1:1"]
    # F.relu at one call site in a loop is one layer with three passes
    assert log["relu_1_2"].num_passes == 3
    op = log["linear_2_3:1"]
    assert op.module == "layers.1:1" and op.modules == ("layers.1:1",)
    assert op.params == ("layers.1.weight", "layers.1.bias")
    assert op.parents == ["relu_1_2:1"] and op.children == ["relu_1_2:2"]
    assert op.shape == (4, 16) and op.dtype == torch.float32 and op.nbytes == 4 * 16 * 4
    assert op.source.line > 0 and "layer(x)" in op.source.code and op.source.function == "MLP.forward"
    assert op.grad_fn == "AddmmBackward0"
    assert log["head"].label == "linear_4_5:1"  # a module that ran once -> its output op


class _ScaledByWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x):
        return x * self.weight.float()  # .float() of a float32 parameter returns the parameter itself


def test_an_op_returning_a_leaf_has_no_grad_fn():
    # A leaf that requires grad has no autograd node: its op's grad_fn is None (it read "NoneType").
    log = tl.trace(_ScaledByWeight(), torch.randn(2, 4))
    assert log["float_1_1"].requires_grad and log["float_1_1"].grad_fn is None
    assert log["mul_1_2"].grad_fn == "MulBackward0"


def _write_two_of_three_pieces(x):
    a, b, c = (x * 1).chunk(3)  # three views sharing one storage and one version counter
    a.mul_(2)
    c.add_(1)
    return torch.stack([a, b, c]), b


def test_a_write_to_one_view_is_not_the_parent_of_a_view_it_did_not_reach():
    x = torch.randn(6, 2)
    stacked, piece = _write_two_of_three_pieces(x)
    log = tl.trace(_write_two_of_three_pieces, x)
    stack = next(op for op in log if op.func_name == "stack")
    # Each piece stack read comes from the op whose value it holds: b from chunk, not from c's write.
    assert len(stack.parents) == 3
    for parent, value in zip(stack.parents, stacked):
        assert torch.equal(log[parent].activation, value), parent
    assert log[stack.parents[1]].func_name == "chunk"
    # The returned untouched piece shows its own value, not the value of a write to another piece.
    assert torch.equal(log.outputs[1].activation, piece)


class _GatedUnitWithInPlaceActivation(nn.Module):
    """A gated MLP that slices its projection along the features and activates one half in place: the
    halves are column blocks of one matrix, whose memory ranges interleave."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 8)

    def forward(self, x):
        h = self.proj(x)
        gate, value = h[:, :4], h[:, 4:]
        F.silu(gate, inplace=True)
        return gate * value, value


def test_an_in_place_write_to_one_column_half_is_not_the_parent_of_the_other():
    model, x = _GatedUnitWithInPlaceActivation(), torch.randn(3, 4)
    product, value = model(x)
    log = tl.trace(model, x)
    mul = next(op for op in log if op.func_name == "mul")
    assert [log[p].func_name for p in mul.parents] == ["silu", "__getitem__"], mul.parents
    for parent, expected in zip(mul.parents, (product / value, value)):
        assert torch.allclose(log[parent].activation, expected), parent
    # The half returned untouched is the slice's output, not the activation's.
    assert log.outputs[1].parents == [mul.parents[1]]
    assert torch.equal(log.outputs[1].activation, value)


class _ClassTokenScaledInPlace(nn.Module):
    """A ViT-style head that reads the class token and the patch tokens as two views of one sequence and
    scales the class token in place: views of different shapes whose memory ranges interleave."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        tokens = self.proj(x)
        cls_token, patches = tokens[:, 0], tokens[:, 1:]
        cls_token.mul_(2)
        return cls_token + patches.mean(1)


def test_an_in_place_write_to_the_class_token_is_not_the_parent_of_the_patch_tokens():
    model, x = _ClassTokenScaledInPlace(), torch.randn(2, 3, 4)
    log = tl.trace(model, x)
    mean = next(op for op in log if op.func_name == "mean")
    assert [log[p].func_name for p in mean.parents] == ["__getitem__"], mean.parents
    with torch.no_grad():
        patches = model.proj(x)[:, 1:]
    assert torch.allclose(log[mean.parents[0]].activation, patches)
    add = next(op for op in log if op.func_name == "add")
    assert [log[p].func_name for p in add.parents] == ["mul_", "mean"], add.parents


class _SpectralGate(nn.Module):
    """Ops from torch.fft, torch.special and torch.linalg, whose C builtins carry their namespace in their
    names (``fft_rfft``, ``special_erf``, ``linalg_vector_norm``)."""

    def forward(self, x):
        spectrum = torch.fft.rfft(x).abs()
        gate = torch.special.erf(spectrum)
        return gate / torch.linalg.vector_norm(gate, dim=-1, keepdim=True)


def test_namespaced_torch_functions_are_named_as_the_model_writes_them():
    log = tl.trace(_SpectralGate(), torch.randn(2, 8))
    assert [op.label for op in log if op.kind == "op"] == ["rfft_1_1:1", "abs_1_2:1", "erf_1_3:1", "vectornorm_1_4:1",
                                                          "div_1_5:1"]
    assert [op.func_name for op in log if op.kind == "op"][:4] == ["rfft", "abs", "erf", "vector_norm"]
    assert log["erf_1_3"].func is torch.special.erf


def test_fnet_fourier_mixing_is_an_fftn_op():
    from transformers import FNetConfig, FNetModel

    torch.manual_seed(0)
    config = FNetConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, vocab_size=50,
                        max_position_embeddings=16, use_tpu_fourier_optimizations=False)
    log = tl.trace(FNetModel(config).eval(), torch.randint(0, 50, (1, 6)))
    (fourier,) = [op for op in log if op.func is torch.fft.fftn]
    assert fourier.type == "fftn" and fourier.layer_label.startswith("fftn_1_")
    assert fourier.module_address == "encoder.layer.0.fourier.self"


def test_multi_output_calls_give_one_op_per_tensor():
    model, args, _ = zoo()["multi_output"]
    log = tl.trace(model, args)
    assert labels(log) == ["input_1:1", "chunk_1_1:1", "chunk_2_2:1", "mul_1_3:1", "max_1_4:1", "max_2_5:1",
                           "output_1:1", "output_2:1"]
    assert [log[k].multi_output_index for k in ("chunk_1_1:1", "chunk_2_2:1", "max_1_4:1", "max_2_5:1")] == \
        [0, 1, 0, 1]
    assert log["mul_1_3:1"].parent_arg_positions == {0: "chunk_1_1:1", 1: "chunk_2_2:1"}
    assert log["output_2:1"].dtype == torch.int64


def test_lstm_and_gru_outputs_are_separate_ops():
    model, args, _ = zoo()["recurrent"]
    log = tl.trace(model, args)
    lstm = [op for op in log if op.func_name == "lstm"]
    assert [op.multi_output_index for op in lstm] == [0, 1, 2]
    assert all(op.module == "lstm:1" for op in lstm)
    assert log["getitem_1_9:1"].parents == [lstm_output_of(log, "gru")]


def lstm_output_of(log, address):
    return [op.label for op in log if op.module == f"{address}:1" and op.multi_output_index == 0][0]


def test_inplace_ops_keep_the_value_saved_before_the_write():
    class M(nn.Module):
        def forward(self, x):
            y = x * 2
            y.relu_()
            y += 1
            return y

    x = torch.tensor([[-1.0, 2.0]])
    log = tl.trace(M(), x)
    assert labels(log) == ["input_1:1", "mul_1_1:1", "relu_1_2:1", "add_1_3:1", "output_1:1"]
    assert torch.equal(log["mul_1_1:1"].activation, torch.tensor([[-2.0, 4.0]]))
    assert torch.equal(log["relu_1_2:1"].activation, torch.tensor([[0.0, 4.0]]))
    assert torch.equal(log["add_1_3:1"].activation, torch.tensor([[1.0, 5.0]]))
    assert log["relu_1_2:1"].is_inplace and log["add_1_3:1"].parents == ["relu_1_2:1"]
    assert not log["mul_1_1:1"].is_inplace


def test_write_through_a_view_protects_the_saved_base_and_rebinds_readers():
    def f(x):
        y = x * 1
        z = y[:, :1]
        z += 10
        return y.sum()

    log = tl.trace(f, torch.ones(2, 2))
    assert torch.equal(log["mul_1_1:1"].activation, torch.ones(2, 2))  # copied before the write
    assert log["sum_1_4:1"].parents == ["add_1_3:1"]  # y was last written through z
    assert log.output.item() == 24.0


@pytest.mark.parametrize("write", ["transpose", "diagonal"])
@pytest.mark.parametrize("path", ["one tensor", "in a tuple"])
def test_an_output_last_written_through_a_view_shows_the_returned_tensor(write, path):
    # The output's producer is the in-place op on the view, whose own output is the view: the output node
    # must still show the tensor the model returned, not that view (another shape, or the same shape with
    # the values in another order).
    def f(x):
        y = x * 2
        view = y.t() if write == "transpose" else y.diagonal()
        view.sub_(3)
        return y if path == "one tensor" else (y, x)

    for save_device in (None, "cpu"):
        log = tl.trace(f, torch.randn(3, 3), save_device=save_device)
        returned = log.output if path == "one tensor" else log.output[0]
        node = log.outputs[0]
        assert node.parents == ["sub_1_3:1"]
        assert node.activation.shape == (3, 3) and torch.equal(node.activation, returned)
        assert log["sub_1_3:1"].activation.shape == ((3, 3) if write == "transpose" else (3,))


def test_a_parameter_passed_as_an_input_is_an_input_its_readers_read():
    # The argument scan files Parameters as the model's parameters; one handed in as an input is data.
    torch.manual_seed(0)
    weight_like = nn.Parameter(torch.randn(3, 4))
    linear = nn.Linear(4, 4)
    log = tl.trace(linear, weight_like)
    assert log["linear_1_1:1"].parents == ["input_1:1"] and log["linear_1_1:1"].params == ("weight", "bias")
    assert log["input_1:1"].children == ["linear_1_1:1"]
    log = tl.trace(lambda a, b: torch.cat([a, b], 1) * torch.cat([b, a], 1), (weight_like, torch.randn(3, 4)))
    assert log["cat_1_1:1"].parents == ["input_1:1", "input_2:1"]
    assert log["cat_2_2:1"].parents == ["input_2:1", "input_1:1"]
    assert log.validate().passed


def test_a_parameter_of_the_model_passed_as_an_input_is_still_named_among_its_readers_params():
    # tl.trace(m, (x, m.fc.weight)) gave the ops reading the weight params == ('fc.bias',): the weight, made a
    # parent (the input), was dropped from the parameters the op read, though it is the model's own.
    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    gpt2, ids = small_gpt2_lm(), torch.randint(0, 64, (1, 5))

    class Scored(nn.Module):  # scores the hidden states against a table given as an input
        def __init__(self):
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, ids, table):
            return self.gpt2.transformer(ids).last_hidden_state @ table.t()

    model = Scored().eval()
    log = tl.trace(model, (ids, gpt2.transformer.wte.weight))
    table = log["input.table"]
    lookup = next(op for op in log.ops if op.type == "embedding")
    assert lookup.params == ("gpt2.transformer.wte.weight",) and table.label in lookup.parents
    transposed = next(op for op in log.ops if op.type == "t")
    assert transposed.parents == [table.label] and transposed.params == ("gpt2.transformer.wte.weight",)
    assert log.validate().passed


def test_a_saved_tensor_written_after_the_trace_reads_as_dropped_not_as_a_value_the_op_never_made():
    # Activations are kept by reference: a later forward updating a buffer the trace holds (here through
    # an in-place op whose output is the buffer itself), or code writing the input, must not show up as
    # what the ops made.
    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(2))

        def forward(self, x):
            self.seen.add_(x)
            return x * 2

    model, x = Counts(), torch.ones(2)
    log = tl.trace(model, x)
    assert torch.equal(log["add_1_1:1"].activation, torch.ones(2))
    model(torch.ones(2))  # the buffer is now [2, 2]; the trace's add_ made [1, 1]
    with pytest.raises(tl.ActivationUnavailable, match="written in place after the trace ended"):
        log["add_1_1:1"].activation
    assert not log["add_1_1:1"].has_activation
    result = log.validate()
    assert not result.passed and [label for label, _ in result.mismatched] == ["add_1_1:1"]
    x.mul_(3)  # the model's input, after the trace
    assert not log["input_1:1"].has_activation and torch.equal(log["mul_1_2:1"].activation, torch.full((2,), 2.0))


def test_the_dropped_activations_table_is_current_before_any_activation_is_read():
    model, x = nn.Linear(2, 2), torch.ones(1, 2)
    log = tl.trace(model, x)
    assert log.dropped_activations == {}
    x.add_(1)  # the input, written after the trace: the table says so without an activation read first
    assert log.dropped_activations == {0: WRITTEN_AFTER_TRACE}


class GathersThenFrees(nn.Module):
    """Fills a temporary buffer with its weight, multiplies by it, then frees the buffer's memory, as FSDP2
    does with each module's unsharded parameters after its forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        flat = torch.empty(16)
        with torch.no_grad():
            flat.copy_(self.weight.reshape(-1))
        y = x @ flat.view(4, 4)
        flat.untyped_storage().resize_(0)
        self.freed = flat
        return y


def test_a_saved_tensor_whose_memory_the_model_freed_reads_as_dropped_not_as_freed_memory():
    model, x = GathersThenFrees(), torch.randn(2, 4)
    log = tl.trace(model, x)
    assert model.freed.untyped_storage().nbytes() == 0  # the model did free it
    in_freed = [op.label for op in log.ops if op.func_name in ("copy_", "view")]
    assert len(in_freed) == 2
    for label in in_freed:
        assert not log[label].has_activation  # torch does not bounds-check: reading it could crash
        with pytest.raises(tl.ActivationUnavailable, match="its memory was freed"):
            log[label].activation
    (matmul,) = [op for op in log.ops if op.func_name == "matmul"]
    assert torch.equal(matmul.activation, x @ model.weight.detach())  # what does not live there is kept
    result = log.validate()
    assert result.mismatched == [] and {label for label, _ in result.not_replayed} >= set(in_freed)


def test_setitem_is_an_inplace_op_on_its_receiver():
    def f(x):
        c = x.clone()
        c[:, 0] = 5.0
        return c

    log = tl.trace(f, torch.zeros(2, 2))
    op = log["setitem_1_2:1"]
    assert op.is_inplace and op.parents == ["clone_1_1:1"]
    assert torch.equal(log["clone_1_1:1"].activation, torch.zeros(2, 2))
    assert torch.equal(op.activation, torch.tensor([[5.0, 0.0], [5.0, 0.0]]))


def test_buffers_in_train_and_eval_batchnorm():
    model, args, _ = zoo()["batchnorm_train"]
    before = model.bn.running_mean.clone()
    log = tl.trace(model, args)
    buffers = [op for op in log if op.is_buffer]
    assert [op.io_path for op in buffers] == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var",
                                              "scale"]
    assert log["buffer_2:1"].children == ["batchnorm_1_3:1"]
    assert torch.equal(log["buffer_2:1"].activation, before)  # the value as read, not as rewritten
    assert model.bn.num_batches_tracked.item() == 1  # the model ran exactly once

    model, args, _ = zoo()["batchnorm_eval"]
    log = tl.trace(model, args)
    assert [op.io_path for op in log if op.is_buffer] == ["bn.running_mean", "bn.running_var", "scale"]


def test_root_functional_ops_and_internal_tensors():
    model, args, _ = zoo()["functional"]
    log = tl.trace(model, args)
    ones, arange = log["ones_1_1:1"], log["arange_1_2:1"]
    assert ones.parents == [] and arange.parents == []
    assert ones.module is None and ones.modules == ()
    normalize = [op for op in log if op.func_name == "normalize"]
    assert len(normalize) == 1  # a Python-level torch function is one op


class ReadsWithoutTensors(nn.Module):
    """Calls that return no tensor: sizes, flags, Python numbers and lists read from tensors."""

    def forward(self, x):
        n, d, k = x.shape[0], x.dim(), x.size(1)
        total = x.sum()
        plain = (total.item(), x.numel(), len(x), x.tolist(), x.is_contiguous(), torch.equal(x, x), x.data_ptr())
        return x * (n + d + k + len(plain)) if bool(total > 0) else -x


def test_calls_that_return_no_tensor_are_not_ops():
    x = torch.ones(2, 3)
    log = tl.trace(ReadsWithoutTensors(), x)
    assert [op.label for op in log] == ["input_1:1", "sum_1_1:1", "gt_1_2:1", "mul_1_3:1", "output_1:1"]
    assert torch.equal(log.output, x * 14)


def test_dict_inputs_kwargs_and_structured_outputs():
    model, args, kwargs = zoo()["dict_io"]
    log = tl.trace(model, args, kwargs)
    assert [op.io_path for op in log.inputs] == ["input.batch.a", "input.batch.b", "input.mask"]
    assert [op.io_path for op in log.outputs] == ["output.h", "output.aux.0", "output.aux.1"]
    assert set(log.output) == {"h", "aux"}
    assert log["input.batch.b"].label == "input_2:1"


def test_data_dependent_branch_records_the_branch_taken():
    model, _, _ = zoo()["branchy"]
    pos = tl.trace(model, torch.ones(2, 8))
    neg = tl.trace(model, -torch.ones(2, 8))
    assert [op.module for op in pos if op.func_name == "linear"] == ["a:1"]
    assert [op.module for op in neg if op.func_name == "linear"] == ["b:1"]


def test_dropout_in_train_mode_draws_the_same_mask_as_an_untraced_run():
    model, args, _ = zoo()["dropout_train"]
    torch.manual_seed(7)
    expected = model(*args)
    after_untraced = torch.get_rng_state()
    torch.manual_seed(7)
    log = tl.trace(model, args)
    assert torch.equal(log.output, expected)
    assert torch.equal(torch.get_rng_state(), after_untraced)  # RNG consumed exactly as untraced


def test_transformer_fast_path_stays_on_and_bit_identical():
    model, args, _ = zoo()["transformer_fastpath"]
    x = args[0]
    with torch.no_grad():
        expected = model(x)
        log = tl.trace(model, x)
    assert torch.equal(log.output, expected)
    assert [op.func_name for op in log if op.kind == "op"] == ["_transformer_encoder_layer_fwd"] * 2
    assert torch.overrides.has_torch_function is torch._C._has_torch_function


def test_model_state_and_training_flags_are_left_as_an_untraced_run_leaves_them():
    model, args, _ = zoo()["batchnorm_train"]
    twin, _, _ = zoo()["batchnorm_train"]
    twin.load_state_dict(model.state_dict())
    model(*args)
    tl.trace(twin, args)
    for (k, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), k
    assert twin.training and twin.bn.training


def test_nothing_stays_installed_after_a_trace_even_when_the_model_raises():
    from torch.nn.modules import module as module_globals

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return torch.linalg.cholesky(self.fc(x) * 0 - torch.eye(2))  # not positive definite

    hooks_before = (dict(module_globals._global_forward_hooks), dict(module_globals._global_forward_pre_hooks))
    model = Boom()
    with pytest.raises(Exception) as info:
        tl.trace(model, torch.randn(2, 2))
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "'cholesky'" in notes and "root forward" in notes
    assert torch._C._len_torch_function_stack() == 0
    assert (dict(module_globals._global_forward_hooks), dict(module_globals._global_forward_pre_hooks)) == \
        hooks_before
    assert torch.overrides.has_torch_function is torch._C._has_torch_function
    assert not model._forward_hooks and not model.fc._forward_pre_hooks
    # the model then runs normally, and a new trace works
    model.forward = lambda x: model.fc(x)
    assert len(tl.trace(model, torch.randn(2, 2))) == 3


def test_exception_note_names_the_op_and_module():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 3)

        def forward(self, x):
            return self.inner(x)

    with pytest.raises(RuntimeError, match="mat1 and mat2") as info:
        tl.trace(Bad(), torch.randn(2, 5))
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "'linear'" in notes and "inner:1" in notes


def test_an_exception_note_calls_the_root_module_self():
    linear = nn.Linear(4, 4)

    def forward_then_raise(x):
        linear(x)
        raise ValueError("after the module call")

    with pytest.raises(ValueError) as info:
        tl.trace(forward_then_raise, torch.randn(2, 4), root=linear)
    assert "the last module call before it: module call self:1" in " ".join(info.value.__notes__)


def test_nested_trace_is_refused_clearly():
    def outer(x):
        return tl.trace(torch.relu, x)

    with pytest.raises(tl.NestedTraceError, match="already being traced"):
        tl.trace(outer, torch.randn(2))
    # A tool that traces is named as one: the user called tl.validate, not tl.trace.
    with pytest.raises(tl.NestedTraceError, match="a tool that traces \\(tl.validate"):
        tl.trace(lambda x: tl.validate(torch.relu, x), torch.randn(2))


def test_non_tensor_inputs_reach_forward_untouched():
    seen = {}

    def f(x, n, opts):
        seen["n"], seen["opts"] = n, opts
        return x * n

    opts = {"k": [1, 2]}
    log = tl.trace(f, (torch.ones(2), 3, opts))
    assert seen["n"] == 3 and seen["opts"] is opts
    assert len(log.inputs) == 1


def test_other_threads_are_not_captured():
    import threading

    done = threading.Event()

    def background():
        while not done.is_set():
            torch.ones(3) * 2

    worker = threading.Thread(target=background)
    worker.start()
    try:
        log = tl.trace(lambda x: x.exp().sum(), torch.randn(4))
    finally:
        done.set()
        worker.join()
    assert [op.func_name for op in log if op.kind == "op"] == ["exp", "sum"]


def test_sequential_ops_have_no_user_source_line():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    log = tl.trace(model, torch.randn(1, 4))
    assert log["linear_1_1:1"].source is None
    assert log["0"].module == "0:1"


def test_deep_capture_records_the_calls_inside_python_level_torch_functions():
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 3, 8)
    expected = attention(x, x, x)
    shallow = tl.trace(attention, (x, x, x))
    deep = tl.trace(attention, (x, x, x), deep=True)
    assert [op.func_name for op in shallow if op.kind == "op"].count("multi_head_attention_forward") == 2
    softmax = [op for op in deep if op.func_name == "softmax"]
    assert len(softmax) == 1 and softmax[0].shape == (2, 3, 3)  # per-head attention weights
    assert softmax[0].module is None  # the root module's own forward
    assert torch.equal(deep.output[0], expected[0]) and torch.equal(deep.output[1], expected[1])
    result = tl.validate(attention, (x, x, x), deep=True)
    assert result.passed and result.outputs_match and not result.not_replayed

    log = tl.trace(lambda t: F.normalize(t, dim=-1), torch.randn(2, 3), deep=True)
    assert [op.type for op in log if op.kind == "op"] == ["vectornorm", "clampmin", "expandas", "div"]
    assert torch._C._len_torch_function_stack() == 0
