"""Standard PyTorch paths that a trace must survive: inference mode, nested and sparse tensors,
higher-order ops and ``torch.compile``'d submodules.

Each either traces bit-identically to an untraced run (and validates) or says plainly what it cannot
guarantee.  Each ``@CASE`` returns its row of docs/reliability.md.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from torchlens.capture.compiled import EAGER_CAVEAT, CompiledCall  # noqa
from torchlens.capture.state import INFERENCE_CAVEAT  # noqa: E402
from torchlens.validate import outputs_equal  # noqa: E402
from reliability_cases import case, outcome, titles  # noqa: E402
from untouched import assert_clean_process, assert_untouched, snapshot  # noqa: E402

CASE = case("Standard paths")


@pytest.fixture(autouse=True, scope="module")
def _collect_compile_garbage():
    """torch.compile leaves reference cycles holding weak proxies; collect them here, not during
    another module's tests (a gc callback there would meet dead proxies)."""
    yield
    gc.collect()


# ----- inference mode ----------------------------------------------------------------------------
class InferenceInside(nn.Module):
    """Switches to inference mode inside its own forward and writes the inference tensors in place."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = x.relu()
        with torch.inference_mode():
            y = self.fc(h)
            copy = y * 1
            y.add_(1)
            y[0] = 5.0
            torch.mul(copy, 2, out=copy)
        return y + copy


@CASE
def inference_mode_inside_forward():
    """torch.inference_mode() entered inside forward, with in-place writes to inference tensors."""
    model, x = InferenceInside(), torch.randn(3, 4)
    expected = model(x)
    log = tl.trace(model, x)
    assert torch.equal(log.output, expected)
    assert log.caveats == (INFERENCE_CAVEAT,)
    names = [op.func_name for op in log.ops if op.kind == "op"]
    assert names == ["relu", "linear", "mul", "add_", "__setitem__", "mul", "add"], names
    _, linear, copy, add_, setitem, mul_out, final = [op for op in log.ops if op.kind == "op"]
    # Writes known by name are attributed: each reader gets the op that last wrote its tensor.
    assert add_.parents == [linear.label] and setitem.parents == [add_.label]
    assert set(mul_out.parents) == {copy.label}  # its input, and its out= tensor
    assert final.parents == [setitem.label, mul_out.label], final.parents
    # Saved activations were copied before the predicted writes overwrote them.
    with torch.no_grad():
        assert torch.equal(linear.activation, model.fc(x.relu()))
        assert torch.equal(copy.activation, model.fc(x.relu()))
    result = tl.validate(model, x)
    assert result.passed and result.outputs_match, str(result)
    assert_clean_process()
    return (f"faithful; in-place writes attributed by name (add_, setitem, out=); {result.replayed} ops "
            "replayed exactly; Trace.caveats names the weaker write detection")


def test_inference_mode_around_a_transformer_layer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    with torch.inference_mode():
        expected = layer(x)
        log = tl.trace(layer, x)
    assert torch.equal(log.output, expected)
    assert log.caveats == (INFERENCE_CAVEAT,)
    assert "transformerencoderlayerfwd" in [op.type for op in log.ops]  # the fused kernel, as untraced


def test_a_plain_trace_has_no_caveats():
    log = tl.trace(nn.Linear(3, 3), torch.randn(2, 3))
    assert log.caveats == ()


# ----- nested and sparse tensors -----------------------------------------------------------------
def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own note about nested tensors being a prototype
        return nn.TransformerEncoder(layer, 2).eval()


@CASE
def transformer_encoder_with_padding_mask():
    """Eval nn.TransformerEncoder under no_grad with src_key_padding_mask (nested tensors inside)."""
    model = _encoder()
    x = torch.randn(3, 6, 8)
    mask = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1], [0, 0, 1, 1, 1, 1]]).bool()
    before = snapshot(model, (x, mask))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model(x, src_key_padding_mask=mask)
        log = tl.trace(model, x, {"src_key_padding_mask": mask})
        result = tl.validate(model, x, {"src_key_padding_mask": mask})
    assert torch.equal(log.output, expected)
    assert result.passed and result.outputs_match, str(result)
    nested = [op for op in log.ops if op.activation is not None and op.activation.is_nested]
    assert [op.type for op in nested] == ["nestedtensorfrommask", "transformerencoderlayerfwd",
                                          "transformerencoderlayerfwd"], [op.type for op in log.ops]
    lengths = (~mask).sum(1)
    for op in nested:
        assert op.shape == (3, None, 8), op.shape  # the ragged dimension is None, never a guess
        assert op.numel == int(lengths.sum()) * 8
    assert_untouched(before, snapshot(model, (x, mask)))
    return (f"bit-identical; nested activations recorded with shape {nested[0].shape} (None: ragged); "
            f"{result.replayed} ops replayed exactly")


def test_nested_tensor_input_and_ops(tmp_path):
    parts = [torch.randn(2, 4), torch.randn(5, 4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor(parts)
    log = tl.trace(lambda t: (t * 2).relu(), nt)
    assert log.inputs[0].shape == (2, None, 4) and log.inputs[0].numel == 28
    for got, want in zip(log.output.unbind(), parts):
        assert torch.equal(got, (want * 2).relu())
    assert log.validate().passed
    log.save(tmp_path / "nested")  # ragged shapes survive a save (the nested activations are not saved)
    back = tl.load(tmp_path / "nested")
    assert [(op.shape, op.numel) for op in back.ops] == [(op.shape, op.numel) for op in log.ops]


def test_nested_activations_are_summarised_checked_and_drawn(tmp_path):
    # Nested tensors lack the reductions (any, all, sum) a check of values runs: every check reads their
    # components, and a NaN in one component is found where it was born.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor([torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0], [4.0, 5.0]])])
    log = tl.trace(lambda t: (t * 2).sqrt().relu(), nt, record_finite=True)
    assert [op.finite for op in log.ops if op.kind == "op"] == [(False, False), (True, False), (True, False)]
    assert tl.debug.nonfinite_origin(log).origin_label == log.ops[2].label  # the sqrt, not the relu after it
    assert log.summary().rows[0]["activation_bytes"] == 3 * 6 * 4  # three ops of six float elements
    log.render(str(tmp_path / "nested.html"))
    from torchlens.viz.records import activation_stats

    stats = activation_stats(log.ops[2].activation)
    assert stats["nan"] == 1 and stats["numel"] == 6
    assert tl.trace(lambda t: (t * 2).sqrt().relu(), nt).ops[2].finite is None  # not asked for: not examined



def test_quantized_activations_are_summarised_by_their_dequantized_values(tmp_path):
    # A quantized tensor has no float values of its own to reduce: the viewer's statistics raised
    # (Creation of quantized tensor requires quantized dtype), so no html could be drawn for the trace.
    def fake_quant(x):
        return torch.quantize_per_tensor(x, 0.1, 10, torch.quint8).relu().dequantize() * 2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        log = tl.trace(fake_quant, torch.randn(3, 8), record_finite=True)
    relu = log["relu_1_2:1"]
    assert relu.dtype == torch.quint8 and relu.finite == (False, False)
    from torchlens.viz.records import activation_stats

    values = relu.activation.dequantize().double()
    stats = activation_stats(relu.activation)
    assert (stats["min"], stats["max"], stats["numel"]) == pytest.approx((float(values.min()), float(values.max()), 24))
    assert "quint8" in log.render(format="html")


def test_jagged_nested_tensors_have_ragged_shapes_not_symbolic_sizes(tmp_path):
    # The jagged layout answers .shape with a symbolic size (j1) that is no number: recorded as it was,
    # every count built on it (summary, FLOPs, save, hot_path) was symbolic or raised.
    parts = [torch.randn(3, 8), torch.randn(5, 8)]
    nt = torch.nested.nested_tensor(parts, layout=torch.jagged)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    log = tl.trace(model, nt)
    assert [(op.shape, op.numel, op.nbytes) for op in log.ops] == [((2, None, 8), 64, 256)] * 4
    # Against the untraced nested forward: a nested Linear may round differently from the same Linear on
    # each component alone, depending on the CPU's kernels.
    with torch.no_grad():
        untraced = model(nt)
    for got, want in zip(log.output.unbind(), untraced.unbind(), strict=True):
        assert torch.equal(got, want)
    assert log.summary().rows[0]["activation_bytes"] == 2 * 256  # the linear and the relu
    assert "2x?x8" in str(log) and "2x?x8" in str(log.summary())
    assert tl.debug.hot_path(log, by="memory").to_pandas()["total"].tolist() == [256, 256]
    assert log.validate().passed
    back = tl.load(log.save(tmp_path / "jagged", activations=False))
    assert [(op.shape, op.numel) for op in back.ops] == [(op.shape, op.numel) for op in log.ops]


@CASE
def sparse_outputs():
    """Sparse COO and CSR outputs, and ops reading them."""

    def f(t):
        coo = t.relu().to_sparse()
        csr = t.relu().to_sparse_csr()
        return coo, csr, csr @ torch.ones(4, 2), coo.coalesce().values()

    x = torch.randn(3, 4)
    log = tl.trace(f, x)
    expected = f(x)
    assert outputs_equal(log.output[2:], expected[2:])
    for got, want in zip(log.output[:2], expected[:2]):
        assert got.layout == want.layout and torch.equal(got.to_dense(), want.to_dense())
    layouts = {op.type: op.activation.layout for op in log.ops if op.kind == "op"}
    assert layouts["tosparse"] == torch.sparse_coo and layouts["tosparsecsr"] == torch.sparse_csr
    assert log["tosparse_1_2"].shape == (3, 4)  # the logical (dense) shape
    result = log.validate()
    assert result.passed and not result.not_replayed, str(result)
    return f"recorded with their layouts and logical shapes; {result.replayed} ops replayed exactly"


# ----- higher-order ops --------------------------------------------------------------------------
def _cond(t):
    return torch.cond(t.sum() > 0, lambda a: a.sin() * 2, lambda a: a.cos(), (t,))


@CASE
def torch_cond_in_eager_mode():
    """torch.cond called in eager mode (it compiles its branches with Dynamo)."""
    # With an operand that requires grad, torch builds the op's schema first by tracing both branches with
    # fake tensors: those calls (and the fake tensors' making) were recorded as ops, the branch that did not
    # run among them.  The op is one op now, with or without gradients.
    recorded = []
    for x in (torch.ones(3), -torch.ones(3), torch.ones(3, requires_grad=True)):
        log = tl.trace(_cond, x)
        assert torch.equal(log.output, _cond(x))
        result = log.validate()
        assert result.passed and not result.not_replayed, str(result)
        recorded.append([op.type for op in log.ops if op.kind == "op"])
        assert log["cond_1_3:1"].parents == ["gt_1_2:1", "input_1:1"]
        assert log["cond_1_3:1"].source.file == __file__  # _cond's line, not the graph Dynamo made of it
        assert_clean_process()
    assert recorded == [["sum", "gt", "cond"]] * 3, recorded
    return "bit-identical; one cond op (its branches unseen), with or without gradients, replayed exactly"


class HookedInCond(nn.Module):
    """A module with a forward hook, called in a body of torch.cond: Dynamo, compiling the body, traces that
    module's ``_call_impl`` (the hook path) rather than its forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.b.register_forward_hook(lambda module, args, out: out * 2)

    def forward(self, x):
        h = self.a(x)
        return self.head(torch.cond(h.sum() < 0, lambda t: self.b(t).relu(), lambda t: t - 1, (h,)))


