"""Models whose structure or parameters change during or between forwards: lazy modules materialized by the
traced forward, modules and tensors registered inside forward, and models changed between two traces.  Each
trace must compute what an untraced forward computes, leave the model as that forward leaves it, and name the
modules and parameters the model has when the trace runs."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

import torchlens as tl

from accel_paths import PATHS, on_path
from trusted import assert_trusted


def _lazy_model():
    """Lazy layers of three kinds: a Linear's and a Conv's parameters and a BatchNorm's parameters and running
    statistics have no shape until the first forward materializes them, in place, inside the forward."""
    torch.manual_seed(0)
    return nn.Sequential(nn.LazyConv2d(4, 3), nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))


def _state(model) -> dict:
    return {name: (t.detach().clone(), t.requires_grad) for name, t in model.state_dict(keep_vars=True).items()}


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name][0], b[name][0]) and a[name][1] == b[name][1], name


@pytest.mark.parametrize("compiled", PATHS)
def test_a_lazy_model_traced_on_its_first_forward_is_materialized_as_untraced(compiled):
    traced, untraced, x = _lazy_model(), _lazy_model(), torch.randn(2, 3, 6, 6)
    torch.manual_seed(1)
    expected = untraced(x)
    torch.manual_seed(1)
    with on_path(compiled):
        log = tl.trace(traced, x, grads=True)
    assert torch.equal(log.output, expected)
    _assert_same_state(_state(traced), _state(untraced))
    assert type(traced[0].weight) is nn.Parameter and type(traced[1].running_mean) is torch.Tensor
    assert [(p.address, tuple(p.shape)) for p in log.params] == [
        ("0.weight", (4, 3, 3, 3)), ("0.bias", (4,)), ("1.weight", (4,)), ("1.bias", (4,)),
        ("4.weight", (3, 64)), ("4.bias", (3,))]
    assert log["4"].params == ("4.weight", "4.bias")
    log.backward(log.output.sum())
    expected.sum().backward()
    for (name, mine), theirs in zip(traced.named_parameters(), untraced.parameters()):
        assert torch.equal(mine.grad, theirs.grad), name


@pytest.mark.parametrize("compiled", PATHS)
def test_a_lazy_model_validates_on_its_first_forward_and_after(compiled):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.LazyConv2d(4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3)), torch.randn(2, 3, 6, 6)
    with on_path(compiled):
        first = tl.validate(model, x)  # on a copy, whose first forward materializes it as the traced one does
        assert_trusted(first)
        reasons = set(dict(first.not_replayed).values())
        assert "uninitialized memory (torch.empty and kin): its contents are not defined" in reasons
        assert_trusted(tl.validate(model, x))  # materialized now: the usual model


def test_validate_refuses_a_lazy_model_it_can_neither_copy_nor_put_back():
    model, x = _lazy_model(), torch.randn(2, 3, 6, 6)  # torch cannot deepcopy a LazyBatchNorm's running statistics
    with pytest.raises(ValueError, match=r"not yet materialized \(0.weight, 0.bias, 1.weight and 5 more\).*run one "
                                         r"forward first \(model\(x\)\), then call tl.validate again"):
        tl.validate(model, x)
    assert type(model[0]) is nn.LazyConv2d and model[0].has_uninitialized_params()  # left as it was
    model(x)
    assert_trusted(tl.validate(model, x))


def test_flops_vs_dispatch_refuses_a_lazy_model_it_could_not_put_back():
    model, x = _lazy_model(), torch.randn(2, 3, 6, 6)
    with pytest.raises(ValueError, match=r"flops_vs_dispatch runs the model and puts it back.*not yet materialized"):
        tl.report.flops_vs_dispatch(model.eval(), x)
    assert model[4].has_uninitialized_params()  # left as it was
    model(x)
    assert tl.report.flops_vs_dispatch(model, x).native_total > 0


def test_extract_refuses_a_lazy_model_not_yet_materialized(tmp_path):
    model, x = _lazy_model(), torch.randn(2, 3, 6, 6)
    with pytest.raises(ValueError, match=r"lazy modules are not yet materialized \(0.weight, .*run one forward first"):
        tl.extract(model, [x], layers=["4"], out=str(tmp_path / "feats"))
    model(x)
    folder = tl.extract(model, [x], layers=["4"], out=str(tmp_path / "feats"))
    assert torch.equal(torch.as_tensor(tl.load_extracted(folder)["4"][:]), model(x).detach())


class _BuildsItsHead(nn.Module):
    """A forward that makes a module of its own on every call: the trace names it ``<unregistered Linear #1>``."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)

    def forward(self, x):
        return nn.Linear(8, 4)(self.body(x))


