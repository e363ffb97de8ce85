"""Unusual tensors and execution contexts: tensors without values (FakeTensorMode), tensor subclasses
(their own ``__torch_function__``, ``MaskedTensor``), torch.func transforms and forward-mode AD inside a
forward, compiled and TorchScript submodules as intervention sites.  A trace of each is right or says
what it cannot vouch for, and validation answers instead of failing inside torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.two_tensor import TwoTensor

import torchlens as tl

from accel_paths import PATHS, on_path


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.fc(x).relu())


def test_validate_under_fake_tensor_mode_replays_nothing_and_says_why():
    """A FakeTensor reports a real device but holds no values: validation treats it as a meta tensor
    (shapes and dtypes compared, no op replayed, the reason given) instead of failing inside torch (a deep
    copy of the model lands in another FakeTensorMode; ``torch.equal`` on fake tensors is data-dependent)."""
    with FakeTensorMode():
        model, x = Small(), torch.randn(2, 4)
        log = tl.trace(model, x)
        assert log["head"].shape == (2, 2)
        result = tl.validate(model, x)
        replayed = log.validate()
    reason = "fake tensors (FakeTensorMode) hold no values to compare"
    assert result.status == "nothing to replay" and result.replayed == 0 and result.outputs_match is None, str(result)
    assert {why for _, why in result.not_replayed} == {reason}
    assert replayed.status == "nothing to replay" and {why for _, why in replayed.not_replayed} == {reason}


@pytest.mark.parametrize("compiled", PATHS)
def test_a_model_with_real_weights_traces_under_a_fake_tensor_mode_that_allows_them(compiled):
    """A model made outside ``FakeTensorMode(allow_non_fake_inputs=True)`` and run on fake inputs inside it returns
    a FakeTensor: the check of what a forward returned walked its attributes as an output object's and refused
    the trace, saying the forward returned "a WeakIdKeyDictionary at output.fake_mode.fake_tensor_converter..."."""
    model = Small()
    with FakeTensorMode(allow_non_fake_inputs=True), on_path(compiled):
        x = torch.randn(2, 4)
        expected = model(x)
        log = tl.trace(model, x)
    assert type(log.output) is type(expected) and log.output.shape == expected.shape == (2, 2)
    assert [op.shape for op in log.ops] == [(2, 4), (2, 4), (2, 4), (2, 2), (2, 2)]
    assert log["linear_1_1"].params == ("fc.weight", "fc.bias")


def test_a_parameter_of_a_tensor_subclass_is_named_as_a_parameter():
    """``nn.Parameter`` of a subclass's tensor is that subclass (a FakeTensor under ``FakeTensorMode``, a tensor
    subclass of the user's): capture knew Parameters by their exact type, so these were recorded as tensors
    of unknown origin, each op with no parameters and two unattributed arguments."""

    class Marked(torch.Tensor):
        pass

    torch.manual_seed(0)
    plain = tl.trace(Small(), torch.randn(2, 4))
    with FakeTensorMode():
        fake = tl.trace(Small(), torch.randn(2, 4))
    marked_model = Small()
    marked_model.fc.weight = nn.Parameter(marked_model.fc.weight.detach().as_subclass(Marked))
    marked = tl.trace(marked_model, torch.randn(2, 4))
    for log in (fake, marked):
        assert [(op.label, op.params, op.parents) for op in log.ops] == \
               [(op.label, op.params, op.parents) for op in plain.ops]
        assert log.unattributed == 0 and log["linear_1_1"].params == ("fc.weight", "fc.bias")
    assert marked.validate().passed


def test_a_fake_activation_written_after_the_trace_is_not_named_a_parameters_memory():
    """Every fake storage is at address 0, as the parameters' are: an activation written after the trace was
    said to be "parameter fc.weight's" memory, updated "by an optimizer step"."""
    with FakeTensorMode():
        log = tl.trace(Small(), torch.randn(2, 4))
        log["relu_1_2"].activation.add_(1)
    assert log["relu_1_2"].dropped_reason.startswith("written in place after the trace ended")



def test_the_readers_of_values_read_fake_tensors_as_shapes_without_values(tmp_path):
    """record_finite=True raised torch's DataDependentOutputException mid-trace, as did nonfinite_origin, the
    html viewer and the gradient statistics; log.save raised ".numpy() is not supported for tensor
    subclasses". Each now treats a FakeTensor as the meta tensor it stands for."""
    with FakeTensorMode():
        model, x = Small(), torch.randn(2, 4)
    flagged = tl.trace(model, x, record_finite=True)
    assert all(op.finite is None for op in flagged)  # no values: not examined
    with pytest.raises(ValueError, match="FakeTensorMode"):
        tl.debug.nonfinite_origin(tl.trace(model, x))
    assert "head" in tl.trace(model, x).render(format="html")
    grads = tl.trace(model, x, grads=True)
    grads.backward(grads.output.sum())
    assert grads.to_pandas()["grad_norm"].isna().all()
    assert "no values" in grads.render(format="html")
    with pytest.raises(ValueError, match="FakeTensorMode"):
        tl.debug.nonfinite_origin(grads, grads=True)
    loaded = tl.load(grads.save(tmp_path / "fake"))
    assert [op.shape for op in loaded] == [op.shape for op in grads]
    with pytest.raises(tl.ActivationUnavailable, match="fake tensor"):
        loaded["head"].activation


