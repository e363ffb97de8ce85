"""The record model: indexing, summaries, tables, cleanup, and the save policy."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.labels.naming import type_of_name
from zoo import SmallCNN, SharedModule, zoo


@pytest.fixture
def cnn_log():
    torch.manual_seed(0)
    return tl.trace(SmallCNN().eval(), torch.randn(2, 3, 8, 8))


@pytest.mark.parametrize("raw, expected", [
    ("max_pool2d", "maxpool2d"), ("__getitem__", "getitem"), ("__setitem__", "setitem"), ("relu_", "relu"),
    ("__iadd__", "iadd"), ("lstm_cell", "lstmcell"), ("scaled_dot_product_attention", "scaleddotproductattention"),
    ("T", "t"), ("__matmul__", "matmul"), ("__radd__", "add"), ("__rmul__", "mul"), ("__rsub__", "rsub"),
])
def test_type_names_follow_the_label_grammar(raw, expected):
    assert type_of_name(raw) == expected


def test_an_operator_overload_called_directly_has_its_operators_type():
    overloads = [torch.ops.aten.add.Tensor, torch.ops.aten.relu.default]

    def forward(x):
        return overloads[1](overloads[0](x, x))

    log = tl.trace(forward, torch.randn(3), save=["add", "relu"])
    ops = [op for op in log if op.kind == "op"]
    assert [op.func_name for op in ops] == [f.__name__ for f in overloads]
    assert [op.type for op in ops] == [f.overloadpacket.__name__ for f in overloads]
    assert all("." not in op.label for op in log)  # a dot would read as a module address
    assert all(op.has_activation for op in ops)  # found by their operator's name


def test_an_in_place_operator_overload_called_directly_keeps_what_it_overwrites():
    def forward(x):
        y = x * 2
        torch.ops.aten.add_.Tensor(y, x)  # writes y
        return y + 1

    x = torch.randn(3)
    y = x * 2
    before = y._version
    torch.ops.aten.add_.Tensor(y, x)
    assert y._version != before  # it writes its first argument
    log = tl.trace(forward, x)
    assert torch.equal(log["mul_1_1:1"].activation, x * 2)  # copied before the write, not dropped
    assert log["add_1_2:1"].is_inplace


def test_indexing_by_every_kind_of_key(cnn_log):
    log = cnn_log
    assert log[0].label == "input_1:1" and log[-1].label == "output_1:1"
    assert [op.label for op in log[1:3]] == ["conv2d_1_1:1", "buffer_1:1"]
    assert isinstance(log["conv2d_1_1"], tl.Layer)
    assert isinstance(log["conv2d_1_1:1"], tl.Op)
    assert log["features.4.0:1"].label == log["features.4.0"].label == "conv2d_2_5:1"
    assert log["features"].label == "relu_2_6:1"  # a container's output op
    assert log["input.x"].label == "input_1:1"
    assert len(log) == len(log.ops) and list(log)[1] == log.ops[1]
    assert "conv2d_1_1:1" in log and "nope" not in log


def test_module_names_win_over_io_paths_and_every_module_call_is_found():
    class Stat(nn.Module):
        def forward(self, x):
            self.last = x.mean()  # returns no tensor

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stat, self.output, self.scale = Stat(), nn.Linear(4, 3), nn.Linear(3, 3)

        def forward(self, x):
            self.stat(x)
            return self.scale(self.output(x)).tanh()

    model = Net()
    seen: dict = {}  # address -> every output its forward returned, by plain forward hooks
    for address, module in model.named_modules():
        module.register_forward_hook(lambda m, a, out, address=address: seen.setdefault(address, []).append(out))
    log = tl.trace(model, torch.randn(2, 4))
    # The module named "output" is found by its name, not confused with the model's output.
    assert torch.equal(log["output"].activation, seen["output"][0])
    assert torch.equal(log["output:1"].activation, seen["output"][0])
    assert torch.equal(log.outputs[0].activation, seen[""][0])
    # A module call that returned no tensor is still found by its label.
    assert seen["stat"] == [None]
    call = log["stat:1"]
    assert isinstance(call, tl.ModuleCall) and call.label == "stat:1" and call.address == "stat"


@pytest.mark.parametrize("records", ["ops", "layers", "module_calls", "modules", "params", "buffers"])
def test_a_record_list_indexed_by_name_says_how_to_find_it(cnn_log, records):
    listed = getattr(cnn_log, records)
    assert listed[0] == list(listed)[0]
    with pytest.raises(TypeError, match=r"by position .* log\['features'\] finds"):
        listed["features"]


def test_unknown_key_suggests_close_labels(cnn_log):
    with pytest.raises(KeyError, match="conv2d_1_1"):
        cnn_log["conv2d_1_11"]
    with pytest.raises(TypeError):
        cnn_log[1.5]


def test_module_records(cnn_log):
    calls = {c.label: c for c in cnn_log.module_calls}
    inner = calls["features.4.0:1"]
    assert inner.parent.label == "features.4:1" and inner.parent.parent.label == "features:1"
    assert inner.depth == 2 and inner.module.class_name == "Conv2d"
    assert inner.input_ops == ["maxpool2d_1_4:1"] and inner.output_ops == ["conv2d_2_5:1"]
    assert calls["features:1"].op_labels[0] == "conv2d_1_1:1" and calls["features:1"].duration > 0
    assert cnn_log["conv2d_2_5:1"].modules == ("features:1", "features.4:1", "features.4.0:1")
    module = next(m for m in cnn_log.modules if m.address == "fc")
    assert module.param_names == ["weight", "bias"] and module.call_labels == ["fc:1"]


def test_a_layer_answers_a_field_of_its_passes_only_when_they_agree():
    """A field a layer reads from its passes is never the first pass's answer standing for the others."""
    model = SharedModule().eval()
    log = tl.trace(model, torch.randn(2, 8), intervene={"fc:2": tl.zero_ablate()})
    fc = log["fc:1"].layer
    assert fc.num_passes == 3 and fc.shape == (2, 8) and fc.dtype == torch.float32
    assert fc.module_address == "fc"  # was refused as differing per pass: every pass of a layer ran in one module
    with pytest.raises(AttributeError, match="use log"):
        fc.intervention  # one pass was edited: the first pass's None would say none was
    with pytest.raises(AttributeError, match="use log"):
        fc.call
    assert log["fc:2"].intervention is not None and log["fc:1"].intervention is None

    # A shared module given inputs of two lengths: its layer has no one shape.
    def two_lengths(x):
        return model.fc(x).sum() + model.fc(x[:1]).sum()

    log = tl.trace(two_lengths, torch.randn(2, 8), root=model)
    fc = log["fc:1"].layer
    assert [op.shape for op in fc.ops] == [(2, 8), (1, 8)]
    with pytest.raises(AttributeError, match=r"'shape' differs between its passes .*fc|linear"):
        fc.shape
    with pytest.raises(AttributeError, match="numel"):
        fc.numel
    assert fc.dtype == torch.float32 and fc.func_name == "linear"


