"""Each claim on docs/capture_honesty.md, demonstrated on real calls.

Capture sits at ``__torch_function__``.  These tests show what that level structurally cannot see (work
inside one call, below the dispatcher, in the autograd engine, in other threads, under functorch
transforms or compiled wrappers, behind protocol-free entry points) and what capture changes or keeps
(fast paths, timing brackets).  A native tool that does see each blind spot is used as the witness.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import torchlens as tl
from torchlens.tree import structures_equal
from accel_paths import PATHS, on_path
from zoo import DoubledInPlace, zoo


class FunctionLevelCalls(TorchFunctionMode):
    """Every call a __torch_function__ mode is handed (the level capture works at)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


class DispatchLevelCalls(TorchDispatchMode):
    """Every ATen operator the dispatcher runs (the level below capture)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def op_types(log) -> list:
    return [op.type for op in log.ops if op.kind == "op"]


# ----- one call is one op ----------------------------------------------------------------------------
@pytest.mark.parametrize("call, expected", [
    (lambda x: F.normalize(x), ["normalize"]),
    (lambda x: F.interpolate(x[None, None], scale_factor=2), ["getitem", "interpolate"]),
    (lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None]),
     ["getitem"] * 3 + ["scaleddotproductattention"]),
])
def test_python_level_torch_functions_are_one_op(call, expected):
    x = torch.randn(4, 8)
    assert op_types(tl.trace(call, x)) == expected
    # The dispatcher, one level down, runs several operators for the same call.
    with DispatchLevelCalls() as below:
        call(x)
    assert len(below.names) > len(expected)


def test_multi_head_attention_forward_is_one_op_in_training():
    mha = nn.MultiheadAttention(8, 2, batch_first=True).train()
    q = torch.randn(1, 3, 8)
    types_seen = op_types(tl.trace(mha, (q, q, q)))
    assert "multiheadattentionforward" in types_seen
    assert "linear" not in types_seen  # the projections inside it are not separate ops


# ----- fused kernels, and the fast path capture keeps ------------------------------------------------
def test_eval_attention_keeps_its_fused_kernel_and_its_numbers():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    q = torch.randn(2, 5, 8)
    with torch.no_grad():
        expected = mha(q, q, q)[0]
        log = tl.trace(mha, (q, q, q))
        # Any other __torch_function__ mode knocks the module off its fast path.
        with FunctionLevelCalls() as plain_mode:
            mha(q, q, q)
    assert op_types(log)[0] == "nativemultiheadattention"  # one fused call: its interior is invisible
    assert torch.equal(log.outputs[0].activation, expected)  # bit-identical to the untraced call
    assert "_native_multi_head_attention" not in plain_mode.names
    assert "multi_head_attention_forward" in plain_mode.names
    assert torch.overrides.has_torch_function is torch._C._has_torch_function  # shim removed afterwards


def test_fast_path_shim_hides_capture_from_call_time_checks():
    # torch.sym_max asks torch.overrides.has_torch_function when called; while tracing, the shim answers
    # as if capture were off, so the call does not reach capture (it returns a Python number anyway).
    def f(x):
        return x * torch.sym_max(2, 3)

    with FunctionLevelCalls() as plain_mode:
        f(torch.ones(2))
    assert "sym_max" in plain_mode.names
    assert op_types(tl.trace(f, torch.ones(2))) == ["mul"]


# ----- below __torch_function__: dispatcher work ------------------------------------------------------
def test_autocast_casts_and_decompositions_are_invisible():
    lin = nn.Linear(8, 4)
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log = tl.trace(lin, x)
        with DispatchLevelCalls() as below:
            lin(x)
    assert op_types(log) == ["linear"]
    assert log.ops[1].dtype == torch.bfloat16  # the cast's effect is recorded, not the cast
    assert "_to_copy" in below.names and "addmm" in below.names


# ----- autograd engine --------------------------------------------------------------------------------
def test_backward_runs_no_function_level_calls():
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(2, 8)
    loss = (x @ w).tanh().sum()
    with FunctionLevelCalls() as fn_level, DispatchLevelCalls() as below:
        loss.backward()
    assert fn_level.names == ["backward"]  # the call itself; nothing the engine runs
    assert len(below.names) > 3


def test_backward_inside_a_trace_adds_no_ops():
    w = torch.randn(8, 4, requires_grad=True)

    def forward_only(x):
        return (x @ w).tanh().sum()

    def forward_and_backward(x):
        loss = forward_only(x)
        loss.backward()
        return loss

    x = torch.randn(2, 8)
    assert op_types(tl.trace(forward_and_backward, x)) == op_types(tl.trace(forward_only, x))
    assert w.grad is not None  # backward did run


# ----- other threads, transforms, compiled wrappers, protocol-free entry points --------------------------
class SpawnsThread(nn.Module):
    def forward(self, x):
        box = {}
        worker = threading.Thread(target=lambda: box.update(y=x.exp()))
        worker.start()
        worker.join()
        return box["y"] + 1


def test_ops_in_other_threads_are_not_captured():
    log = tl.trace(SpawnsThread(), torch.randn(3))
    assert op_types(log) == ["add"]
    assert log.unattributed == 1  # the thread's result arrives as a tensor of unknown origin


def test_vmap_records_per_example_calls():
    x = torch.randn(4, 8)
    log = tl.trace(lambda x: torch.vmap(torch.sin)(x), x)
    assert op_types(log) == ["sin"]
    assert tuple(log.ops[1].shape) == (8,)  # one example's shape, not the batched kernel's (4, 8)


def test_compiled_module_is_traced_as_its_eager_module():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    compiled = torch.compile(model)  # nothing compiles until it is called, and tl.trace never calls it
    x = torch.randn(2, 4)
    assert op_types(tl.trace(compiled, x)) == op_types(tl.trace(model, x)) == ["linear", "relu"]


# ----- timing ------------------------------------------------------------------------------------------
def test_op_durations_are_host_brackets_inside_the_forward():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    log = tl.trace(model, torch.randn(8, 16))
    ops = [op for op in log.ops if op.kind == "op"]
    starts = [op.start_ns for op in ops]
    assert starts == sorted(starts)
    for earlier, later in zip(ops, ops[1:]):  # brackets never overlap: they time the call alone
        assert earlier.start_ns + earlier.duration * 1e9 <= later.start_ns + 1
    # Capture's own work falls between the brackets, so they sum to less than the traced forward.
    assert sum(op.duration for op in ops) < log.timings["forward"]


def test_a_modules_own_hooks_run_inside_its_module_call():
    """A module call holds what its caller sees: the caller's inputs, the value the caller receives, and the
    ops of the module's own hooks; torch's _call_impl is back after the trace."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    original = vars(nn.Module)["_call_impl"]
    handles = [model[0].register_forward_hook(lambda module, args, output: output * 2),
               model[1].register_forward_pre_hook(lambda module, args: (args[0] - 1,))]
    x = torch.randn(2, 4)
    try:
        expected = model(x)
        log = tl.trace(model, x)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(log.output, expected)
    linear, relu = log.module_calls
    assert linear.op_labels == ["linear_1_1:1", "mul_1_2:1"] and linear.output_ops == ["mul_1_2:1"]
    assert relu.input_ops == ["mul_1_2:1"]  # before its pre-hook subtracted one
    assert [log[label].type for label in relu.op_labels] == ["sub", "relu"]
    assert vars(nn.Module)["_call_impl"] is original


