"""Gradients kept beyond the trace: saved and loaded with it (statistics, parameters, what no file can
hold), and streamed by ``tl.extract`` beside the activations."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl
from torchlens.record.errors import GradientUnavailable
from test_grads_tools import SqrtOfParameter
from test_io_damaged import edit_json, rehash
from zoo import zoo


def _assert_same_gradients(loaded, log, model) -> None:
    """``loaded`` holds the gradients of ``log``, a zoo MLP's trace after one backward, as the live trace has them."""
    assert loaded.num_backwards == 1
    for op in log:
        if op.has_grad:
            assert torch.equal(loaded[op.label].grad, op.grad), op.label
    assert torch.equal(loaded._param_grads["head.weight"], model.head.weight.grad)
    assert loaded.saved_for_backward_bytes == log.saved_for_backward_bytes


def test_save_and_load_keep_gradients(tmp_path):
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, grads=True, saved_for_backward=True)
    log.backward(log.output.sum())
    log.save(tmp_path / "t")
    loaded = tl.load(tmp_path / "t")
    _assert_same_gradients(loaded, log, model)
    assert loaded["linear_1_1:1"].saved_for_backward_bytes == log["linear_1_1:1"].saved_for_backward_bytes
    frame, original = loaded.to_pandas(), log.to_pandas()
    assert frame["grad_norm"].equals(original["grad_norm"])
    manifest = (tmp_path / "t" / "manifest.json").read_text()
    assert "gradients.safetensors" in manifest
    # Statistics survive a save after cleanup(); non-finite values round-trip through JSON.
    bad = tl.trace(model, args, grads=True)
    bad.backward(torch.sqrt(bad.output - 1e6).sum())
    bad.cleanup()
    bad.save(tmp_path / "c")
    reread = tl.load(tmp_path / "c").to_pandas().set_index("label")
    assert reread["grad_nonfinite"].equals(bad.to_pandas().set_index("label")["grad_nonfinite"])
    assert reread["grad_norm"].isna().any()
    plain = tl.trace(model, args)
    plain.save(tmp_path / "p")
    assert tl.load(tmp_path / "p")._gradcap is None
    packed_only = tl.trace(model, args, saved_for_backward=True)
    packed_only.save(tmp_path / "s")
    reread = tl.load(tmp_path / "s")
    assert reread._gradcap is None and reread.saved_for_backward_bytes == packed_only.saved_for_backward_bytes


def _as_first_gradients_layout(grads: dict) -> None:
    """A ``grads`` record as the first torchlens to save gradients wrote it: what autograd packed for backward
    beside the gradients (``pack_note``, ``packed``), and none of the later fields."""
    packing = grads.pop("saved_for_backward")
    grads.update(pack_note=packing["note"], packed=packing["packed"])
    for later in ("not_saved", "param_grads", "strides"):
        del grads[later]


def test_a_trace_saved_with_the_first_gradients_layout_loads_its_gradients(tmp_path):
    # Such a file was refused as "malformed (KeyError: 'saved_for_backward'); the file was edited or written by
    # other software", though torchlens wrote it, under the same schema version.
    model, args, _ = zoo()["mlp"]
    log = tl.trace(model, args, grads=True, saved_for_backward=True)  # the first files always accounted packing
    log.backward(log.output.sum())
    folder = log.save(tmp_path / "t")
    edit_json(folder, "trace.json", lambda record: _as_first_gradients_layout(record["grads"]))
    rehash(folder)
    loaded = tl.load(folder)
    _assert_same_gradients(loaded, log, model)
    assert loaded.to_pandas()["grad_norm"].equals(log.to_pandas()["grad_norm"])


def test_nonfinite_origin_of_a_trace_whose_file_has_no_parameter_table_reads_the_parameter_grads_it_saved(tmp_path):
    # Such a trace has no Param records, so the .grad its file holds went unread: the report found nothing, and said
    # that every gradient the trace received was finite, and so was every parameter's .grad.
    torch.manual_seed(0)
    log = tl.trace(SqrtOfParameter(), torch.randn(3, 4), grads=True)
    log.backward(log.output.sum())
    folder = log.save(tmp_path / "t")
    edit_json(folder, "trace.json", lambda record: [record.pop(key) for key in ("params", "module_param_counts")])
    rehash(folder)
    report = tl.debug.nonfinite_origin(tl.load(folder), grads=True)
    assert report.found and report.parameters == ("scale",) and report.kind == "nan"
    assert "every gradient the trace received is finite" not in str(report)