def test_aliased_module_keeps_first_address_and_counts_calls_per_object():
    class Alias(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = self.b = nn.Linear(3, 3)

        def forward(self, x):
            return self.b(self.a(x))

    model = Alias()
    log = tl.trace(model, torch.randn(1, 3))
    assert [c.label for c in log.module_calls] == ["a:1", "a:2"]
    assert log["a"].all_addresses == ["a", "b"] and isinstance(log["b"], tl.Module)
    for kept in [tl.trace(model, torch.randn(1, 3), save=["b"]) for _ in range(2)]:  # the second: cached index
        assert [op.label for op in kept if op.activation is not None] == ["linear_1_1:1", "linear_1_1:2", "output_1:1"]


def test_summary_is_bounded_and_informative():
    log = tl.trace(zoo()["loop_rnn"][0], zoo()["loop_rnn"][1])
    text = str(log)
    assert "Trace of LoopRNN" in text and "67 ops" in text and "recurrent (up to 16 passes" in text
    assert "more ops" in text and len(text.splitlines()) < 50
    assert repr(log).startswith("<Trace of LoopRNN")


def test_tables(cnn_log):
    frame = cnn_log.to_pandas()
    assert list(frame["label"]) == [op.label for op in cnn_log]
    assert {"layer_label", "pass_index", "module", "duration", "source_line", "parents"} <= set(frame.columns)
    assert len(cnn_log.layers.to_pandas()) == len(cnn_log.layers)
    calls = cnn_log.module_calls.to_pandas()
    assert list(calls["label"])[:2] == ["features:1", "features.0:1"]
    assert "num_calls" in cnn_log.modules.to_pandas().columns


def test_cleanup_releases_activations_model_and_output(cnn_log):
    log = cnn_log
    label = log[1].label
    log.cleanup()
    log.cleanup()  # idempotent
    assert log.is_cleaned_up and log[1].label == label and log[1].shape == (2, 8, 8, 8)
    with pytest.raises(tl.ActivationUnavailable, match="cleaned up"):
        log[1].activation
    with pytest.raises(tl.TraceCleanedUp):
        log.output
    assert "released by cleanup()" in str(log)
    assert all(m._ref is None for m in log.modules)


def test_cleanup_drops_every_reference_to_model_tensors():
    import gc
    import weakref

    model = SharedModule().eval()
    x = torch.randn(2, 8)
    log = tl.trace(model, x)
    weight = weakref.ref(model.fc.weight)
    activation = weakref.ref(log[2].activation)
    log.cleanup()
    del model
    gc.collect()
    assert weight() is None and activation() is None


def test_save_none_keeps_metadata_only():
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, save="none")
    assert not log._activations and log[1].activation is None and log[1].shape == (4, 16)