def test_a_hooked_module_in_a_cond_body_runs_as_untraced():
    model, x = HookedInCond(), torch.ones(2, 8)
    expected = model(x)
    assert model.a(x).sum() < 0  # the branch calling the hooked module runs
    before = snapshot(model, (x,))
    log = tl.trace(model, x)
    assert torch.equal(log.output, expected)  # the hook's doubling included, as untraced
    assert [op.type for op in log.ops if op.kind == "op"] == ["linear", "sum", "lt", "cond", "linear"]
    assert [c.label for c in log.module_calls] == ["a:1", "head:1"]  # b runs inside the one cond op
    result = log.validate()
    assert result.passed and not result.not_replayed, str(result)
    assert_untouched(before, snapshot(model, (x,)))
    assert_clean_process()


def test_a_hooked_module_in_a_cond_body_traces_where_dynamo_is_first_imported_by_the_trace():
    # torch.cond imports Dynamo mid-forward, before any compile callback can be registered.
    code = ("import sys, torch, torchlens as tl\n"
            f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
            "from test_standard_paths import HookedInCond\n"
            "assert 'torch._dynamo' not in sys.modules\n"
            "model, x = HookedInCond(), torch.ones(2, 8)\n"
            "log = tl.trace(model, x)\n"
            "assert 'torch._dynamo' in sys.modules\n"
            "import torch._higher_order_ops.utils as utils, torch._dynamo.callback as callback\n"
            "assert utils._hop_compile_and_call.__module__ == 'torch._higher_order_ops.utils'\n"
            "assert not callback.callback_handler.start_callbacks and not callback.callback_handler.end_callbacks\n"
            "print(torch.equal(log.output, model(x)), [c.label for c in log.module_calls])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == "True ['a:1', 'head:1']"


@pytest.mark.parametrize("option", ["intervene", "save", "grads"])
def test_a_module_called_in_a_cond_body_is_no_site_and_the_refusal_names_the_op(option):
    model, x = HookedInCond(), torch.ones(2, 8)
    expected = model(x)
    selection = {"b": tl.zero_ablate()} if option == "intervene" else ["b"]
    with pytest.raises((tl.InterventionError, tl.UnmatchedSelection)) as raised:
        tl.trace(model, x, **{option: selection})
    assert "cond_1_4:1" in str(raised.value) and "torch.cond" in str(raised.value)
    # (Dynamo marks the parameters of a body it compiles, traced or not: the module hooks are compared here.)
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == [0, 0, 1, 0]
    assert torch.equal(model(x), expected)
    assert_clean_process()


@CASE
def flex_attention_in_eager_mode():
    """flex_attention (torch.nn.attention.flex_attention) in eager mode, with a score_mod."""
    from torch.nn.attention.flex_attention import flex_attention

    def relative(score, b, h, q, k):
        return score + (q - k)

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 8, 4).unbind(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "flex_attention called without torch.compile"
        expected = flex_attention(q, k, v, score_mod=relative)
        log = tl.trace(lambda a, b, c: flex_attention(a, b, c, score_mod=relative), (q, k, v))
    assert torch.equal(log.output, expected)
    assert [op.kind for op in log.ops].count("input") == 3
    assert_clean_process()
    return "bit-identical; the eager ops of its math path recorded"


# ----- transformed models ------------------------------------------------------------------------
class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)) + 1)