@pytest.mark.parametrize("option", ["save", "grads"])
@pytest.mark.parametrize("entry", ["<unregistered Linear #1>", "<unregistered Linear #1>:1"])
def test_a_selection_naming_a_module_made_in_forward_says_how_to_select_it(option, entry):
    model, x = _BuildsItsHead(), torch.randn(2, 8)
    with pytest.raises(tl.UnmatchedSelection, match=rf"{option}= entry .* names a module the forward made itself.*"
                                                    rf"{option}=lambda op: '<unregistered Linear #1>:1' in op.modules"):
        tl.trace(model, x, **{option: [entry]})
    log = tl.trace(model, x, **{option: lambda op: "<unregistered Linear #1>:1" in op.modules})
    if option == "save":
        assert [log.ops[i].label for i in log.saved_activations] == ["linear_2_6:1", "output_1:1"]
    else:
        log.backward(log.output.sum())
        assert log["linear_2_6:1"].grad is not None and log["linear_1_5:1"].grad is None


def test_extract_layers_naming_a_module_made_in_forward_says_to_give_its_output_ops_label(tmp_path):
    # layers= takes no predicate: the advice to select the module's ops with one (save=lambda op: ...) could not be
    # followed in tl.extract.  The label of the call's output op, which the message names the way to, can.
    model, x = _BuildsItsHead(), torch.randn(2, 8)
    with pytest.raises(tl.UnmatchedSelection, match=r"layers= entry .* made itself.* give its output op's label "
                                                    r"instead \(log\['<unregistered Linear #1>:1'\]") as caught:
        tl.extract(model, [x], ["<unregistered Linear #1>"], tmp_path / "refused", progress=False)
    assert "lambda" not in str(caught.value)
    label = tl.trace(model, x)["<unregistered Linear #1>:1"].layer_label
    folder = tl.extract(model, [x], [label], tmp_path / "feats", progress=False)
    assert tl.load_extracted(folder)[label].shape == (2, 4)


def _gpt2_and_ids():
    from real_models import small_gpt2_lm

    return small_gpt2_lm(), torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("compiled", PATHS)
def test_a_trace_keeps_the_parameters_its_forward_read_after_a_cast_or_resize_in_place(compiled, tmp_path):
    """``model.half()`` and transformers' ``resize_token_embeddings`` give the same ``Parameter`` objects other
    data (``p.data = ...``), which moves no version counter: a trace taken before keeps the dtypes and shapes
    its ops read, in its records, its summary and its file, and a trace taken after shows the new ones."""
    model, ids = _gpt2_and_ids()
    with on_path(compiled):
        before = tl.trace(model, ids)
        model.resize_token_embeddings(70)
        model.half()
        after = tl.trace(model, ids.clip(max=69))
    before.save(tmp_path / "before.tl")
    loaded = tl.load(tmp_path / "before.tl")
    for log in (before, loaded):
        assert {p.dtype for p in log.params} == {torch.float32}
        assert log.params[0].address == "transformer.wte.weight" and log.params[0].shape == (64, 32)
    assert {p.dtype for p in after.params} == {torch.float16}
    assert after.params[0].shape == (70, 32)
    grown = 6 * 32  # the embedding, whose weight the head shares: counted once
    assert after.summary().rows[0]["params"] == before.summary().rows[0]["params"] + grown


@pytest.mark.parametrize("compiled", PATHS)
def test_validate_names_a_parameter_cast_since_the_trace_instead_of_reporting_a_mismatch(compiled):
    model, ids = _gpt2_and_ids()
    with on_path(compiled):
        log = tl.trace(model, ids)
    model.half()
    result = log.validate()
    assert_trusted(result)
    reasons = dict(result.not_replayed)
    assert "torch.float32 tensor of shape (64, 32), it now holds a torch.float16" in reasons[log.params[0].op_labels[0]]