class Doubling(torch.Tensor):
    """A subclass whose ``__torch_function__`` changes arithmetic: ``a + b`` adds ``b`` twice."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.Tensor.add, torch.Tensor.__add__, torch.add):
            with torch._C.DisableTorchFunctionSubclass():
                out = (out + args[1]).as_subclass(cls)
        return out


class AddAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + 1


@pytest.mark.parametrize("site", ["fc", "linear_1_1:1"])
@pytest.mark.parametrize("action", [tl.zero_ablate(), tl.steer(torch.ones(4))], ids=["zero_ablate", "steer"])
def test_an_action_on_a_tensor_subclass_computes_as_a_forward_hook_does(site, action):
    """The action's value is made and typed by the subclass's own ``__torch_function__``, as in a forward
    hook: downstream ops see the subclass (its arithmetic), and the action adds no op to the trace."""
    torch.manual_seed(0)
    model, x = AddAfter(), torch.randn(2, 4).as_subclass(Doubling)
    handle = model.fc.register_forward_hook(lambda module, args, out: action(out, None))
    with torch.no_grad():
        expected = model(x)
    handle.remove()
    with torch.no_grad():
        log = tl.trace(model, x, intervene={site: action})
        plain = tl.trace(model, x)
    assert type(log.output) is Doubling and torch.equal(log.output, expected)
    assert log.labels == plain.labels


class GradInside(nn.Module):
    """A forward that takes a gradient with torch.func.grad (an input-gradient feature)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        g = torch.func.grad(lambda t: self.fc(t).tanh().sum())(x[0])
        return self.fc(x) * g


@pytest.mark.parametrize("save", ["all", "none"])
def test_ops_inside_a_torch_func_transform_have_no_gradient_to_claim(save):
    """Inside ``torch.func.grad`` the hooks sit on the transform's wrapped tensors and receive only its own
    inner backward (where torch refuses ``retain_grad()``): those ops say so instead of returning that value
    as d loss / d output; the ops outside keep the gradient ``retain_grad()`` gives, and the inner backward
    is not counted."""
    torch.manual_seed(0)
    model, x = GradInside(), torch.randn(3, 4)
    weights = torch.randn(3, 4)
    g = torch.func.grad(lambda t: model.fc(t).tanh().sum())(x[0])
    y = model.fc(x)
    y.retain_grad()
    out = y * g
    out.retain_grad()
    (out * weights).sum().backward()

    log = tl.trace(model, x, grads=True, save=save)
    log.backward((log.output * weights).sum())
    inside = [op for op in log.ops if op.type in ("tanh", "sum")] + [log["linear_1_2:1"]]
    for op in inside:
        with pytest.raises(tl.GradientUnavailable, match="inside a torch.func transform"):
            op.grad
        assert not op.has_grad
    assert torch.equal(log["linear_1_2:2"].grad, y.grad)
    assert torch.equal(log[log.ops[-2].label].grad, out.grad)
    assert log.num_backwards == 1
    assert log.to_pandas().set_index("label")["grad_norm"].isna()["tanh_1_3:1"]


def test_the_value_a_torch_func_transform_hands_back_is_not_claimed_to_have_no_gradient():
    """The last op inside ``torch.func.grad`` (its inner ``autograd.grad``) made the value the transform unwraps
    and returns: its hook sits on the wrapped tensor, which no backward reaches, while the loss does depend on
    that value.  With its activation saved, capture knows it was a wrapped tensor and says so, instead of a
    ``None`` that would read as "the loss does not depend on it"."""
    torch.manual_seed(0)
    model, x = GradInside(), torch.randn(3, 4)
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    (inner_grad,) = [op for op in log.ops if op.type == "grad"]
    with pytest.raises(tl.GradientUnavailable, match="no backward outside the transform reaches"):
        inner_grad.grad