def test_an_fx_graph_module_calls_the_original_modules_at_their_addresses():
    model, x = _Blocks(), torch.randn(3, 4)
    graph_module = torch.fx.symbolic_trace(model)
    eager, traced = tl.trace(model, x), tl.trace(graph_module, x)
    assert torch.equal(traced.output, model(x))
    # FX inlines the Sequential (it is no leaf): its call is gone, its children are called at their addresses.
    assert [c.label for c in traced.module_calls] == ["embed:1", "blocks.0:1", "blocks.1:1", "head:1"]
    assert [c.label for c in eager.module_calls] == ["embed:1", "blocks:1", "blocks.0:1", "blocks.1:1", "head:1"]
    assert [(op.type, op.module_address, tuple(op.params)) for op in traced.ops] == \
        [(op.type, op.module_address if op.module_address != "blocks" else None, tuple(op.params)) for op in eager.ops]
    assert traced.validate().passed
    assert torch.equal(tl.trace(graph_module, x, intervene={"blocks.1": tl.zero_ablate()}).output,
                       model.head(torch.ones(3, 8)))


def test_an_exported_module_runs_its_graph_with_the_parameters_under_their_names():
    model, x = _Blocks(), torch.randn(3, 4)
    exported = torch.export.export(model, (x,)).module()
    log = tl.trace(exported, x)
    assert torch.equal(log.output, model(x))
    linears = [op for op in log.ops if op.type == "linear"]
    assert [tuple(op.params) for op in linears] == [("embed.weight", "embed.bias"),
                                                    ("blocks.0.weight", "blocks.0.bias"),
                                                    ("head.weight", "head.bias")]
    assert all(op.module_address is None for op in log.ops)  # the submodules' forwards were inlined by export
    assert log.validate().passed


