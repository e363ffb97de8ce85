"""Tracing under torch's global modes and on unusual tensors and wrappers.

Grad modes, autocast, meta tensors, complex/integer/sparse data, compiled and data-parallel wrappers:
each either traces faithfully (outputs bit-identical to an untraced run, replay validation passing) or is
refused with an error that says what to do instead.  Each ``@CASE`` returns its row of
docs/reliability.md.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from torchlens.validate import outputs_equal  # noqa: E402
from reliability_cases import case, outcome, titles  # noqa: E402
from untouched import assert_clean_process, assert_untouched, snapshot  # noqa: E402
from accel_paths import PATHS, on_path  # noqa: E402

CASE = case("Contexts and wrappers")


class Net(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = F.gelu(self.fc(x))
        h = self.norm(h + x)
        return self.head(h).softmax(-1)


def faithful(model, args, context=None) -> tuple:
    """Trace and validate under ``context``; assert faithfulness; return (trace, validation)."""
    context = context or (lambda: torch.enable_grad())
    before = snapshot(model, args if isinstance(args, tuple) else (args,))
    with context():
        expected = model(*args) if isinstance(args, tuple) else model(args)
        log = tl.trace(model, args)
        result = tl.validate(model, args)
    assert outputs_equal(log.output, expected), "traced output differs from the untraced run"
    assert result.outputs_match and result.passed, str(result)
    assert_untouched(before, snapshot(model, args if isinstance(args, tuple) else (args,)))
    return log, result


@CASE
def no_grad():
    """torch.no_grad()."""
    log, result = faithful(Net(), torch.randn(4, 6), torch.no_grad)
    assert not any(op.requires_grad for op in log.ops)
    return f"faithful; {result.replayed} ops replayed exactly; no op records requires_grad"


@CASE
def inference_mode():
    """torch.inference_mode() around the trace, and inference tensors passed in afterwards."""
    from torchlens.capture.state import INFERENCE_CAVEAT

    model, x = Net(), torch.randn(4, 6)
    with torch.inference_mode():
        expected = model(x)
        log = tl.trace(model, x)
        result = tl.validate(model, x)
        made_inside = torch.randn(4, 6)
    assert torch.equal(log.output, expected) and result.passed and result.outputs_match, str(result)
    assert log.caveats == (INFERENCE_CAVEAT,)
    with torch.no_grad():  # an inference tensor may enter a no_grad forward
        passed_in = tl.trace(model, made_inside)
        assert torch.equal(passed_in.output, model(made_inside))
    assert passed_in.caveats == (INFERENCE_CAVEAT,)
    assert tl.trace(model, x).caveats == ()  # a plain trace claims the full guarantees
    assert_clean_process()
    return (f"faithful; {result.replayed} ops replayed exactly; Trace.caveats says in-place writes to "
            "inference tensors are known by name only")


@CASE
def autocast_cpu_bf16():
    """torch.autocast('cpu', dtype=torch.bfloat16), validated inside and outside the autocast region."""
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    model, x = Net(), torch.randn(4, 6)
    log, result = faithful(model, x, autocast)
    linears = [op for op in log.ops if op.type == "linear"]
    assert linears and all(op.dtype == torch.bfloat16 for op in linears)
    assert log.validate().passed  # replayed outside the region: autocast is reapplied as traced
    plain = tl.trace(model, x)
    with autocast():
        assert plain.validate().passed  # and a plain trace replays without it
    return f"faithful; linear ops recorded as bfloat16; {result.replayed} ops replay exactly in or out of it"


@CASE
def backward_after_trace():
    """torch.enable_grad() with a backward pass through the traced output."""
    x = torch.randn(4, 6, requires_grad=True)
    plain, traced = Net(), Net()
    plain(x).pow(2).sum().backward()
    expected_x_grad = x.grad.clone()
    x.grad = None
    log = tl.trace(traced, x)
    log.output.pow(2).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), traced.parameters()):
        assert torch.equal(p.grad, q.grad), f"gradient of {name} differs"
    assert torch.equal(x.grad, expected_x_grad)
    assert all(not t.requires_grad for t in log._activations.values())  # saved copies hold no graph
    return "gradients of every parameter and of the input are bit-identical to an untraced backward"


@CASE
def meta_device():
    """Meta-device model and input (shapes only, no data)."""
    model = Net().to("meta")
    x = torch.randn(4, 6, device="meta")
    log = tl.trace(model, x)
    assert log.output.is_meta and log["head"].shape == (4, 3)
    result = tl.validate(model, x)
    assert result.status == "nothing to replay" and result.replayed == 0 and result.outputs_match is None
    assert not result.passed and "not compared by value" in str(result)  # shapes alone vouch for no value
    reasons = {reason for _, reason in result.not_replayed}
    assert reasons == {"meta tensors hold no values to compare"}, reasons
    return f"traced with shapes; validation answers nothing to replay and says why ({reasons.pop()})"


def test_a_meta_forward_traces_with_save_device_as_without_it():
    # save_device="cpu" copied each saved tensor there, and a meta tensor has no data to copy: the trace
    # raised torch's "Cannot copy out of meta tensor; no data!" with no word of where it came from.
    model, x = Net().to("meta"), torch.randn(4, 6, device="meta")
    plain = tl.trace(model, x)
    moved = tl.trace(model, x, save_device="cpu")
    assert [(op.label, op.shape, op.device) for op in moved] == [(op.label, op.shape, op.device) for op in plain]
    assert all(op.activation.is_meta for op in moved if op.has_activation)
    assert moved.validate().status == "nothing to replay"


class WithFactories(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return self.fc(x) + torch.ones(6) * torch.arange(6)


def test_validation_inside_a_device_block_replays_each_factory_on_the_device_it_ran_on():
    # Inside `with torch.device("meta")` validation raised "Tensor.item() cannot be called on meta tensors"
    # from its own probe of the denormal setting; past that, torch.ones and torch.arange replayed onto the
    # meta device and were reported as differing from what they had made.
    log = tl.trace(WithFactories(), torch.randn(2, 6))
    outside = log.validate()
    with torch.device("meta"):
        inside = log.validate()
    assert outside.passed and not outside.not_replayed
    assert inside.passed and (inside.replayed, inside.mismatched) == (outside.replayed, []), str(inside)
    assert_clean_process()


def test_a_meta_trace_says_in_print_that_its_activations_hold_no_values():
    # The summary read "8 activations saved, 576 B" for a shape-only trace, as if it held 576 bytes of values.
    meta = str(tl.trace(Net().to("meta"), torch.randn(4, 6, device="meta")))
    assert "8 activations saved" in meta and "8 of them meta or fake tensors: shapes and dtypes, no values" in meta
    assert "no values" not in str(tl.trace(Net(), torch.randn(4, 6)))


class WritesThroughViews(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        a, b = self.fc(x), x * 3
        a[0:2].mul_(2)  # a written through a view
        b[1].add_(1)  # b likewise
        ones = torch.ones_like(x[0])
        ones.clamp_(0, 1)
        return a + b + ones


@pytest.mark.parametrize("compiled", PATHS)
def test_a_meta_or_fake_forward_names_the_parents_a_real_one_does_after_writes_through_views(compiled):
    # A storage with no memory has address 0, which every meta and fake storage shares: capture took them
    # for one storage, and `a + b` was recorded as reading `clamp_` twice instead of `mul_` and `add_`.
    from torch._subclasses.fake_tensor import FakeTensorMode

    def parents(log):
        return [(op.label, op.parents) for op in log.ops]

    real = tl.trace(WritesThroughViews(), torch.randn(4, 6))
    assert real["add_2_10"].parents == ["mul_2_4:1", "add_1_6:1"]
    with on_path(compiled), warnings.catch_warnings():
        # Copying a value about to be written asked a fake tensor for its memory's address: torch warns.
        warnings.filterwarnings("error", message="Accessing the data pointer of FakeTensor")
        meta = tl.trace(WritesThroughViews().to("meta"), torch.randn(4, 6, device="meta"))
        with FakeTensorMode():
            fake = tl.trace(WritesThroughViews(), torch.randn(4, 6))
    assert parents(meta) == parents(real) and parents(fake) == parents(real)
    assert sorted(meta.alias_reads) == sorted(fake.alias_reads) == sorted(real.alias_reads)


def test_a_trace_loaded_inside_a_device_block_keeps_the_values_of_every_layout(tmp_path):
    # A channels_last activation is laid out again after reading, in memory torch.empty_strided made: inside
    # `with torch.device("meta")` that memory was a meta tensor, and the loaded activation had no values.
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    log = tl.trace(conv, torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last))
    log.save(tmp_path / "trace")
    with torch.device("meta"):
        loaded = tl.load(tmp_path / "trace")
    activation = loaded["conv2d_1_1"].activation
    assert activation.device.type == "cpu" and torch.equal(activation, log["conv2d_1_1"].activation)
    assert activation.is_contiguous(memory_format=torch.channels_last)


def test_a_trace_inside_disabled_torch_functions_is_refused_rather_than_empty():
    # Inside torch._C.DisableTorchFunction() no call reaches capture: the trace came back with only its input
    # and output nodes, as if the model ran no op.
    model, x = Net(), torch.randn(4, 6)
    with torch._C.DisableTorchFunction():
        for run in (lambda: tl.trace(model, x), lambda: tl.validate(model, x)):
            with pytest.raises(RuntimeError, match=r"inside torch._C.DisableTorchFunction\(\)"):
                run()
        assert not torch._C._is_torch_function_enabled()  # the caller's block is left as it was
    with torch._C.DisableTorchFunctionSubclass():  # subclasses off, modes on: capture sees every call
        assert len(tl.trace(model, x).ops) == 8
    assert_clean_process()


class Mixed(nn.Module):
    def forward(self, z, counts):
        spectrum = torch.fft.fft(z)
        power = (spectrum * spectrum.conj()).real
        bins = torch.bincount(counts % 5, minlength=5)
        return power.sum(-1), bins * 2 // 3, (counts > 2).logical_and(counts < 7)


@CASE
def complex_and_integer_dtypes():
    """Complex, integer and boolean tensors."""
    z = torch.randn(3, 8, dtype=torch.complex64)
    counts = torch.arange(12)
    log, result = faithful(Mixed(), (z, counts))
    dtypes = {op.dtype for op in log.ops}
    assert {torch.complex64, torch.int64, torch.bool, torch.float32} <= dtypes
    return f"faithful; {result.replayed} ops replayed exactly across complex64, int64, bool and float32"


class SparseMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)

    def forward(self, adjacency, features):
        return self.fc(torch.sparse.mm(adjacency, features)).relu()


@CASE
def sparse_inputs():
    """A sparse COO input (graph adjacency)."""
    adjacency = torch.eye(5).add(torch.diag(torch.ones(4), 1)).to_sparse()
    features = torch.randn(5, 4)
    log, result = faithful(SparseMatmul(), (adjacency, features))
    assert log.inputs[0].shape == (5, 5)
    return f"supported: faithful, {result.replayed} ops replayed exactly"


@CASE
def compiled_module_and_function():
    """torch.compile'd module and function (unwrapped, never compiled by tracing)."""
    import torch._dynamo

    model, x = Net(), torch.randn(4, 6)
    compiled = torch.compile(model)  # lazy: nothing is compiled until it is called
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    frames_before = sum(torch._dynamo.utils.counters["frames"].values())
    log = tl.trace(compiled, x)
    assert log.model is model and outputs_equal(log.output, model(x))
    assert [mc.label for mc in log.module_calls] == ["fc:1", "norm:1", "head:1"]

    def f(a):
        return torch.sin(a) * 2

    flog = tl.trace(torch.compile(f), x)
    assert [op.type for op in flog.ops] == ["input", "sin", "mul", "output"]
    assert sum(torch._dynamo.utils.counters["frames"].values()) == frames_before  # nothing compiled
    assert_clean_process()
    return "traced the eager module / function underneath; nothing was compiled"