def test_gradient_statistics_do_not_depend_on_the_gradient_s_memory_layout(tmp_path):
    # fc's output gradient arrives through the transpose, transposed back: a non-contiguous tensor, which a
    # saved trace stores in row order and reloads laid out as it was.  The statistics must be those of the
    # values alone.
    class Transposes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(37, 53)

        def forward(self, x):
            h = self.fc(x)
            return (h.transpose(0, 1) * torch.linspace(0.1, 3.0, h.shape[0])).sum()

    torch.manual_seed(0)
    log = tl.trace(Transposes(), torch.randn(61, 37), grads=True)
    log.backward(log.output)
    grad = log["fc"].grad
    assert not grad.is_contiguous()
    log.save(tmp_path / "t")
    loaded = tl.load(tmp_path / "t")
    assert torch.equal(loaded["fc"].grad, grad) and loaded["fc"].grad.stride() == grad.stride()
    columns = ["grad_norm", "grad_min", "grad_max", "grad_nonfinite"]
    assert loaded.to_pandas()[columns].equals(log.to_pandas()[columns])
    row = log.to_pandas().set_index("label").loc[log["fc"].label]
    assert row.grad_norm == float(torch.linalg.vector_norm(grad.contiguous()))


def _layout(t) -> tuple:
    """The strides that place ``t``'s elements (a dimension of one element has any stride)."""
    return tuple(stride for size, stride in zip(t.shape, t.stride()) if size > 1)


def test_channels_last_gradients_load_laid_out_as_they_were(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 2, 1))
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log = tl.trace(model, x, grads=True)
    log.backward(log.output.float().square().sum())
    assert log["0"].grad.is_contiguous(memory_format=torch.channels_last) and model[0].weight.grad.dtype == \
        torch.float32
    loaded = tl.load(log.save(tmp_path / "t"))
    for op in log:
        if op.has_grad:
            kept, live = loaded[op.label].grad, op.grad
            assert kept.dtype == live.dtype and _layout(kept) == _layout(live) and torch.equal(kept, live), op.label
    for name, p in model.named_parameters():
        assert _layout(loaded._param_grads[name]) == _layout(p.grad), name


def test_extract_streams_gradients_beside_activations(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,))) for _ in range(3)]

    def loss_fn(output, batch):
        return F.cross_entropy(output, batch[1], reduction="sum")

    with pytest.raises(ValueError, match="loss_fn"):
        tl.extract(model, batches, ["0"], tmp_path / "x", grads=True, progress=False)
    # A loss of several numbers failed in autograd: "grad can be implicitly created only for scalar outputs".
    with pytest.raises(ValueError, match=r"batch 0: loss_fn returned a tensor of shape \(5, 3\); it must return one "
                                         r"number to backpropagate from \(reduce it: \.sum\(\) or \.mean\(\)\)"):
        tl.extract(model, batches, ["0"], tmp_path / "x", args_of=lambda b: b[0], grads=True,
                   loss_fn=lambda output, batch: output, progress=False)
    assert all(p.grad is None for p in model.parameters())
    out = tl.extract(model, batches, ["0", "2"], tmp_path / "e", args_of=lambda b: b[0], grads=True,
                     loss_fn=loss_fn, progress=False)
    arrays = tl.load_extracted(out, as_torch=True)
    assert set(arrays) == {"0", "2", "grad:0", "grad:2"}
    expected_acts, expected_grads = [], []
    for x, y in batches:
        hidden = model[0](x)
        hidden.retain_grad()
        logits = model[2](model[1](hidden))
        logits.retain_grad()
        F.cross_entropy(logits, y, reduction="sum").backward()
        expected_acts.append(hidden.detach())
        expected_grads.append((hidden.grad, logits.grad))
    assert torch.equal(arrays["0"], torch.cat(expected_acts))
    assert torch.equal(arrays["grad:0"], torch.cat([g for g, _ in expected_grads]))
    assert torch.equal(arrays["grad:2"], torch.cat([g for _, g in expected_grads]))
    model.zero_grad(set_to_none=True)
    tl.extract(model, batches, ["2"], tmp_path / "f", args_of=lambda b: b[0], grads=True, loss_fn=loss_fn,
               progress=False)
    assert all(p.grad is None for p in model.parameters())  # extraction leaves the model as it was
    held = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), held):
        p.grad = g
    tl.extract(model, batches, ["2"], tmp_path / "g", args_of=lambda b: b[0], grads=True, loss_fn=loss_fn,
               progress=False)
    for p, g in zip(model.parameters(), held):  # the same tensors, their values untouched
        assert p.grad is g and bool((g == 7.0).all())