# ----- compiled submodules -----------------------------------------------------------------------
class WithCompiled(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.block = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)), backend="aot_eager")
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.block(self.embed(x)).tanh())


def _counters():
    import torch._dynamo

    return torch._dynamo.utils.counters


@CASE
def compiled_submodule():
    """A torch.compile'd submodule inside a traced model (backend aot_eager)."""
    import torch._dynamo

    torch._dynamo.reset()
    model, x = WithCompiled(), torch.randn(2, 4)
    _counters().clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log = tl.trace(model, x)  # its first call: Dynamo compiles the submodule inside the trace
    # the page says a trace installs no global module hook, so torch's warning about them never fires
    assert not [w for w in caught if "global hooks" in str(w.message)], [str(w.message) for w in caught]
    compiled_frames = dict(_counters()["frames"])
    assert compiled_frames.get("ok") == 1, compiled_frames  # the submodule's forward, and nothing else
    assert not _counters()["graph_break"], dict(_counters()["graph_break"])
    assert not any("torchlens" in name for name in _counters()["resumes"])
    assert torch.equal(log.output, model(x))  # bit-identical to the untraced compiled run
    assert [op.type for op in log.ops] == ["input", "linear", "compiled", "tanh", "linear", "output"]
    assert log["compiled_1_2"].module == "block:1"
    addresses = [mc.label for mc in log.module_calls] + [m.address for m in log.modules]
    assert addresses == ["embed:1", "block:1", "head:1", "embed", "block", "head"], addresses
    assert log.modules[1].class_name == "Sequential"  # the class compiled, not torch's wrapper
    assert log.caveats == ()
    result = tl.validate(model, x)
    assert result.passed and result.outputs_match, str(result)
    assert_clean_process()
    assert not isinstance(vars(model.block)["forward"], CompiledCall)  # its own forward is back
    return ("runs compiled, bit-identical to the untraced run, recorded as one `compiled` op in module "
            "call block:1; Dynamo compiled one frame, with no graph break into torchlens")