class _WithAnUncalledLazyHead(nn.Module):
    """A lazy head its forward never calls: its parameters stay uninitialized, with no shape."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.head = nn.LazyLinear(5)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("compiled", PATHS)
def test_a_lazy_module_the_forward_never_calls_is_traced_as_untraced(compiled):
    model, x = _WithAnUncalledLazyHead(), torch.randn(1, 4)
    with on_path(compiled):
        log = tl.trace(model, x)
    assert torch.equal(log.output, model(x)) and [c.address for c in log.module_calls] == ["fc"]


class _CallsItsForward(nn.Linear):
    """A class with its own ``_call_impl``, not reached through ``nn.Module``'s: capture redirects it too."""

    def _call_impl(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


@pytest.mark.parametrize("compiled", PATHS)
def test_a_module_given_another_class_between_traces_is_seen_by_the_next_trace(compiled):
    # The class swap leaves every dict of the module as it was: the model's cached index once kept its
    # module classes, so the new class's own _call_impl was not redirected and the call went unrecorded.
    model, x = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), torch.randn(1, 2)
    with on_path(compiled):
        tl.trace(model, x)
        model[2].__class__ = _CallsItsForward
        log = tl.trace(model, x)
    assert [c.address for c in log.module_calls] == ["0", "1", "2"] and torch.equal(log.output, model(x))


class _NamesItsOwnModules(nn.Module):
    """Names its modules through a ``named_modules`` of its own, which reads a flag (as a wrapper that hides or
    renames what it wraps may): what it yields changes while the module tree does not."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.renamed = False

    def named_modules(self, *args, **kwargs):
        for name, module in super().named_modules(*args, **kwargs):
            yield ("core" if self.renamed and name == "body" else name), module

    def forward(self, x):
        return self.body(x)


def _first_renamed(self, *args, **kwargs):
    for name, module in nn.Module.named_modules(self, *args, **kwargs):
        yield ("first" if name == "0" else name), module


def _addresses(log) -> list:
    return [(call.address, op.params) for call in log.module_calls for op in call.ops]


@pytest.mark.parametrize("compiled", PATHS)
def test_a_model_naming_its_own_modules_is_named_as_it_names_them_now_on_every_trace(compiled):
    # The cached index kept the names of the first walk: the second trace named body what the model now calls core.
    model, fresh, x = _NamesItsOwnModules(), _NamesItsOwnModules(), torch.randn(1, 2)
    fresh.renamed = True
    with on_path(compiled):
        assert _addresses(tl.trace(model, x)) == [("body", ("body.weight", "body.bias"))]
        model.renamed = True
        renamed = [("core", ("core.weight", "core.bias"))]
        assert _addresses(tl.trace(model, x)) == _addresses(tl.trace(fresh, x)) == renamed
        plain = nn.Sequential(nn.Linear(2, 2))
        assert _addresses(tl.trace(plain, x)) == [("0", ("0.weight", "0.bias"))]
        plain.named_modules = types.MethodType(_first_renamed, plain)  # set on the model itself, after a trace
        assert _addresses(tl.trace(plain, x)) == [("first", ("first.weight", "first.bias"))]


@pytest.mark.parametrize("compiled", PATHS)
def test_parameters_a_lazy_module_never_initialized_are_listed_without_a_shape_and_not_counted(compiled, tmp_path):
    # log.params, log.summary() and params.to_pandas() raised torch's "Can't access the shape of an uninitialized
    # parameter".
    with on_path(compiled):
        log = tl.trace(_WithAnUncalledLazyHead(), torch.randn(2, 4))
    log.save(tmp_path / "trace")
    for trace in (log, tl.load(tmp_path / "trace")):
        assert [(p.address, p.shape, p.numel) for p in trace.params] == [
            ("fc.weight", (3, 4), 12), ("fc.bias", (3,), 3), ("head.weight", None, None), ("head.bias", None, None)]
        frame = trace.params.to_pandas()
        assert frame["shape"].tolist() == [(3, 4), (3,), None, None]
        assert frame["numel"].tolist()[:2] == [12, 3] and frame["numel"].isna().tolist() == [False, False, True, True]
        assert str(frame["numel"].dtype) == "Int64"  # whole counts, and a missing one, not 12.0 and NaN
        summary = trace.summary()
        assert summary.rows[0]["params"] == 15
        assert ("Parameters: 15 (each parameter counted once, tied weights included); not counted: 2 uninitialized "
                "parameters of lazy modules the forward never called, with no shape yet (head.weight, head.bias)"
                in str(summary))