class VmapInside(nn.Module):
    """A forward that maps a function over its rows with torch.vmap, then a Linear over the result."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(torch.vmap(lambda row: row.tanh() * 2)(x))


@pytest.mark.parametrize("save", ["all", "none"])
def test_ops_inside_vmap_say_they_ran_in_the_transform_not_under_no_grad(save):
    """Ops inside ``torch.vmap`` run on batched wrappers that need no gradient: their ``.grad`` says why in
    terms of the transform (never only "made under torch.no_grad()", which the forward did not use), and the
    op after the transform keeps the gradient ``retain_grad()`` gives."""
    torch.manual_seed(0)
    model, x = VmapInside(), torch.randn(4, 3, requires_grad=True)
    y = model.fc(torch.vmap(lambda row: row.tanh() * 2)(x))
    y.retain_grad()
    y.sum().backward()

    log = tl.trace(model, x, grads=True, save=save)
    log.backward(log.output.sum())
    for label in ("tanh_1_1:1", "mul_1_2:1"):
        with pytest.raises(tl.GradientUnavailable, match="vmap") as raised:
            log[label].grad
        assert "no_grad" not in str(raised.value) if save == "all" else "inside torch.vmap" in str(raised.value)
    assert torch.equal(log["linear_1_3:1"].grad, y.grad)



def test_an_intervention_traced_inside_vmap_computes_as_the_edited_model_does_under_vmap(tmp_path):
    """``torch.vmap`` around ``tl.trace(..., intervene=...)``: the run that finds the sites copied the
    transform's batched inputs by their storage, which they have none of (``NotImplementedError``), and the
    value an action replaced is the transform's wrapper, which no file can hold once vmap has returned."""
    torch.manual_seed(0)
    model, x = Small(), torch.randn(3, 4)
    logs = []

    def edited(row):
        logs.append(tl.trace(model, row, intervene={"relu_1_2": tl.scale(2.0)}))
        return logs[-1].output

    expected = torch.vmap(lambda row: model.head(model.fc(row).relu() * 2.0))(x)
    assert torch.equal(torch.vmap(edited)(x), expected)
    log = logs[0]
    assert [applied.label for applied in log.interventions] == ["relu_1_2:1"]
    assert log["relu_1_2"].original is None  # the value it replaced was vmap's wrapper: not kept
    log.save(tmp_path / "edited")
    assert [applied.label for applied in tl.load(tmp_path / "edited").interventions] == ["relu_1_2:1"]