@CASE
def compiled_submodule_traced_eagerly():
    """compiled="eager": the interior of a torch.compile'd submodule traced op by op."""
    model, x = WithCompiled(), torch.randn(2, 4)
    with pytest.warns(UserWarning, match="may differ from the compiled run"):
        log = tl.trace(model, x, compiled="eager")
    assert log.caveats == (EAGER_CAVEAT,)
    assert [op.type for op in log.ops if op.kind == "op"] == ["linear", "linear", "gelu", "layernorm", "tanh",
                                                               "linear"]
    calls = [mc.label for mc in log.module_calls]
    assert calls == ["embed:1", "block:1", "block.0:1", "block.1:1", "block.2:1", "head:1"], calls
    assert log["linear_2_2"].params == ("block.0.weight", "block.0.bias")
    assert not any("_orig_mod" in name for op in log.ops for name in (op.params or ()))
    assert_clean_process()
    return "interior recorded under the submodule's own addresses (block.0, ...); a warning and Trace.caveats " \
           "say its outputs may differ from the compiled run"


def test_two_threads_trace_one_model_with_a_compiled_submodule():
    """The routed forward is shared: the trace that began first ends first, while the other still runs."""
    import threading

    entered, release, routed = threading.Event(), threading.Event(), []

    class Gate(nn.Module):
        def forward(self, x):
            if threading.current_thread().name == "first":
                entered.set()
                release.wait(10)  # until the main thread's trace is inside its forward
            elif entered.is_set() and not release.is_set():
                release.set()
                first.join(10)  # the first trace ends here, in the middle of this one
                routed.append(isinstance(vars(model.block)["forward"], CompiledCall))
            return x + 0

    model = WithCompiled()
    model.embed = nn.Sequential(Gate(), model.embed)
    x = torch.randn(2, 4)
    expected = model(x)
    logs = {}
    first = threading.Thread(target=lambda: logs.setdefault("first", tl.trace(model, x)), name="first")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first.start()
        assert entered.wait(10)
        logs["second"] = tl.trace(model, x)
    assert not first.is_alive() and routed == [True]  # still routed for the trace that had not ended
    for log in logs.values():
        assert torch.equal(log.output, expected)
        assert [op.type for op in log.ops if op.kind == "op"] == ["add", "linear", "compiled", "tanh", "linear"]
    assert not isinstance(vars(model.block)["forward"], CompiledCall)
    assert_clean_process()