@pytest.mark.parametrize("selection, expected", [
    (["relu"], {"relu_1_2:1", "relu_1_2:2", "relu_1_2:3"}),
    (["layers.1"], {"linear_2_3:1"}),
    (["linear_3_4"], {"linear_3_4:1"}),
    (["relu_1_2:2", "head"], {"relu_1_2:2", "linear_4_5:1", "output_1:1"}),  # the output shows head's tensor
])
def test_save_selection(selection, expected):
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, save=selection)
    assert {op.label for op in log if op.has_activation} == expected


def test_save_predicate_and_bad_save_values():
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, save=lambda op: op.type == "linear" and op.pass_index == 1)
    assert {op.label for op in log if op.has_activation} == {"linear_1_1:1", "linear_2_3:1", "linear_3_4:1",
                                                             "linear_4_5:1", "output_1:1"}
    with pytest.raises(TypeError, match="save=3 is an int, which is not understood"):  # was a ValueError
        tl.trace(model, args, save=3)
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        tl.trace(model, args, kwargs=[1])
    with pytest.raises(TypeError, match="callable"):
        tl.trace(42, args)


def test_saved_activations_are_detached_references():
    model = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    log = tl.trace(model, x)
    act = log[1].activation
    assert not act.requires_grad and torch.equal(act, log.output.detach())
    assert act.untyped_storage().data_ptr() == log.output.untyped_storage().data_ptr()  # no copy


def test_save_device_moves_activations_as_captured(monkeypatch):
    # A CPU machine has nowhere else to move to: the move is checked to the meta device, which tl.trace refuses
    # as a save_device (its tensors hold no values), with that check set aside.
    monkeypatch.setattr("torchlens.capture.session._checked_save_device", torch.device)
    log = tl.trace(nn.Linear(3, 3), torch.randn(2, 3), save_device="meta")
    assert log[1].activation.device.type == "meta" and log[1].device.type == "cpu"


def test_record_finite_flags_without_saving():
    def f(x):
        y = torch.log(x)  # log of a negative -> nan
        return y * 0 + torch.exp(x * 1000)

    log = tl.trace(f, torch.tensor([-1.0, 1.0]), save="none", record_finite=True)
    assert log["log_1_1:1"].finite == (True, False)
    assert log["exp_1_4:1"].finite == (False, True)
    assert log["mul_2_3:1"].finite == (False, False)


def test_max_saved_bytes_stops_saving_with_a_warning():
    def f(x):
        for _ in range(5):
            x = x * 2
        return x

    with pytest.warns(UserWarning, match="max_saved_bytes"):
        log = tl.trace(f, torch.ones(256), max_saved_bytes=3 * 1024)
    saved = [op.label for op in log if op.has_activation]
    assert saved == ["input_1:1", "mul_1_1:1", "mul_2_2:1"]
    assert "saving stopped at" in str(log)


def test_write_through_data_is_captured_and_the_saved_value_kept():
    def f(x):
        y = x * 2
        y.data.add_(1)  # `.data` is an op, and its in-place write triggers copy-on-write
        return y

    log = tl.trace(f, torch.ones(2))
    assert torch.equal(log["mul_1_1:1"].activation, torch.full((2,), 2.0))
    assert torch.equal(log.output, torch.full((2,), 3.0))
    assert log["output_1:1"].parents == ["add_1_3:1"]  # y was last written through y.data

    def g(x):
        y = x * 2
        y.data.mul_(3)
        return y + 1

    log = tl.trace(g, torch.ones(2))
    assert log["add_1_4:1"].parents == ["mul_2_3:1"]
    result = log.validate()
    assert not result.mismatched, result.mismatched