@pytest.mark.parametrize("how", ["bound method", "partial", "lambda with root", "lambda"])
def test_extract_gradients_leave_the_grad_of_a_callable_s_model_untouched(tmp_path, how):
    import functools

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    batches = [torch.randn(5, 4) for _ in range(2)]
    run, extra = {"bound method": (model.forward, {}), "partial": (functools.partial(model), {}),
                  "lambda with root": (lambda x: model(x), {"root": model}),
                  "lambda": (lambda x: model(x), {})}[how]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a lambda without root= names no model to checksum
        out = tl.extract(run, batches, ["linear_1_1", "linear_2_3"], tmp_path / "e", grads=True,
                         loss_fn=lambda output, batch: output.pow(2).sum(), progress=False, **extra)
    assert all(p.grad is None for p in model.parameters())  # each batch's backward was set aside
    hidden_grads = []
    for x in batches:  # the same gradients, by hand
        hidden = model[0](x)
        hidden.retain_grad()
        model[2](model[1](hidden)).pow(2).sum().backward()
        hidden_grads.append(hidden.grad)
    assert torch.equal(tl.load_extracted(out, as_torch=True)["grad:linear_1_1"], torch.cat(hidden_grads))


def test_extract_gradients_leave_the_grad_of_every_leaf_the_loss_reaches_untouched(tmp_path):
    # Besides the parameters, a backward writes .grad into any leaf that requires grad: a learnt steering
    # vector the forward reads, an input that requires grad.  An optimizer holding them would step on the
    # extraction's gradients.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    steer = torch.zeros(4, requires_grad=True)
    steer.grad = held = torch.full((4,), 7.0)
    batches = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
    run = lambda x: model(x + steer)  # noqa: E731
    label = next(op.layer_label for op in tl.trace(run, batches[0], root=model).ops if op.func_name == "linear")
    tl.extract(run, batches, [label], tmp_path / "e", grads=True, loss_fn=lambda o, b: o.sum(), root=model,
               progress=False)
    assert steer.grad is held and bool((held == 7.0).all())
    assert all(x.grad is None for x in batches) and all(p.grad is None for p in model.parameters())


def test_loaded_trace_gives_parameters_and_their_gradients_back(tmp_path):
    model, args, _ = zoo()["mlp"]
    model.zero_grad(set_to_none=True)
    log = tl.trace(model, args, grads=True)
    log.backward(log.output.sum())
    log.save(tmp_path / "t")
    loaded = tl.load(tmp_path / "t")
    assert [p.address for p in loaded.params] == [p.address for p in log.params]
    for live, back in zip(log.params, loaded.params, strict=True):
        assert (back.shape, back.dtype, back.requires_grad, back.op_labels) == \
            (live.shape, live.dtype, live.requires_grad, live.op_labels)
        assert torch.equal(back.grad, live.grad), live.address
    assert loaded.params.to_pandas().equals(log.params.to_pandas())
    # Saved without the tensors, or without gradients at all: the loaded Param says so.
    log.save(tmp_path / "meta", activations=False)
    with pytest.raises(GradientUnavailable, match="activations=False"):
        tl.load(tmp_path / "meta").params[0].grad
    plain = tl.trace(model, args)
    plain.save(tmp_path / "plain")
    reread = tl.load(tmp_path / "plain")
    assert reread.params[0].address == log.params[0].address
    with pytest.raises(GradientUnavailable, match="without grads="):
        reread.params[0].grad
    log.cleanup()
    log.save(tmp_path / "cleaned")
    cleaned = tl.load(tmp_path / "cleaned")
    assert [p.op_labels for p in cleaned.params] == [p.op_labels for p in log.params]
    with pytest.raises(GradientUnavailable, match="cleanup"):
        cleaned.params[0].grad