def test_a_module_whose_own_call_skips_nn_modules_makes_no_module_call():
    """A class whose ``__call__`` runs ``self.forward`` itself bypasses ``_call_impl``: no call of its own, its ops
    in the caller's, its submodules' calls the caller's children; one calling ``nn.Module.__call__`` makes one."""
    class OwnCall(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def __call__(self, x):
            return self.forward(x)

        def forward(self, x):
            return self.fc(x) * 2

    class ModuleCall(OwnCall):
        def __call__(self, x):
            return nn.Module.__call__(self, x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = OwnCall(), ModuleCall()

        def forward(self, x):
            return self.a(x) + self.b(x)

    log = tl.trace(Model(), torch.randn(1, 2))
    assert [mc.label for mc in log.module_calls] == ["a.fc:1", "b:1", "b.fc:1"]
    assert log["mul_1_2:1"].module is None and log["mul_2_4:1"].module == "b:1"


def test_a_tensor_cached_by_an_earlier_forward_is_named_as_from_outside():
    """A tensor made before the forward (BEiT memoizes its relative position index per window size, for
    the whole process) enters the trace with no parent op: counted, its readers named, their replay skipped
    with the reason, never shown as a complete read."""
    pytest.importorskip("transformers")
    from real_models import beit

    torch.manual_seed(0)
    model, args, kwargs = beit()
    model.eval()
    expected = model(*args, **kwargs)
    log = tl.trace(model, args, kwargs)
    assert structures_equal(log.output, expected)[0]
    readers = [op.label for op in log.ops if op.kind == "op" and op.unattributed_args]
    assert readers and log.unattributed == sum(log[label].unattributed_args for label in readers)
    assert f"read by {', '.join(readers)}" in str(log)
    result = log.validate()
    assert result.passed and not result.mismatched
    assert {label for label, _ in result.not_replayed} == set(readers)
    assert all("from outside the trace" in why for _, why in result.not_replayed)


class PlainAttributes(nn.Module):
    """Tensors held as plain attributes (not buffers), the way a positional table or a mask often is."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Module()
        self.pos.table = torch.randn(5, 8)
        self.linear = nn.Linear(8, 8)
        self.mask = torch.ones(8)

    def forward(self, x):
        return self.linear(x + self.pos.table[: x.shape[0]]) * self.mask * _GLOBAL_SCALE


_GLOBAL_SCALE = torch.full((8,), 0.5)  # held by no module: from outside the trace, and not named


def test_a_plain_tensor_attribute_is_named_with_the_way_to_record_it():
    """A tensor a module holds as a plain attribute is no buffer: its reads come from outside the trace.
    The printed trace names the attributes and how to have them recorded; registered as non-persistent
    buffers, they are recorded as buffers, and the state dict is as before."""
    torch.manual_seed(0)
    model = PlainAttributes()
    x = torch.randn(3, 8)
    log = tl.trace(model, x)
    assert torch.equal(log.output, model(x)) and log.unattributed == 3
    assert ("; mask, pos.table are plain tensor attributes of the model, not registered buffers "
            "(register_buffer(name, tensor, persistent=False) would record each as a buffer") in str(log)
    keys = set(model.state_dict())
    table, mask = model.pos.table, model.mask
    del model.pos.table, model.mask
    model.pos.register_buffer("table", table, persistent=False)
    model.register_buffer("mask", mask, persistent=False)
    log = tl.trace(model, x)
    assert torch.equal(log.output, model(x)) and log.unattributed == 1  # the global alone
    assert {b.address for b in log.buffers} == {"pos.table", "mask"} and set(model.state_dict()) == keys
    assert "plain tensor attribute" not in str(log)


class CachedBias(nn.Module):
    """Keeps a bias computed from its parameter in a dict per device, in eval mode (as LeViT's attention does)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8))
        self.bias_cache = {}

    def forward(self, x):
        if str(x.device) not in self.bias_cache:
            self.bias_cache[str(x.device)] = self.table.detach() * 2
        return x + self.bias_cache[str(x.device)]


def test_a_tensor_cached_in_a_module_dict_is_named_with_its_key():
    """A trace after the forward that filled a module's cache reads the cached tensor from outside the trace,
    without the ops that made it: the printed trace names the entry, not only the places a trace cannot see."""
    model, x = nn.Sequential(CachedBias()), torch.randn(3, 8)
    first = tl.trace(model, x)
    assert [op.type for op in first.ops if op.kind == "op"] == ["detach", "mul", "add"] and first.unattributed == 0
    log = tl.trace(model, x)
    assert torch.equal(log.output, first.output) and op_types(log) == ["add"] and log.unattributed == 1
    assert ("read by add_1_1:1; 0.bias_cache['cpu'] is held in a container attribute of the model (a dict, list or "
            "tuple, where no buffer is registered): made before this forward") in str(log)
    assert "made where the trace cannot see" not in str(log)


def test_a_users_mode_entered_inside_the_forward_sees_the_models_calls_and_nothing_of_captures():
    """docs/capture_honesty.md: a mode entered before ``tl.trace`` also sees capture's own reads; entered
    inside the forward, above capture's mode, it sees what it sees untraced."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(3, 4)
    untraced, inside, outside = FunctionLevelCalls(), FunctionLevelCalls(), FunctionLevelCalls()
    with untraced:
        expected = model(x)

    def forward(x):
        with inside:
            return model(x)

    log = tl.trace(forward, x)
    assert inside.names == untraced.names == ["linear", "relu", "linear"]
    assert [op.func_name for op in log.ops if op.kind == "op"] == untraced.names
    assert torch.equal(log.output, expected)
    with outside:
        tl.trace(model, x)
    assert "detach" in outside.names and len(outside.names) > len(untraced.names)  # as documented


class _MarksDirty(nn.Module):
    def forward(self, x):
        return DoubledInPlace.apply(x + 1) * 3


def test_a_saved_value_dropped_for_an_unseen_version_bump_names_the_causes_that_make_one():
    """``ctx.mark_dirty`` moves the marked tensor's version when ``apply`` returns, with no call capture sees:
    the saved value is dropped (capture cannot tell it from a real write), and the reason says what moves a
    version unseen. A write through ``.data`` is an op capture sees, and one through a NumPy view moves no
    version: the reason and the warning name neither."""
    x = torch.randn(3)
    with pytest.warns(UserWarning, match="mul_1_2:1") as warned:
        log = tl.trace(_MarksDirty(), x)
    assert torch.equal(log.output, _MarksDirty()(x))
    reason = log["mul_1_2:1"].dropped_reason
    assert "ctx.mark_dirty" in reason and "torch function handling disabled" in reason
    assert ".data" not in reason + str(warned[0].message) and "NumPy" not in reason

    def through_data(t):
        y = t * 2
        y.data.mul_(10)  # recorded as a `data` op and an in-place `mul_`: the saved `y` was copied first
        return y + 1

    written = tl.trace(through_data, torch.ones(2))
    assert not written.dropped_activations and written.validate().passed
    assert torch.equal(written["mul_1_1:1"].activation, torch.full((2,), 2.0))


def _binarize(tensor):
    return tensor.sign()


class BinarizeLinear(nn.Linear):
    """BinaryNet's binarized layer (Courbariaux et al.; the widely copied BinaryNet.pytorch code): it rebinds
    its input's and its weight's data to their signs, ``t.data = ...``, moving no version counter."""

    def forward(self, input):
        if input.size(1) != 784:
            input.data = _binarize(input.data)
        if not hasattr(self.weight, "org"):
            self.weight.org = self.weight.data.clone()
        self.weight.data = _binarize(self.weight.org)
        out = nn.functional.linear(input, self.weight)
        if self.bias is not None:
            self.bias.org = self.bias.data.clone()
            out += self.bias.view(1, -1).expand_as(out)
        return out


class BinaryMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = BinarizeLinear(784, 16)
        self.bn1 = nn.BatchNorm1d(16)
        self.htanh1 = nn.Hardtanh()
        self.fc2 = BinarizeLinear(16, 10)

    def forward(self, x):
        return self.fc2(self.htanh1(self.bn1(self.fc1(x.view(-1, 784)))))


@pytest.mark.parametrize("grads", [False, True])
def test_rebinding_a_tensors_data_makes_its_readers_name_the_new_value(grads):
    """``input.data = sign(input.data)`` changes what ``input`` holds with no write: fc2's linear reads the
    signs, so its parent is the ``sign`` op, and the Hardtanh's saved output keeps the values it made."""
    torch.manual_seed(0)
    model, x = BinaryMLP().eval(), torch.randn(4, 784)
    with torch.no_grad():
        hardtanh_out = model.htanh1(model.bn1(model.fc1(x)))
    log = tl.trace(model, x, grads=grads)
    (linear,) = [op for op in log.ops if op.func_name == "linear" and op.module_address == "fc2"]
    (sign,) = [log[p] for p in linear.parents]
    assert sign.func_name == "sign" and sign.module_address == "fc2"
    assert torch.equal(linear.call.func(sign.activation, model.fc2.weight), linear.activation)
    assert torch.equal(log["htanh1"].activation, hardtanh_out)
    assert tl.validate(model, x).passed


class RescaledAfterRebinding(nn.Linear):
    """Rebinds its weight's data to the signs of a kept copy, then scales the weight in place, with an in-place
    write before both: replay of each op that read or wrote the weight needs the value it had at that point."""

    def forward(self, x):
        before = nn.functional.linear(x, self.weight)
        with torch.no_grad():
            self.weight.mul_(1.0)
        if not hasattr(self.weight, "org"):
            self.weight.org = self.weight.data.clone()
        self.weight.data = self.weight.org.sign()
        with torch.no_grad():
            self.weight.mul_(0.5)
        return nn.functional.linear(x, self.weight, self.bias) + before


@pytest.mark.parametrize("compiled", PATHS)
def test_a_parameter_written_in_place_after_its_data_was_rebound_replays_with_the_value_it_had(compiled):
    torch.manual_seed(0)
    traced, untraced = RescaledAfterRebinding(4, 4), RescaledAfterRebinding(4, 4)
    untraced.load_state_dict(traced.state_dict())
    x = torch.randn(3, 4)
    with on_path(compiled):
        for _ in range(2):  # the first forward keeps the original weight, the second reads it back
            expected = untraced(x)
            log = tl.trace(traced, x)
            assert torch.equal(log.output, expected) and torch.equal(traced.weight, untraced.weight)
            result = log.validate()
            assert not result.mismatched and result.passed, str(result)


class ClampedThroughData(nn.Module):
    """Clamps an encoder's output through ``.data`` after taking a view of it: the view reads the clamped
    values, though neither its version counter nor its base's moved."""

    def __init__(self):
        super().__init__()
        self.encoder = zoo()["mlp"][0]

    def forward(self, x):
        h = self.encoder(x)
        first = h[:, :2]
        h.data.clamp_(-0.1, 0.1)
        return first * 2, h.t()


def test_a_write_through_data_reaches_the_views_of_the_tensor_written():
    model, x = ClampedThroughData(), torch.randn(4, 16)
    with torch.no_grad():
        unclamped = model.encoder(x)
    log = tl.trace(model, x)
    clamp = next(op for op in log.ops if op.func_name == "clamp_")
    view_read, base_read = (next(op for op in log.ops if op.func_name == name) for name in ("mul", "t"))
    assert view_read.parents == [clamp.label] and base_read.parents == [clamp.label]
    sliced = next(op for op in log.ops if op.func_name == "__getitem__")
    assert torch.equal(sliced.activation, unclamped[:, :2])  # what the slice held when it was made
    assert torch.equal(log["output_1"].activation, log.output[0])
    assert tl.validate(model, x).passed


def test_a_tensor_slice_bound_is_no_parent_and_is_not_replayed():
    def window(x, start):
        return x[:, start:start + 2] * 1

    x, start = torch.arange(12.0).reshape(2, 6), torch.tensor(3)
    log = tl.trace(window, (x, start))
    sliced = next(op for op in log.ops if op.func_name == "__getitem__")
    assert torch.equal(sliced.activation, x[:, 3:5])
    assert sliced.parents == ["input_1:1"]  # the slice's tensor bounds are held with the slice, not as parents
    assert "a slice bound is a tensor" in dict(log.validate().not_replayed)[sliced.label]


def test_a_dynamically_quantized_model_names_its_packed_weights_instead_of_no_params(tmp_path):
    """quantize_dynamic packs each Linear's weight and bias into one object that is not a tensor: the ops that read
    it say which packed weight they read, and the trace says why they list no params."""
    pytest.importorskip("transformers")
    import warnings

    from real_models import build

    model, args, kwargs = build("bert")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notices for its quantized modules
        quantized = torch.ao.quantization.quantize_dynamic(model.eval(), {nn.Linear}, dtype=torch.qint8)
        expected = quantized(*args, **kwargs).logits
        log = tl.trace(quantized, args, kwargs)
    assert torch.equal(log.output.logits, expected)  # what runs is unchanged
    linears = [op for op in log.ops if op.func_name == "linear_dynamic"]
    query = "bert.encoder.layer.0.attention.self.query"
    assert linears[0].params == () and linears[0].packed_params == (f"{query}._packed_params._packed_params",)
    assert all(len(op.packed_params) == 1 for op in linears)
    assert len({op.packed_params for op in linears}) == len(linears)  # each Linear's own
    (caveat,) = log.caveats
    assert caveat.startswith("quantized modules hold packed weights") and f"{query}._packed_params." in caveat
    assert "packed weights of quantized modules are not parameters" in str(log.summary())
    assert tl.load(log.save(tmp_path / "q")).caveats == log.caveats  # kept by a save


def test_grads_on_a_dynamically_quantized_model_say_its_packed_weights_take_no_gradient():
    # The warning blamed frozen parameters or inputs without requires_grad, where the model had its weights packed
    # by quantize_dynamic, which no requires_grad_() can make take a gradient.
    import warnings

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notices for its quantized modules
        quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    says = r"no tensor of this forward requires grad.*packed weights \(0\._packed_params\._packed_params, 2\."
    with pytest.warns(UserWarning, match=says):
        tl.trace(quantized, torch.randn(2, 4), grads=True)
    x = torch.randn(2, 4, requires_grad=True)
    quantized(x).sum().backward()  # a gradient reaches the output, none the input: torch's answer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an input that requires grad makes outputs that do: nothing said
        log = tl.trace(quantized, x.detach().requires_grad_(), grads=True)
    log.backward(log.output.sum())
    assert x.grad is None and log["input_1:1"].grad is None and log["output_1:1"].grad is not None


def test_a_dynamically_quantized_lstm_names_the_packed_weights_of_its_layers():
    import warnings

    from real_models import build

    model, args, kwargs = build("lstm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(model.eval(), {nn.LSTM}, dtype=torch.qint8)
        log = tl.trace(quantized, args, kwargs)
    (lstm,) = [op for op in log.ops if op.func_name == "quantized_lstm" and op.multi_output_index == 0]
    # one packed weight per layer (two layers), passed to the kernel in a list
    packed = ("rnn._all_weight_values.0.param", "rnn._all_weight_values.1.param")
    assert lstm.params == () and lstm.packed_params == packed
    assert all(path in log.caveats[0] for path in packed)