def test_mutation_capture_cannot_see_is_flagged_never_kept():
    def f(x):
        y = x * 2
        with torch._C.DisableTorchFunction():  # a write that bypasses interposition entirely
            y.add_(1)
        return y.sum()

    with pytest.warns(UserWarning, match="dropped saved activations.*mul_1_1:1"):
        log = tl.trace(f, torch.ones(2))
    with pytest.raises(tl.ActivationUnavailable, match="dropped"):
        log["mul_1_1:1"].activation
    assert log["mul_1_1:1"].shape == (2,)
    assert "dropped" in str(log)


def test_an_unseen_mutation_is_flagged_beside_saved_values_without_a_version():
    with torch.inference_mode():
        frozen = torch.ones(2)  # an inference tensor: saved with no version to compare

    def f(x, w):
        y = x * 2
        with torch._C.DisableTorchFunction():  # a write that bypasses interposition entirely
            y.add_(1)
        return (y * w).sum()

    with pytest.warns(UserWarning, match="dropped saved activations.*mul_1_1:1"):
        log = tl.trace(f, (torch.ones(2), frozen))
    assert set(log.dropped_activations) == {log["mul_1_1:1"].index}
    assert torch.equal(log["input.w"].activation, frozen)


def test_tensor_from_outside_the_trace_is_counted_as_unattributed():
    outside = torch.randn(3)

    def f(x):
        return x + outside

    log = tl.trace(f, torch.randn(3))
    assert log.unattributed == 1 and log["add_1_1:1"].unattributed_args == 1
    assert "outside the trace" in str(log)


def test_a_list_is_one_positional_argument_with_one_input_per_tensor():
    def f(xs):
        return torch.stack(xs).sum(0)

    log = tl.trace(f, [torch.ones(2), torch.ones(2)])
    assert [op.io_path for op in log.inputs] == ["input.xs.0", "input.xs.1"]
    assert log["stack_1_1:1"].parent_arg_positions == {(0, 0): "input_1:1", (0, 1): "input_2:1"}


def test_params_and_buffers_records():
    model, args, _ = zoo()["batchnorm_train"]
    log = tl.trace(model, args)
    params = {p.address: p for p in log.params}
    assert set(params) == {"conv.weight", "conv.bias", "bn.weight", "bn.bias"}
    assert params["conv.weight"].op_labels == ["conv2d_1_1:1"] and params["conv.weight"].shape == (4, 3, 3, 3)
    assert params["bn.weight"].module_address == "bn" and params["conv.bias"].numel == 4
    buffers = {b.address: b for b in log.buffers}
    assert buffers["bn.running_mean"].readers == ["batchnorm_1_3:1"]
    assert buffers["scale"].op_labels == ["buffer_4:1"]
    assert len(log.params.to_pandas()) == 4 and len(log.buffers.to_pandas()) == 4

    shared = tl.trace(SharedModule().eval(), torch.randn(2, 8))
    weight = next(p for p in shared.params if p.address == "fc.weight")
    assert weight.op_labels == ["linear_1_1:1", "linear_1_1:2", "linear_1_1:3"]


class _SquaresItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.addmm(x @ self.w, self.w, self.w)  # one op passing the parameter twice


def test_a_parameter_passed_twice_to_one_op_lists_that_op_once(tmp_path):
    log = tl.trace(_SquaresItsWeight(), torch.randn(4, 4))
    addmm = next(op for op in log if op.type == "addmm")
    assert addmm.params == ("w", "w")  # each argument position that holds it
    (weight,) = log.params
    users = [op.label for op in log if "w" in op.params]
    assert weight.op_labels == users == ["matmul_1_1:1", "addmm_1_2:1"] and "used by 2 ops" in repr(weight)
    log.save(tmp_path / "t.tl")
    assert tl.load(tmp_path / "t.tl").params[0].op_labels == users


def test_save_a_module_call_label_keeps_that_calls_output():
    log = tl.trace(SharedModule().eval(), torch.randn(2, 8), save=["fc:2"])
    assert [op.label for op in log if op.has_activation] == ["linear_1_1:2"]


def test_output_keeps_its_tensor_when_its_producer_is_saved():
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, save=["head"])
    assert [op.label for op in log if op.has_activation] == ["linear_4_5:1", "output_1:1"]
    assert torch.equal(log["output_1:1"].activation, log.output.detach())
    assert not tl.trace(model, args, save=["relu"])["output_1:1"].has_activation