class _NaNInBackward(nn.Module):
    """Finite forward; the backward of sqrt at 0 times 0 is NaN."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return (h + torch.sqrt(h * 0) * 0).sum()


def test_a_trace_saved_without_tensors_says_its_gradients_are_missing(tmp_path):
    torch.manual_seed(0)
    log = tl.trace(_NaNInBackward(), torch.randn(2, 4), grads=True)
    log.backward(log.output)
    live = tl.debug.nonfinite_origin(log, grads=True)
    assert live.found and live.kind == "nan"
    log.save(tmp_path / "full")
    full = tl.load(tmp_path / "full")
    assert tl.debug.nonfinite_origin(full, grads=True).origin_label == live.origin_label
    log.save(tmp_path / "meta", activations=False)
    meta = tl.load(tmp_path / "meta")
    # The statistics are kept; the tensors are not, and reading one says so rather than reading None
    # (which means no backward reached the op).
    assert meta.to_pandas()["grad_norm"].equals(log.to_pandas()["grad_norm"])
    for op in log.ops:
        if op.kind == "op" and op.grad is not None:
            with pytest.raises(GradientUnavailable, match="activations=False"):
                meta[op.label].grad
    with pytest.raises(GradientUnavailable, match="save the trace with its tensors"):
        tl.debug.nonfinite_origin(meta, grads=True)


def test_gradients_no_file_can_hold_are_named_on_the_loaded_trace(tmp_path):
    # A sparse embedding's .grad (sparse COO) and a complex128 op's gradient have no safetensors encoding:
    # the save goes through, and the loaded trace says why those two are missing instead of giving None.
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(20, 4, sparse=True)
            self.head = nn.Linear(12, 2)

        def forward(self, x):
            h = self.embed(x).flatten(1)
            wide = h.to(torch.complex128) * 1j
            return self.head(h) + wide.imag.sum(1, keepdim=True).float()

    model, x = Mixed(), torch.randint(0, 20, (2, 3))
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    assert model.embed.weight.grad.is_sparse
    loaded = tl.load(log.save(tmp_path / "t"))
    with pytest.raises(GradientUnavailable, match="embed.weight: its gradient was not saved .*sparse_coo"):
        loaded.params[0].grad
    assert torch.equal(loaded.params[1].grad, model.head.weight.grad)
    wide = next(op for op in log.ops if op.dtype == torch.complex128 and op.grad is not None)
    with pytest.raises(GradientUnavailable, match="not saved .*complex128"):
        loaded[wide.label].grad
    assert torch.equal(loaded["flatten_1_2"].grad, log["flatten_1_2"].grad)
    # Saved again from the loaded trace: the gradients it read, and the reasons for the missing ones, stay.
    again = tl.load(loaded.save(tmp_path / "again"))
    assert torch.equal(again.params[1].grad, model.head.weight.grad)
    with pytest.raises(GradientUnavailable, match="sparse_coo"):
        again.params[0].grad
    with pytest.raises(GradientUnavailable, match="complex128"):
        again[wide.label].grad


class SparseEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(10, 4))

    def forward(self, ids):
        return F.embedding(ids, self.w * 2, sparse=True).sum()


def test_sparse_gradients_have_statistics_and_a_documented_save(tmp_path):
    # mul's gradient (d loss / d (w * 2)) is a sparse COO tensor with a repeated row: its statistics are
    # those of the dense gradient it stands for, implicit zeros included.
    torch.manual_seed(0)
    log = tl.trace(SparseEmbedding(), torch.tensor([[1, 2, 2]]), grads=True)
    log.backward(log.output)
    grad = log["mul_1_1:1"].grad
    assert grad.is_sparse
    dense = grad.to_dense()
    row = log.to_pandas().set_index("label").loc["mul_1_1:1"]
    assert row["grad_norm"] == pytest.approx(float(dense.norm()))
    assert (row["grad_min"], row["grad_max"]) == (float(dense.min()), float(dense.max())) == (0.0, 2.0)
    assert row["grad_nonfinite"] == 0
    assert tl.debug.hot_path(log, by="grad_norm").rows
    assert tl.debug.nonfinite_origin(log, grads=True).origin_label is None
    loaded = tl.load(log.save(tmp_path / "t"))
    with pytest.raises(GradientUnavailable, match="not saved .*sparse"):
        loaded["mul_1_1:1"].grad


def test_extract_refuses_gradients_of_a_forward_stopped_early(tmp_path):
    # stop_after ends each forward at its site, so there is no output for loss_fn: refused before any batch
    # runs, instead of loss_fn failing on None in the first batch.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,)))]
    with pytest.raises(ValueError, match=r"stop_after='0' stops each forward before it"):
        tl.extract(model, batches, ["0"], tmp_path / "y", args_of=lambda b: b[0], grads=True, stop_after="0",
                   loss_fn=lambda output, batch: F.cross_entropy(output, batch[1]), progress=False)
    assert not (tmp_path / "y").exists()


class _WidensToComplex128(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)
        wide = h.to(torch.complex128) * 1j  # a gradient no safetensors file can hold
        return self.head(h) + wide.imag.sum(1, keepdim=True).float()


def test_a_gradient_no_file_holds_keeps_its_statistics_on_the_loaded_trace(tmp_path):
    # The statistics of every gradient are in the saved record; the loaded trace read them only when it held no
    # gradient tensor at all, and otherwise recomputed them from the tensors it held, showing none for the
    # complex128 ops' gradients, as if no backward had reached them.
    torch.manual_seed(0)
    log = tl.trace(_WidensToComplex128(), torch.randn(2, 4), grads=True)
    log.backward(log.output.sum())
    loaded = tl.load(log.save(tmp_path / "t"))
    columns = ["label", "grad_norm", "grad_min", "grad_max", "grad_nonfinite"]
    live, read = log.to_pandas()[columns], loaded.to_pandas()[columns]
    wide = [op.label for op in log if op.kind == "op" and op.dtype == torch.complex128]
    assert wide and live.set_index("label").loc[wide, "grad_norm"].notna().all()
    assert read.equals(live)
    again = tl.load(loaded.save(tmp_path / "again"))  # and saved again from the loaded trace
    assert again.to_pandas()[columns].equals(live)


def test_a_loaded_trace_says_which_ops_a_gradient_reached_also_where_it_holds_no_tensor(tmp_path):
    # has_grad said False for every op whose gradient the folder holds no tensor for (a complex128 op's, every
    # op's when saved with activations=False), as if no backward had reached it, while .grad said it was not saved.
    torch.manual_seed(0)
    log = tl.trace(_WidensToComplex128(), torch.randn(2, 4), grads=True)
    log.backward(log.output.sum())
    reached = [op.label for op in log if op.has_grad]
    assert len(reached) < len(log.ops)  # the input needs no gradient
    for options in ({}, {"activations": False}):
        loaded = tl.load(log.save(tmp_path / f"t{len(options)}", **options))
        assert [op.label for op in loaded if op.has_grad] == reached, options
        unheld = [label for label in reached if label != "output_1:1" and log[label].dtype == torch.complex128]
        with pytest.raises(GradientUnavailable, match="not saved"):
            loaded[unheld[0]].grad
        assert '"gradient":{"norm":' in loaded.render(format="html")  # the viewer shows the statistics alone


@pytest.mark.parametrize("layer, why", [
    ("argmax_1_2", "its output is int64, a dtype autograd computes no gradient for"),
    ("input_1", "it is an input that does not require grad"),
])
def test_extract_names_the_layer_whose_gradient_no_batch_can_have(tmp_path, layer, why):
    # An integer layer (indices, a mask) or an input has no gradient in any batch: the refusal names the batch and
    # the layers= entry and says to extract it without grads=True; it named the op label alone.
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            logits = self.fc(x)
            return logits, logits.argmax(-1)

    batches = [torch.randn(5, 4) for _ in range(2)]
    message = (rf"batch 0: grads=True writes every layer's gradient, and {layer} \({layer}:1\) has none: .*{why}.*; "
               r"extract it in a tl.extract call without grads=True")
    with pytest.raises(GradientUnavailable, match=message):
        tl.extract(Tagger(), batches, ["fc", layer], tmp_path / "g", grads=True,
                   loss_fn=lambda output, batch: output[0].sum(), progress=False)
    assert tl.trace(Tagger(), batches[0]).labels[:3] == ["input_1:1", "linear_1_1:1", "argmax_1_2:1"]


def test_a_parameter_gradient_cast_since_the_trace_is_named_as_not_saved_and_the_file_loads(tmp_path):
    """``model.half()`` after a backward casts each ``.grad`` too: saved beside the parameter's float32 record, it
    made a file that tl.load refused as not matching its parameter."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    log = tl.trace(model, torch.randn(2, 3), grads=True)
    log.backward(log.output.sum())
    expected = model[2].bias.grad.clone()
    model[0].half()
    log.save(tmp_path / "cast.tl")
    loaded = tl.load(tmp_path / "cast.tl")
    with pytest.raises(GradientUnavailable, match=r"0\.weight: .*cast or resized since the trace: the forward read "
                                                  r"a torch\.float32 tensor .*now a torch\.float16 one"):
        loaded.params[0].grad
    assert torch.equal(loaded.params[3].grad, expected)


def test_a_parameter_gradient_cast_since_the_trace_is_refused_on_the_live_trace():
    """The live trace's ``Param.grad`` handed back the cast ``.grad`` (float16) beside its record's float32 dtype,
    as if it were the traced parameter's gradient: it is refused with both layouts, as the saved file names it."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    log = tl.trace(model, torch.randn(2, 3), grads=True)
    log.backward(log.output.sum())
    expected = model[2].bias.grad.clone()
    model[0].half()
    assert log.params[0].dtype == torch.float32
    with pytest.raises(GradientUnavailable, match=r"0\.weight: its \.grad is no gradient of the traced parameter "
                                                  r"\(.*forward read a torch\.float32 tensor .*now a torch\.float16"):
        log.params[0].grad
    assert torch.equal(log.params[3].grad, expected)
    assert tl.debug.nonfinite_origin(log, grads=True).parameters_checked is False  # unread, not called finite