def test_compiled_option_is_checked():
    with pytest.raises(ValueError, match="compiled='inductor' is not understood"):
        tl.trace(nn.Linear(2, 2), torch.randn(1, 2), compiled="inductor")
    assert_clean_process()


def test_compiled_submodule_with_attention_fast_path():
    """The fast-path shim is out of Dynamo's sight while a compiled region runs."""
    import torch._dynamo

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.attn = torch.compile(nn.MultiheadAttention(8, 2, batch_first=True), backend="eager")

        def forward(self, x):
            return self.attn(x, x, x)[0]

    torch._dynamo.reset()
    model = Attn().eval()
    x = torch.randn(2, 3, 8)
    _counters().clear()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        log = tl.trace(model, x)
        expected = model(x)
    assert torch.equal(log.output, expected)
    assert not any("torchlens" in str(reason) for reason in _counters()["graph_break"])
    assert [op.type for op in log.ops if op.kind == "op"] == ["compiled", "compiled"]  # (output, weights)


@pytest.mark.parametrize("title", titles("Standard paths"))
def test_case(title):
    assert outcome("Standard paths", title)


# ----- writes through views of inference tensors ----------------------------------------------------------
def _view_then_base(x):
    y = x * 1
    v = y.view(-1)
    v.add_(1)
    return y * 2


def _base_then_view(x):
    y = x * 1
    v = y.view(-1)
    y.add_(1)
    return v * 2


def _one_row_of_two(x):
    y = x * 1
    a, b = y[0], y[1]
    a.mul_(3)
    return b + 1, a + 1, y.sum()


def _transposed_row(x):
    y = x * 1
    t = y.t()
    t[0].zero_()
    return y - 1, t + 1


def _out_into_a_view(x):
    y = x.clone()
    z = y.view(2, -1)
    torch.add(z, 1, out=z)
    return y * 1


@pytest.mark.parametrize("forward", [_view_then_base, _base_then_view, _one_row_of_two, _transposed_row,
                                     _out_into_a_view], ids=lambda f: f.__name__.strip("_"))
def test_a_write_through_a_view_of_an_inference_tensor_is_the_parent_of_what_reads_it_after(forward):
    """Inference tensors have no version counter: the writes noted on their storage say who wrote what a
    later read reads, as the counter does for the same forward under torch.no_grad()."""
    x = torch.randn(4, 4)
    with torch.no_grad():
        counted = tl.trace(forward, x)

    def in_inference_mode(x):
        with torch.inference_mode():
            return forward(x)

    uncounted = tl.trace(in_inference_mode, x)
    assert [(op.label, op.parents) for op in uncounted.ops] == [(op.label, op.parents) for op in counted.ops]
    assert tl.validate(in_inference_mode, x).passed