def test_saving_the_output_type_keeps_the_output():
    # An output node shows its producer's tensor, which a selection by type decided during the forward
    # would never hold: save=["output"] must still keep the output, as save=["input"] keeps the input.
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, save=["output"])
    assert [op.label for op in log if op.has_activation] == ["output_1:1"]
    with torch.no_grad():
        assert torch.equal(log["output_1:1"].activation, model(*args))


class _ReturnsItsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc.weight, -x


def test_an_output_no_op_made_shows_its_tensor_when_everything_is_saved():
    model, x = _ReturnsItsWeight(), torch.randn(3, 4)
    log = tl.trace(model, x)
    weight = log["output_1:1"]
    assert weight.parents == [] and weight.has_activation
    assert torch.equal(weight.activation, model.fc.weight.detach())
    assert not tl.trace(model, x, save=["neg"])["output_1:1"].has_activation  # no op of it was chosen


class _PassesThrough(nn.Module):
    """Modules whose output an op outside them made: an ``nn.Identity``, and one returning a tensor it kept."""

    def __init__(self):
        super().__init__()
        self.fc, self.ident, self.head = nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 4)

    def forward(self, x):
        h = self.ident(self.fc(x))
        return self.head(h).relu()


@pytest.mark.parametrize("entry", ["ident", "ident:1"])
def test_saving_a_module_whose_output_an_op_outside_it_made_keeps_that_output(entry):
    model, x = _PassesThrough().eval(), torch.randn(2, 4)
    seen = []
    handle = model.ident.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    try:
        log = tl.trace(model, x, save=[entry])
    finally:
        handle.remove()
    call = next(c for c in log.module_calls if c.address == "ident")
    (produced,) = call.output_ops  # nn.Identity mints no op: the output is fc's
    assert produced == "linear_1_1:1"
    assert [op.label for op in log if op.has_activation] == [produced]
    assert torch.equal(log[entry].activation, seen[0])


@pytest.mark.parametrize("option", ["save", "grads"])
@pytest.mark.parametrize("entry", ["head", "head:1", "head.inner"])
def test_a_selection_naming_a_torchscript_module_is_refused_naming_why(option, entry):
    """A TorchScript module's ops run unseen, so no op makes its output: selecting it would keep nothing."""
    model, x = _PassesThrough().eval(), torch.randn(2, 4, requires_grad=True)
    model.head = torch.jit.script(nn.Sequential(OrderedDict(inner=nn.Linear(4, 4))))
    with pytest.raises(ValueError, match=f"{option}= entry '{entry}' is (a|inside 'head', a) TorchScript module.*"
                                         "before scripting"):
        tl.trace(model, x, **{option: [entry, "ident"]})
    log = tl.trace(model, x, **{option: ["ident"]})  # the rest of the model is still selectable
    if option == "save":
        assert [op.label for op in log if op.has_activation] == ["linear_1_1:1"]
    else:
        log.output.sum().backward()
        assert log["linear_1_1:1"].grad is not None


class _NamedLikeLabels(nn.Module):
    """Modules named like labels: ``linear_1_1`` is not the first linear to run, ``relu_1_2`` is the op it names."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleDict({"first": nn.Linear(4, 4), "relu_1_2": nn.ReLU()})
        self.linear_1_1 = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear_1_1(self.heads["relu_1_2"](self.heads["first"](x)))


def test_a_module_named_like_a_label_of_other_ops_is_refused_not_confused(tmp_path):
    model, x = _NamedLikeLabels(), torch.randn(2, 4)
    seen = {}  # what each module returned, by plain forward hooks on an untraced forward
    handles = [model.get_submodule(address).register_forward_hook(
        lambda m, a, out, address=address: seen.update({address: out.detach()}))
        for address in ("heads.first", "linear_1_1")]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    log = tl.trace(model, x)
    assert torch.equal(log.layers_by_label["linear_1_1"].ops[0].activation, seen["heads.first"])
    (made,) = next(c for c in log.module_calls if c.address == "linear_1_1").output_ops
    for key in ("linear_1_1", "linear_1_1:1"):  # the layer and op of heads.first, and the module linear_1_1
        assert key in log
        with pytest.raises(tl.errors.AmbiguousKey, match=rf"names two things .* log\['{made}'\]"):
            log[key]
        with pytest.raises(tl.errors.AmbiguousKey, match=f"save= entry '{key}' names two things"):
            tl.trace(model, x, save=[key])
    assert torch.equal(log[made].activation, seen["linear_1_1"])
    # The labels the trace hands out still read where it reads them itself (the notebook view's module calls).
    assert made in log._repr_html_()
    # Where both readings name the same op, the key answers: the ReLU module relu_1_2 made the op relu_1_2:1.
    assert log["heads.relu_1_2"].label == log["relu_1_2:1"].label == "relu_1_2:1"
    log.save(tmp_path / "t.tl")
    with pytest.raises(tl.errors.AmbiguousKey):
        tl.load(tmp_path / "t.tl")["linear_1_1"]


class _RootReLU(nn.Module):
    """A root-level ``self.relu`` beside relu ops of other modules (as in torchvision's ResNet)."""

    def __init__(self):
        super().__init__()
        self.stem, self.relu, self.block = nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x):
        return torch.relu(self.block(self.relu(self.stem(x))))