@CASE
def data_parallel_wrappers():
    """nn.DataParallel and DistributedDataParallel wrappers."""
    import torch.distributed as dist

    model, x = Net(), torch.randn(4, 6)
    log = tl.trace(nn.DataParallel(model), x)
    assert log.model is model and [mc.label for mc in log.module_calls] == ["fc:1", "norm:1", "head:1"]
    if not dist.is_available():
        return "DataParallel unwrapped to .module (torch.distributed unavailable here)"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        dlog = tl.trace(ddp, x)
    finally:
        dist.destroy_process_group()
    assert dlog.model is model and outputs_equal(dlog.output, model(x))
    return "both unwrapped to .module; module addresses are the inner model's"


class Vmapped(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return torch.vmap(lambda row: self.fc(row).relu())(x) + 1


@CASE
def vmap_inside_forward():
    """torch.vmap inside forward (ops see per-example tensors)."""
    model, x = Vmapped(), torch.randn(4, 3)
    log = tl.trace(model, x)
    assert outputs_equal(log.output, model(x))
    inside = log["linear_1_1:1"]
    assert inside.shape == (3,)  # the per-example shape the op saw
    with pytest.raises(tl.ActivationUnavailable, match="torch.func transform"):
        inside.activation
    result = log.validate()  # nothing can be replayed, and the verdict says so rather than passing
    assert result.status == "nothing to replay" and not result.passed and result.replayed == 0
    assert all(reason for _, reason in result.not_replayed)
    assert log["add_1_3:1"].unattributed_args == 1  # vmap's unbatched result is made outside capture
    return ("faithful output; ops inside record per-example shapes; their saved values are dropped with a "
            "reason, and the op after vmap says its input came from outside the trace")


class EmptyThenOut(nn.Module):
    def forward(self, x):
        buffer = torch.empty(3)
        torch.add(x, 1, out=buffer)
        return buffer * 2


@CASE
def out_argument_into_empty_buffer():
    """torch.add(..., out=buffer) into a torch.empty buffer."""
    log, result = faithful(EmptyThenOut(), torch.randn(3))
    assert [label for label, _ in result.not_replayed] == ["empty_1_1:1"]
    assert log["add_1_2:1"].is_inplace
    return f"faithful; the write is an in-place op; torch.empty is not replayed ({result.not_replayed[0][1]})"


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(3, 4)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        out, _ = self.rnn(packed)
        return nn.utils.rnn.pad_packed_sequence(out)[0]


@CASE
def packed_sequences():
    """An LSTM over a PackedSequence."""
    log, result = faithful(PackedLSTM().eval(), (torch.randn(5, 2, 3), torch.tensor([5, 3])))
    assert log["rnn"].module == "rnn:1"
    return f"faithful; {result.replayed} ops replayed exactly"


class DataWrite(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        y = self.fc(x)
        y.data.mul_(2)  # shares y's memory but not its version counter
        return y + 1


@CASE
def write_through_data():
    """A write through .data (invisible to version counters) before the value is read again."""
    model, x = DataWrite(), torch.randn(2, 3)
    log = tl.trace(model, x)
    assert outputs_equal(log.output, model(x))
    result = tl.validate(model, x)
    assert result.passed and not result.mismatched
    assert log["add_1_4:1"].parents == ["mul_1_3:1"]
    return ("output faithful; the write through .data rebinds y to the in-place op, so the add reads "
            "mul_1_3:1 and every op replays")


class ClampedRow(nn.Module):
    """Clamps one row of its weight in place under no_grad, through a view, then uses the weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        with torch.no_grad():
            self.weight[0].clamp_(-0.1, 0.1)  # torch refuses this view's grad_fn from here on
        return (x @ self.weight).tanh()


@CASE
def view_written_under_no_grad():
    """A view of a parameter made and written in place under no_grad (torch refuses its grad_fn)."""
    x = torch.randn(2, 3)
    plain, traced = ClampedRow(), ClampedRow()
    plain(x).sum().backward()
    log = tl.trace(traced, x, grads=True)
    log.backward(log.output.sum())
    assert torch.equal(log.output, plain(x)) and torch.equal(traced.weight, plain.weight)
    assert torch.equal(traced.weight.grad, plain.weight.grad)
    clamp = log["clamp_1_2"]
    assert clamp.requires_grad and clamp.grad_fn is None and clamp.grad is None  # no backward passes it
    result = tl.validate(traced, x)
    assert result.passed and result.outputs_match, str(result)
    return (f"faithful, gradients included; the view is recorded as requiring grad with no backward node; "
            f"{result.replayed} ops replayed exactly")


@pytest.mark.parametrize("title", titles("Contexts and wrappers"))
def test_case(title):
    assert outcome("Contexts and wrappers", title)