def test_the_readers_of_values_inside_vmap_say_what_they_cannot_read(tmp_path):
    """Inside ``torch.vmap``, ``record_finite=True`` failed the trace with torch's "data-dependent control flow"
    error and ``tl.extract`` failed with "Cannot access data pointer"; ``nonfinite_origin`` then asked for the
    options the trace was given.  The flags are left unexamined, and the others name the transform."""
    torch.manual_seed(0)
    model, x = Small(), torch.randn(3, 4)
    logs = []
    out = torch.vmap(lambda row: logs.append(tl.trace(model, row, record_finite=True)) or logs[-1].output)(x)
    assert torch.equal(out, torch.vmap(model)(x))
    assert all(op.finite is None for op in logs[0].ops)
    with pytest.raises(ValueError, match="ran inside a torch.func transform"):
        tl.debug.nonfinite_origin(logs[0])
    result = logs[0].validate()  # it said "the trace saved no activations; trace with save='all'"
    assert result.status == "nothing to replay" and "inside a torch.func transform" in result.nothing_reason
    with pytest.raises(RuntimeError, match="tl.extract was called inside a torch.func transform"):
        torch.vmap(lambda row: tl.extract(model, [row], ["fc"], tmp_path / "x", progress=False) and row)(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu() * 2


class WithCompiled(nn.Module):
    def __init__(self, in_place: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.block = Block()
        if in_place:
            self.block.compile(backend="eager")
        else:
            self.block = torch.compile(self.block, backend="eager")
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.block(self.a(x)) + 1)


def _zeroed_block_output(model, x, inside: bool):
    """The untraced output with the block's Linear (``inside``) or the whole block returning zeros."""
    with torch.no_grad():
        block_out = torch.zeros(3, 4).relu() * 2 if inside else torch.zeros(3, 4)
        return model.b(block_out + 1)


@pytest.mark.parametrize("site", ["block.fc", "linear_2_2:1"])
def test_compiled_eager_interior_is_a_site_by_the_addresses_its_trace_shows(site):
    """With ``compiled="eager"`` the interior of a torch.compile'd submodule is traced as ``block.fc``: that
    address is a module site (not only ``block._orig_mod.fc``), and the op labels of that trace are label
    sites (the reference pass runs the submodule as the intervened run will)."""
    model, x = WithCompiled(in_place=False), torch.randn(3, 4)
    with torch.no_grad():
        log = tl.trace(model, x, intervene={site: tl.zero_ablate()}, compiled="eager")
    assert log["linear_2_2:1"].module == "block.fc:1"
    assert torch.equal(log.output, _zeroed_block_output(model, x, inside=True))


@pytest.mark.parametrize("in_place", [False, True], ids=["torch.compile", "module.compile"])
@pytest.mark.parametrize("site", ["block.fc", "block.fc:1", "block"])
def test_a_module_site_that_runs_compiled_is_refused_naming_the_way_out(in_place, site):
    """Under ``compiled="run"`` nothing inside a compiled submodule runs where a module hook could change it
    (and a module compiled in place would run the edit's hook a second time, inside its compiled code): such
    a site is refused before the forward runs, naming what to do, instead of an error about passed-through
    tensors or unreached sites after it."""
    model, x = WithCompiled(in_place), torch.randn(3, 4)
    if site == "block" and not in_place:  # the wrapper's own output is a site
        with torch.no_grad():
            log = tl.trace(model, x, intervene={site: tl.zero_ablate()})
        assert torch.equal(log.output, _zeroed_block_output(model, x, inside=False))
        return
    with pytest.raises(tl.InterventionError, match="runs compiled as one op.*compiled='eager'"):
        tl.trace(model, x, intervene={site: tl.zero_ablate()})
    with torch.no_grad():  # the ways out it names
        label = tl.trace(model, x)["block:1"].label
        at_op = tl.trace(model, x, intervene={label: tl.zero_ablate()})
        eager = tl.trace(model, x, intervene={site: tl.zero_ablate()}, compiled="eager")
    assert torch.equal(at_op.output, _zeroed_block_output(model, x, inside=False))
    assert torch.equal(eager.output, _zeroed_block_output(model, x, inside=site != "block"))


@pytest.mark.parametrize("site", ["block", "block:1", "block.fc"])
def test_a_torchscript_module_site_is_refused_naming_why(site):
    """A TorchScript submodule's ops run where capture cannot see them: its output has no op to change and
    its interior is unseen, so such a site is refused before the forward, saying so (not as a module
    returning its input, or as a site the forward never reached)."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("a", nn.Linear(4, 4))
    model.add_module("block", torch.jit.script(Block()))
    with pytest.raises(tl.InterventionError, match="TorchScript module .*before scripting"):
        tl.trace(model, torch.randn(3, 4), intervene={site: tl.zero_ablate()})


class UnseenWrite(nn.Module):
    """Writes its result where capture cannot see it (torch function handling off), then returns it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        with torch._C.DisableTorchFunction():
            y.mul_(2)
        return y


def test_an_output_whose_producer_was_dropped_says_so_instead_of_none():
    """An output node shows its producer's value: when that value was dropped (changed by a write capture
    could not see, made inside a torch.func transform), the output reads as dropped with the same reason,
    not as ``None``, which means "not selected for saving"."""
    log = tl.trace(UnseenWrite(), torch.randn(2, 4))
    producer = log["linear_1_1:1"]
    assert producer.dropped_reason is not None
    assert log["output_1:1"].dropped_reason == producer.dropped_reason
    with pytest.raises(tl.ActivationUnavailable, match="dropped"):
        log["output_1:1"].activation


class MaskedArithmetic(nn.Module):
    def forward(self, x):
        return (x * 2 + 1).sum(), x.exp()


@pytest.mark.filterwarnings("ignore::UserWarning")  # MaskedTensor is a prototype and says so
def test_validation_of_tensors_torch_cannot_compare_says_so():
    """``torch.equal`` has no kernel for a ``MaskedTensor``: the trace is right (each op's value and parents),
    and validation lists its ops as not replayed and the outputs as not compared, instead of raising."""
    from torch.masked import masked_tensor

    x = masked_tensor(torch.randn(2, 3), torch.tensor([[True, False, True], [False, True, True]]))
    expected = MaskedArithmetic()(x)
    log = tl.trace(MaskedArithmetic(), x)
    for got, want in zip(log.output, expected):
        assert torch.equal(got.get_data(), want.get_data()) and torch.equal(got.get_mask(), want.get_mask())
    result = tl.validate(MaskedArithmetic(), x)
    assert result.status == "nothing to replay" and result.outputs_match is None
    assert len(result.not_replayed) == 4
    assert all("MaskedTensor output cannot be compared" in why for _, why in result.not_replayed)
    assert "outputs not compared" in str(result)


class ForwardAD(nn.Module):
    """A Jacobian-vector product by forward-mode AD inside the forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        import torch.autograd.forward_ad as fwAD

        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(self.fc(fwAD.make_dual(x, torch.ones_like(x))).tanh())
        return primal, tangent


def test_forward_mode_ad_calls_are_not_replayed_rather_than_reported_as_mismatches():
    """``make_dual`` and ``unpack_dual`` name a dual level that ended with the forward: replayed after it they
    fail or return fewer outputs, which says nothing about the trace, so they are listed as not replayed (a
    false mismatch would fail a faithful trace)."""
    torch.manual_seed(0)
    model, x = ForwardAD(), torch.randn(2, 4)
    result = tl.validate(model, x)
    assert result.passed and result.outputs_match and not result.mismatched, str(result)
    skipped = {label: why for label, why in result.not_replayed}
    assert set(skipped) == {"makedual_1_2:1", "unpackdual_1_5:1"}
    assert all("forward-mode AD" in why for why in skipped.values())


class Wrapped(torch.Tensor):
    """A wrapper subclass (``_make_wrapper_subclass``): no storage of its own, its values in ``inner``."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda a: a.inner if isinstance(a, Wrapped) else a  # noqa: E731
        out = func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        return torch.utils._pytree.tree_map(lambda a: Wrapped(a) if isinstance(a, torch.Tensor) else a, out)

    __torch_function__ = torch._C._disabled_torch_function_impl


def test_extract_refuses_a_wrapper_subclass_by_name_rather_than_failing_in_numpy(tmp_path):
    # Its input hash and its activation writer read values through .numpy(), which torch refuses for a
    # wrapper subclass (".numpy() is not supported for tensor subclasses"), naming neither tensor.
    torch.manual_seed(0)
    model, x = Small(), torch.randn(3, 4)
    assert torch.equal(tl.trace(model, Wrapped(x)).output.inner, model(x))  # traced as any input
    with pytest.raises(TypeError, match="input args.0 is a Wrapped tensor subclass with no storage"):
        tl.extract(model, [Wrapped(x)], ["fc"], tmp_path / "input", progress=False)
    with pytest.raises(TypeError, match=r"linear_1_1 \(linear_1_1:1\) is a Wrapped tensor subclass with no storage"):
        tl.extract(lambda v: model(Wrapped(v)).inner, [x], ["linear_1_1"], tmp_path / "layer", progress=False)


def test_a_saved_subclass_loads_as_its_values_and_a_wrapper_subclass_says_why_it_was_left_out(tmp_path):
    torch.manual_seed(0)
    model, x = Small(), torch.randn(3, 4)
    doubled = tl.trace(model, x.as_subclass(Doubling))
    assert type(doubled["linear_1_1"].activation) is Doubling
    loaded = tl.load(doubled.save(tmp_path / "doubling"))
    assert type(loaded["linear_1_1"].activation) is torch.Tensor
    assert torch.equal(loaded["linear_1_1"].activation, doubled["linear_1_1"].activation.as_subclass(torch.Tensor))
    wrapped = tl.load(tl.trace(model, Wrapped(x)).save(tmp_path / "wrapped"))
    with pytest.raises(tl.errors.ActivationUnavailable, match="a Wrapped tensor subclass has no plain storage to save"):
        wrapped["linear_1_1"].activation


class _HalfComplexRotation(nn.Module):
    """Rotates in complex32 (``chalf``), which torch.equal has no kernel for."""

    def forward(self, x):
        z = torch.view_as_complex(x).chalf()
        return z * z


def test_complex32_outputs_are_compared_by_their_real_and_imaginary_halves():
    # torch.equal raised NotImplementedError for ComplexHalf: validation compared nothing ("nothing to replay").
    torch.manual_seed(0)
    result = tl.validate(_HalfComplexRotation(), torch.randn(4, 2))
    assert result.passed and result.outputs_match and result.replayed == 3, result


class _WriteThroughAView(nn.Module):
    """Writes part of a layer's output through a view of a view, then reads the whole output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x).relu()
        h.view(-1)[:3].mul_(2)
        return h.sum(-1), h * 1


@pytest.mark.parametrize("compiled", PATHS)
def test_a_write_through_a_view_of_a_wrapper_subclass_is_seen_as_for_a_plain_tensor(compiled):
    # A wrapper subclass has no storage: each of its tensors was its own memory, so the write through a view
    # reached nothing saved.  The readers after it named relu (whose value they did not read) as their parent,
    # and relu's and the view's saved values were dropped as changed by a write capture could not see.
    torch.manual_seed(0)
    model, x = _WriteThroughAView(), torch.randn(3, 4)
    with on_path(compiled):
        plain, wrapped = tl.trace(model, x), tl.trace(model, TwoTensor(x, x * 2))
    assert [op.parents for op in wrapped.ops] == [op.parents for op in plain.ops]
    assert wrapped["sum_1_6:1"].parents == wrapped["mul_2_7:1"].parents == ["mul_1_5:1"]
    relu, expected = wrapped["relu_1_2:1"], model.fc(x).relu()
    assert relu.dropped_reason is None and torch.equal(relu.activation.a, expected.detach())
    assert torch.equal(relu.activation.b, model.fc(x * 2).relu().detach())
    result = wrapped.validate()
    assert result.passed and result.replayed == plain.validate().replayed == 5, result


def _write_through_jagged_values(x):
    nested = torch.nested.nested_tensor([x[:2], x[2:]], layout=torch.jagged) * 2
    nested.mul_(3)
    nested.values()[:2].add_(1)  # the first sequence's rows, written through the values' view
    return (nested + 1).values()


@pytest.mark.parametrize("compiled", PATHS)
def test_a_write_through_the_values_of_a_jagged_nested_tensor_is_the_parent_of_its_next_read(compiled):
    # A jagged nested tensor is a wrapper subclass too: the read after the write named the op before it as its
    # parent, and that op's saved value was dropped as changed by a write capture could not see.
    x = torch.randn(5, 4)
    with on_path(compiled):
        log = tl.trace(_write_through_jagged_values, x)
    tripled, written, read = [op for op in log if op.type in ("mul", "add")][1:]
    assert tripled.dropped_reason is None and torch.equal(tripled.activation.values(), x * 6)
    assert read.parents == [written.label]
    assert torch.equal(log.output, x * 6 + torch.cat([torch.ones(2, 4), torch.zeros(3, 4)]) + 1)


def _relu_written_through_a_view(x):
    h = x.relu()
    h.view(-1)[:3].mul_(2)
    return h.sum(-1), h * 1


@pytest.mark.parametrize("compiled", PATHS)
def test_a_write_through_a_view_of_an_untraceable_wrapper_subclass_is_seen_through_the_view_s_base(compiled):
    # Wrapped has no __tensor_flatten__ to name what it wraps; its views still know their base.
    x = torch.rand(3, 4)
    with on_path(compiled):
        log = tl.trace(_relu_written_through_a_view, Wrapped(x))
    assert log["sum_1_5:1"].parents == log["mul_2_6:1"].parents == ["mul_1_4:1"]
    relu = log["relu_1_1:1"]
    assert relu.dropped_reason is None and torch.equal(relu.activation.inner, x.relu())


@pytest.mark.parametrize("compiled", PATHS)
def test_a_value_of_an_untraceable_wrapper_subclass_dropped_after_a_write_names_the_subclass_and_the_way_out(compiled):
    # What is saved of an output that requires grad is a detached copy, which for Wrapped is a new wrapper capture
    # cannot relate to the views written: dropped, it blamed a write capture could not see, naming none of this.
    torch.manual_seed(0)
    model, x = _WriteThroughAView(), torch.rand(3, 4)
    with on_path(compiled):
        log = tl.trace(model, Wrapped(x))
    assert log["sum_1_6:1"].parents == ["mul_1_5:1"]
    reason = log["relu_1_2:1"].dropped_reason
    assert "a Wrapped tensor subclass has no memory of its own" in reason and "__tensor_flatten__" in reason, reason