def test_a_module_named_like_an_op_type_is_refused_where_that_type_has_other_ops(tmp_path):
    model, x = _RootReLU(), torch.randn(2, 4)
    relus = [op.label for op in tl.trace(model, x) if op.type == "relu"]
    assert len(relus) == 3
    with pytest.raises(tl.errors.AmbiguousKey, match=r"save= entry 'relu' names two things .* \(3 ops"):
        tl.trace(model, x, save=["relu"])
    by_type = tl.trace(model, x, save=lambda op: op.type == "relu")
    assert [op.label for op in by_type if op.has_activation] == relus + ["output_1:1"]  # it shows the last relu
    # The module alone, by its call label; and in tl.extract, whose layers= take no op types, by its address.
    assert [op.label for op in tl.trace(model, x, save=["relu:1"]) if op.has_activation] == relus[:1]
    tl.extract(model, [x], ["relu"], str(tmp_path / "out"), progress=False)
    with torch.no_grad():
        expected = model.relu(model.stem(x))
    assert torch.equal(torch.as_tensor(tl.load_extracted(str(tmp_path / "out"))["relu"].copy()), expected)
    # A module that makes every op of its type's name is no second reading: nn.Sequential(..., nn.ReLU()) named relu.
    only = nn.Sequential()
    only.add_module("fc", nn.Linear(4, 4))
    only.add_module("relu", nn.ReLU())
    assert [op.label for op in tl.trace(only, x, save=["relu"]) if op.has_activation] == ["relu_1_2:1", "output_1:1"]


def test_a_module_named_like_a_label_that_never_ran_is_not_said_to_be_missing():
    model, x = _NamedLikeLabels(), torch.randn(2, 4)
    model.forward = lambda x: model.heads["first"](x)  # linear_1_1, the module, never runs; the layer is there
    assert "linear_1_1" in tl.trace(model, x)
    for entry, field in (("linear_1_1", "layer_label"), ("linear_1_1:1", "label")):
        with pytest.raises(tl.errors.AmbiguousKey, match=rf"module linear_1_1 .* never ran .* op.{field} =="):
            tl.trace(model, x, save=[entry])


def test_a_module_inside_a_compiled_submodule_is_selected_by_the_address_the_trace_gives_it():
    model, x = _PassesThrough().eval(), torch.randn(2, 4)
    model.head = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.GELU()), backend="eager")
    with pytest.warns(UserWarning):
        log = tl.trace(model, x, save=["head.0"], compiled="eager")
    (call,) = [c for c in log.module_calls if c.address == "head.0"]  # not head._orig_mod.0
    assert [op.label for op in log if op.has_activation] == call.output_ops
    with torch.no_grad():
        assert torch.equal(log[call.label].activation, model.head._orig_mod[0](model.fc(x)))


def test_saving_many_modules_tests_each_op_against_their_outputs_once(monkeypatch):
    # Whether an op was a selected module call's output was asked of every selected call in turn, for every
    # op: save= naming n modules was n * n work (2,000 module addresses: 8.3 s, 10x the 500 ones).  The
    # selected calls' outputs are now gathered once.
    from zoo import MLP
    from torchlens.record.modules import ModuleCall

    model, x = MLP(width=8, depth=60), torch.randn(3, 8)
    addresses = [f"layers.{i}" for i in range(60)] + ["head:1"]
    reads = []
    real_outputs = ModuleCall._output_nodes
    monkeypatch.setattr(ModuleCall, "_output_nodes",
                        property(lambda call: reads.append(1) or real_outputs.fget(call)))
    log = tl.trace(model, x, save=addresses)
    assert len(reads) <= 2 * len(log.module_calls)
    monkeypatch.undo()
    saved = {op.label for op in log if op.has_activation}
    assert saved == {log[address].label for address in addresses} | {"output_1:1"}
