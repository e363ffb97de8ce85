"""flops_vs_dispatch: torchlens's FLOPs registry beside FlopCounterMode, two runs of the model reported side by
side, with the witnesses that both ran the same work."""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import torchlens as tl
from torchlens.report.flops_compare import SDPA_CPU_NOTE
from zoo import zoo

from test_flops import native_total


# ----- flops_vs_dispatch --------------------------------------------------------------------------------
def test_linear_only_model_agrees_with_flop_counter_mode_up_to_bias_terms():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    result = tl.report.flops_vs_dispatch(model, x)
    matmul = next(row for row in result.families if row["family"] == "matmul")
    assert matmul["difference"] == -(4 * 32 + 4 * 8)  # one bias add per output element, native omits it
    assert result.native_total == native_total(model, x)
    assert result.difference == result.native_total - int(result.torchlens_total)
    rows = {row["module"]: row for row in result.modules}
    assert rows["0"]["difference"] == -4 * 32 and rows["2"]["difference"] == -4 * 8
    assert rows["1"]["native"] == 0 and rows["1"]["torchlens"] == 4 * 32  # relu: torchlens only
    assert any("elementwise" in note and "torchlens only" in note for note in result.notes)
    assert set(result.to_pandas().columns) == {"family", "torchlens", "native", "difference"}
    assert "never measured" in str(result)
    # Module addresses were cut to 24 characters: siblings deep in a model (attention.self.query and .key)
    # read alike.
    deep = nn.Sequential()
    deep.add_module("encoder_layer_attention_block", nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    shown = str(tl.report.flops_vs_dispatch(deep.eval(), x))
    assert "\n  encoder_layer_attention_block.0 " in shown and "\n  encoder_layer_attention_block.1 " in shown



def test_a_meta_device_model_is_compared_as_its_real_twin_is_and_says_what_vouches():
    # Counting a model on the meta device costs no memory; comparing its outputs' values raised torch's
    # "Tensor.item() cannot be called on meta tensors" instead of a comparison.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).eval()
    x = torch.randn(2, 3, 8, 8)
    real = tl.report.flops_vs_dispatch(model, x)
    meta = tl.report.flops_vs_dispatch(copy.deepcopy(model).to("meta"), x.to("meta"))
    assert (meta.families, meta.modules) == (real.families, real.modules)
    assert meta.witness["outputs_match"] is None and real.witness["outputs_match"] is True
    assert any("no values" in note and "same order" in note for note in meta.notes)
    assert not any("no values" in note for note in real.notes)

    # The product sequence is still checked when no value can be.
    with pytest.raises(tl.TorchlensError, match="called different matrix products"):
        tl.report.flops_vs_dispatch(_alternating_products().to("meta"), torch.randn(3, 4, device="meta"))


class _SparseOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu().to_sparse()


class _NestedOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.nested.nested_tensor([h[:2], h[:1]], layout=torch.jagged)


@pytest.mark.parametrize("model", [_SparseOutput, _NestedOutput])
def test_sparse_and_nested_outputs_are_compared_by_value(model):
    # A sparse output raised torch's "Could not run 'aten::eq.Tensor' ... SparseCPU"; two jagged nested outputs
    # have different ragged sizes by identity, and were called different outputs (the witness refused).
    torch.manual_seed(0)
    result = tl.report.flops_vs_dispatch(model().eval(), torch.randn(3, 4))
    assert result.witness["outputs_match"] is True
    matmul = next(row for row in result.families if row["family"] == "matmul")
    assert matmul["native"] == 2 * 3 * 4 * 4 and matmul["torchlens"] == matmul["native"] + 3 * 4  # + the bias adds


@pytest.mark.parametrize("name", [n for n in sorted(zoo()) if n != "dropout_train"])
def test_zoo_linear_and_conv_modules_differ_from_native_by_exactly_their_bias_adds(name):
    model, args, kwargs = zoo()[name]
    result = tl.report.flops_vs_dispatch(model, args, kwargs)
    log = tl.trace(model, args, kwargs, save="none")
    rows = {row["module"]: row for row in result.modules}
    checked = 0
    for module in log.modules:
        if module.class_name not in ("Linear", "Conv2d"):
            continue
        outputs = [log[label] for call in module.calls for label in call.output_ops]
        bias = "bias" in module.param_names
        expected = sum(math.prod(op.shape) for op in outputs) if bias else 0
        assert rows[module.address]["torchlens"] - rows[module.address]["native"] == expected, module.address
        checked += 1
    assert result.witness["outputs_match"]
    assert checked or not any(m.class_name in ("Linear", "Conv2d") for m in log.modules)


class SlicedTable(nn.Module):
    """Hands its child a view of a parameter, as DeBERTa hands its projections the relative embeddings."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, 4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(self.table[:4]) + x


def test_flop_counter_modes_failure_under_no_grad_is_named_with_the_way_round_it():
    model, x = SlicedTable().eval(), torch.randn(4, 4)
    with torch.no_grad():
        with pytest.raises(AssertionError):  # torch's own tracker, untraced: the failure being named
            with FlopCounterMode(display=False):
                model(x)
        with pytest.raises(tl.errors.NativeToolFailed, match="outside torch.no_grad"):
            tl.report.flops_vs_dispatch(model, x)
    assert tl.report.flops_vs_dispatch(model, x).native_total == native_total(model, x)


class PhysicsInformed(nn.Module):
    """Takes d u / d x inside the forward, as a physics-informed loss does, of a leaf of its own (``leaf=True``);
    of its input, it is compared, since flops_vs_dispatch hands each run a copy (no leaf)."""

    def __init__(self, leaf: bool):
        super().__init__()
        self.net, self.leaf = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)), leaf

    def forward(self, x):
        x = x.detach().requires_grad_() if self.leaf else x
        u = self.net(x)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return du.pow(2).sum() - u.sum()


class FuncGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(2, 1)

    def forward(self, x):
        return torch.func.grad(lambda r: self.net(r).sum())(x)


@pytest.mark.parametrize("model", [PhysicsInformed(leaf=True), FuncGrad()], ids=["leaf", "func.grad"])
def test_flop_counter_modes_failure_on_a_gradient_taken_inside_the_forward_is_named(model):
    x = torch.randn(5, 2, requires_grad=True)[0]
    with pytest.raises(RuntimeError, match="_will_engine_execute_node"):  # torch's own, untraced: being named
        with FlopCounterMode(display=False):
            model(x)
    with pytest.raises(tl.errors.NativeToolFailed, match=r"takes a gradient itself .* tl.trace\(model, x\).flops"):
        tl.report.flops_vs_dispatch(model, x)
    assert int(tl.trace(model, x).flops) > 0


def test_sdpa_on_cpu_is_noted_and_counted_only_by_torchlens():
    class Attention(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    q = k = v = torch.randn(1, 2, 4, 8)
    result = tl.report.flops_vs_dispatch(Attention(), (q, k, v))
    attention = next(row for row in result.families if row["family"] == "attention")
    assert attention["native"] == 0 and attention["torchlens"] == 2 * 2 * 4 * 4 * (8 + 8)
    assert any("scaled_dot_product_attention on CPU" in note for note in result.notes)


def test_sdpa_inside_multi_head_attention_on_cpu_is_noted_though_its_projections_were_counted():
    # FlopCounterMode counted the in- and out-projections inside the multi_head_attention_forward call, and 0 for
    # its attention (the CPU SDPA kernel): the note named only the family ("counted by torchlens only"), not why.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    result = tl.report.flops_vs_dispatch(layer, torch.randn(2, 4, 16))
    rows = {row["family"]: row for row in result.families}
    assert rows["attention"]["native"] == 0 and rows["attention"]["torchlens"] == 2 * (2 * 2 * 4 * 4) * (8 + 8)
    assert rows["matmul"]["native"] > 0  # the projections, counted inside the same call
    assert any(note.startswith(SDPA_CPU_NOTE) and "multiheadattentionforward" in note for note in result.notes)


def test_an_op_neither_registry_has_a_formula_for_is_named_so_and_one_torch_counts_is_not():
    # nn.TransformerEncoder's inference path is one fused call per layer: torchlens has no formula for it and
    # FlopCounterMode counted nothing inside it, and the native column's 0 read as a figure.  tensordot has no
    # torchlens formula either, but FlopCounterMode counts the matrix product inside it.
    import real_models

    model, args, kwargs = real_models.build("transformer_encoder")
    model.eval()
    with torch.no_grad():
        result = tl.report.flops_vs_dispatch(model, args, kwargs)
    assert result.native_total == 0 and result.torchlens_unknown
    assert any("FlopCounterMode counted nothing inside _transformer_encoder_layer_fwd either" in note
               for note in result.notes)

    class Contraction(nn.Module):
        def forward(self, a, b):
            return torch.tensordot(a, b, dims=([1, 2], [0, 1])).sort(-1).values

    result = tl.report.flops_vs_dispatch(Contraction(), (torch.randn(3, 4, 5), torch.randn(4, 5, 6)))
    assert result.native_total == 2 * 3 * 4 * 5 * 6
    note = next(note for note in result.notes if "no torchlens formula" in note)
    assert "counted nothing inside sort either" in note and "tensordot either" not in note


def native_by_overload(model, *args, **kwargs) -> dict:
    """FlopCounterMode's own per-overload counts for one untraced forward."""
    with FlopCounterMode(display=False) as counter:
        model(*args, **kwargs)
    return {str(k).split(".", 1)[-1]: int(v) for k, v in counter.get_flop_counts().get("Global", {}).items()}


class BiasedAttention(nn.Module):
    """Attention with a learned additive mask, as T5's position bias: a mask that requires grad sends
    scaled_dot_product_attention down its math path, which FlopCounterMode counts as ``aten.bmm``."""

    def __init__(self, heads=2, length=4):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(heads, length, length))

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)


class WeightedAttention(nn.Module):
    """nn.MultiheadAttention returning its weights: torch computes attention with explicit bmm's."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=True)[0]


def test_attention_counted_natively_as_batched_products_is_in_the_native_attention_family():
    """FlopCounterMode's bmm's inside an attention call are the attention products: compared under
    attention, not matmul, and not called 'counted 0'."""
    q = k = v = torch.randn(1, 2, 4, 8)
    direct = native_by_overload(BiasedAttention(), q, k, v)
    assert direct == {"bmm": 2 * 2 * 4 * 4 * (8 + 8)}  # the math path, counted by torch as bmm
    result = tl.report.flops_vs_dispatch(BiasedAttention(), (q, k, v))
    rows = {row["family"]: row for row in result.families}
    assert rows["attention"]["native"] == direct["bmm"] == rows["attention"]["torchlens"]
    assert rows["matmul"]["native"] == 0
    assert not any("counts 0" in note for note in result.notes)
    assert any("batched matrix products" in note for note in result.notes)

    x = torch.randn(2, 5, 16)
    model = WeightedAttention().eval()
    direct = native_by_overload(model, x)
    result = tl.report.flops_vs_dispatch(model, x)
    rows = {row["family"]: row for row in result.families}
    assert rows["attention"]["native"] == direct["bmm"] == 2 * 2 * 2 * 5 * 5 * 16 == rows["attention"]["torchlens"]
    assert rows["matmul"]["native"] == direct["mm"] + direct["addmm"]


def test_corpus_attention_families_agree_where_torch_counts_the_math_path():
    """Swin's and Falcon's attention masks require grad, so torch (2.13) counts their attention as bmm's; both
    registries then count the same attention products, and the native matmul family keeps the rest.  Where
    this torch runs an attention through its CPU kernel instead (Falcon's, on torch 2.14), FlopCounterMode
    counts it 0, and the comparison says so rather than call the attention free."""
    import real_models

    for name in ("swin", "falcon"):
        model, args, kwargs = real_models.build(name)
        model.eval()
        real_models.seed(0)
        direct = native_by_overload(model, *args, **kwargs)
        real_models.seed(0)
        result = tl.report.flops_vs_dispatch(model, args, kwargs)
        rows = {row["family"]: row for row in result.families}
        assert rows["attention"]["torchlens"] > 0, name
        if "bmm" in direct or name == "swin":
            assert rows["attention"]["native"] == rows["attention"]["torchlens"] == direct["bmm"], name
        else:
            assert rows["attention"]["native"] == 0, name
            assert any(note.startswith(SDPA_CPU_NOTE) for note in result.notes), name
        assert rows["matmul"]["native"] == direct.get("mm", 0) + direct.get("addmm", 0), name


@pytest.mark.parametrize("name", ["transformer_encoder", "transformer_encoder_padded"])
def test_the_counted_run_keeps_torchs_fused_encoder_path(name):
    """Under no_grad nn.TransformerEncoder runs its fused kernel (nested tensors with a padding mask). The
    counted run must take that same path: FlopCounterMode's counts equal its counts of the model run
    alone, and the witness holds with a padding mask (the decomposed path fills padded rows otherwise)."""
    import real_models

    model, args, kwargs = real_models.build(name)
    model.eval()
    with torch.no_grad():
        direct = native_by_overload(model, *args, **kwargs)
        result = tl.report.flops_vs_dispatch(model, args, kwargs)
    assert {k.split(".", 1)[-1]: v for k, v in result.native_by_overload.items()} == direct
    assert result.witness["outputs_match"]


def test_root_row_of_a_function_or_bound_method_is_flop_counter_modes_whole_call():
    """A function or a bound ``forward`` is no module call FlopCounterMode's tracker can name: the root row
    is its whole-call total, and module rows it cannot name for certain (it names a module it meets first
    by bare class, merging instances) have no native figure rather than a false 0."""
    torch.manual_seed(0)
    lin, head = nn.Linear(4, 8), nn.Linear(8, 2)

    def function(x):
        return head(lin(x).relu())

    x = torch.randn(3, 4)
    for model in (function, nn.Sequential(lin, nn.ReLU(), head).forward):
        result = tl.report.flops_vs_dispatch(model, x)
        root, *others = result.modules
        assert root["module"].startswith("(root")
        assert root["native"] == native_total(model, x) == result.native_total > 0
        assert root["difference"] == root["native"] - root["torchlens"]
        assert others and all(row["native"] is None and row["difference"] is None for row in others)
        assert any("n/a" in note for note in result.notes) and "n/a" in str(result)


def test_dropout_in_train_mode_is_refused_and_nothing_is_left_changed():
    model, args, kwargs = zoo()["dropout_train"]
    rng = torch.get_rng_state()
    with pytest.raises(tl.TorchlensError, match="random numbers.*dropout.*model.eval"):
        tl.report.flops_vs_dispatch(model, args, kwargs)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training
    model.eval()
    assert tl.report.flops_vs_dispatch(model, args, kwargs).witness["outputs_match"]


def test_diverging_outputs_fail_the_witness():
    calls = []  # state outside the model, which no restoring reaches

    class Counter(nn.Module):
        """Returns a different value on each call: the two executions cannot be shown equivalent."""

        def forward(self, x):
            calls.append(None)
            return x * len(calls)

    with pytest.raises(tl.TorchlensError, match="different outputs"):
        tl.report.flops_vs_dispatch(Counter(), torch.randn(3))


def test_the_same_outputs_from_different_products_fail_the_witness():
    with pytest.raises(tl.TorchlensError, match="same outputs but called different matrix products"):
        tl.report.flops_vs_dispatch(_alternating_products(), torch.randn(3, 4))


def _alternating_products() -> nn.Module:
    """The same product, written as a matmul on one call and as an einsum on the next; the calls are counted
    outside the model, where no restoring reaches."""
    calls = []

    class Alternates(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            calls.append(None)
            return x @ self.weight if len(calls) % 2 else torch.einsum("ij,jk->ik", x, self.weight)

    return Alternates()


class _LinalgProducts(nn.Module):
    """A projection and a chain of products spelled through torch.linalg, whose builtins carry the namespace in
    their names (``linalg_matmul``, ``linalg_multi_dot``) where the traced ops do not."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(16, 8))
        self.chain = nn.ParameterList([nn.Parameter(torch.randn(8, 2)), nn.Parameter(torch.randn(2, 12))])

    def forward(self, x):
        return torch.linalg.multi_dot([torch.linalg.matmul(x, self.proj), *self.chain]).tanh()


def test_products_spelled_through_torch_linalg_pass_the_witness_and_agree():
    # The counted run named each product call by its builtin's name, so the witness saw other products than
    # the trace's and refused a model that ran one program twice.
    torch.manual_seed(0)
    model, x = _LinalgProducts().eval(), torch.randn(4, 16)
    result = tl.report.flops_vs_dispatch(model, x)
    matmul = next(row for row in result.families if row["family"] == "matmul")
    assert matmul["native"] == native_total(model, x) > 0 and matmul["difference"] == 0


def test_training_flags_buffers_and_rng_are_restored():
    model, args, kwargs = zoo()["batchnorm_train"]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    result = tl.report.flops_vs_dispatch(model, args, kwargs)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    assert int(result.torchlens_total) > 0 and result.native_total > 0


def test_unknown_ops_are_reported_on_the_torchlens_side_only():
    model = lambda x: torch.sort(x @ x.T, dim=-1).values  # noqa: E731
    result = tl.report.flops_vs_dispatch(model, torch.randn(4, 4))
    assert len(result.torchlens_unknown) == 1
    assert any("no torchlens formula (sort)" in note for note in result.notes)



class _ProductAfterWriteIntoView(nn.Module):
    """``h @ w`` reads ``h`` after a write through a view of it: matmul has a formula, which gets no shape there."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        h = x * 1
        h[:, :2].zero_()
        return torch.sort(h @ self.w, dim=1).values


def test_an_op_whose_formula_lacked_a_shape_is_not_said_to_have_no_formula():
    result = tl.report.flops_vs_dispatch(_ProductAfterWriteIntoView(), torch.randn(2, 4))
    product = next(label for label in result.torchlens_unknown if label.startswith("matmul"))
    assert len(result.torchlens_unknown) == 2
    assert any("1 captured op has no torchlens formula (sort)" in note for note in result.notes)
    unread = next(note for note in result.notes if "could not count that call" in note)
    assert product in unread and "view written in place" in unread
    assert not any("formula (matmul" in note or ", matmul" in note for note in result.notes)

class _LazyCache(nn.Module):
    """Builds a matrix on its first forward and keeps it in an attribute, as lazily built caches do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.cache = None

    def forward(self, x):
        if self.cache is None:
            g = torch.Generator().manual_seed(0)
            self.cache = torch.randn(16, 16, generator=g) @ torch.randn(16, 16, generator=g)
        return self.fc(x) @ self.cache


def test_both_executions_start_from_the_model_as_given():
    """The traced run builds the cache; the FlopCounterMode run must build it too, or its count lacks the
    building matmul while the witness (equal outputs) still passes; and the model ends as it was."""
    model = _LazyCache().eval()
    result = tl.report.flops_vs_dispatch(model, torch.randn(4, 16))
    assert result.difference == result.native_total - int(result.torchlens_total)
    assert result.native_total == 2 * 16 ** 3 + 2 * 4 * 16 * 16 + 2 * 4 * 16 * 16  # the cache, fc, x @ cache
    assert model.cache is None


def test_products_flop_counter_mode_has_no_formula_for_are_named_in_a_note():
    class Products(nn.Module):
        def forward(self, x, a, b, w, v):
            return torch.addbmm(x, a, b), w @ v, torch.mm(w, w)  # a matrix times a vector reaches aten.mv

    args = (torch.randn(3, 7), torch.randn(3, 3, 5), torch.randn(3, 5, 7), torch.randn(4, 4), torch.randn(4))
    result = tl.report.flops_vs_dispatch(Products(), args)
    assert result.native_total == native_total(Products(), *args) == 2 * 4 * 4 * 4  # the mm alone
    (note,) = [n for n in result.notes if n.startswith("FlopCounterMode counted 0 inside")]
    assert "addbmm, matmul calls" in note and "(here: addbmm_1_1:1, matmul_1_2:1; 2 of 3 products)" in note


def test_a_tolerance_that_is_no_number_is_refused_before_either_run():
    # rtol="x" failed inside torch.allclose ("argument 'rtol' must be float, not str"), after both forwards.
    model, args, kwargs = zoo()["mlp"]
    rng = torch.get_rng_state()
    with pytest.raises(TypeError, match=r"flops_vs_dispatch: rtol='x' is a str; a tolerance is a number, 0 or more"):
        tl.report.flops_vs_dispatch(model, args, kwargs, rtol="x")
    with pytest.raises(ValueError, match=r"flops_vs_dispatch: atol=-1 is negative; a tolerance is a number, 0 or more"):
        tl.report.flops_vs_dispatch(model, args, kwargs, atol=-1)
    # rtol=nan failed inside torch.allclose ("rtol must be greater than or equal to zero"), after both forwards.
    with pytest.raises(ValueError, match=r"flops_vs_dispatch: rtol=nan is not a number \(NaN\)"):
        tl.report.flops_vs_dispatch(model, args, kwargs, rtol=float("nan"))
    assert torch.equal(torch.get_rng_state(), rng)
    assert tl.report.flops_vs_dispatch(model, args, kwargs, rtol=0, atol=1e-5).witness["outputs_match"]


def test_a_trace_given_for_the_model_is_refused_saying_what_to_give():
    # flops_vs_dispatch(log) failed inside tl.trace: "tl.trace needs an nn.Module or a callable, got Trace".
    model, args, kwargs = zoo()["mlp"]
    log = tl.trace(model, args, kwargs)
    with pytest.raises(TypeError, match=r"flops_vs_dispatch takes the model and its inputs, not a Trace.*log\.flops"):
        tl.report.flops_vs_dispatch(log, args, kwargs)


def test_flops_vs_dispatch_reads_flop_counter_modes_module_tables_once(monkeypatch):
    # Before and after each matrix product the global counts were read through get_flop_counts(), which
    # copies the table of every module counted so far: products x modules work (a 4,000-block model spent
    # 4.5 s there, 19x the 1,000-block one).  The global table is read alone; the module tables once.
    from real_models import build

    model, args, kwargs = build("gpt2")
    copied = []
    real_get = FlopCounterMode.get_flop_counts

    def counted_get(self):
        copied.append(len(self.flop_counts))
        return real_get(self)

    monkeypatch.setattr(FlopCounterMode, "get_flop_counts", counted_get)
    result = tl.report.flops_vs_dispatch(model.eval(), args, kwargs)
    assert result.native_total > 0 and len(result.modules) > 10
    assert sum(copied) <= 2 * len(result.modules)


def test_a_torchscript_modules_flops_are_said_to_be_missing_from_the_torchlens_side():
    # Capture cannot see inside a TorchScript module, so its row read 0 on the torchlens side beside
    # FlopCounterMode's count, with no note, and no op left unknown to say why.
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(2, 8)
    for scripted in (False, True):
        model = nn.Sequential(nn.Linear(8, 8), torch.jit.script(block) if scripted else block, nn.Linear(8, 2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the trace's own warning about the TorchScript module
            result = tl.report.flops_vs_dispatch(model.eval(), x)
        row = next(r for r in result.modules if r["module"] == "1")
        assert (row["torchlens"] == 0) == scripted and row["native"] == 2 * 2 * 8 * 8
        assert any(note.startswith("TorchScript modules (1) ran their ops") for note in result.notes) == scripted


def _hubert(**draws):
    """A HuBERT in training mode with every dropout at p=0: what draws is ``draws`` alone."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.HubertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                       conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                                       num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
                                       attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, **draws)
    # Its attention as scaled_dot_product_attention, which torch tags as drawing and which draws nothing at
    # dropout_p=0.0: no suspect either (which attention transformers picks may depend on what ran before).
    config._attn_implementation = "sdpa"
    return transformers.HubertModel(config).train()


@pytest.mark.parametrize("draws, drawn_by", [(dict(layerdrop=0.5, mask_time_prob=0.0), r"\(rand_1_\d+:1"),
                                             (dict(layerdrop=0.0, mask_time_prob=0.5, mask_time_length=2),
                                              r"\(NumPy's numpy.random moved")],
                         ids=["layerdrop", "time mask"])
def test_a_random_draw_refusal_names_what_drew_not_a_dropout_with_p_zero(draws, drawn_by):
    # In training mode HuBERT draws its layer skips with torch.rand and its time masks with NumPy, which capture
    # cannot see; its dropouts at p=0 draw nothing, and naming them (they are the first ops torch tags as random)
    # hid both.
    with pytest.raises(tl.TorchlensError, match="random numbers") as refused:
        tl.report.flops_vs_dispatch(_hubert(**draws), torch.randn(1, 200))
    assert re.search(drawn_by, str(refused.value)) and "dropout" not in str(refused.value)


class _CompiledInside(nn.Module):
    """A torch.compile'd submodule between two plain products."""

    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(4, 4), nn.Linear(4, 2)
        self.middle = torch.compile(nn.Linear(4, 4), backend="eager")

    def forward(self, x):
        return self.last(self.middle(self.first(x)).relu())


def test_a_compiled_submodule_is_compared_with_its_products_named_on_the_native_side_alone():
    # The counted run listed the linear inside the compiled submodule, which capture records as one op with
    # nothing inside: the comparison refused the model as calling different products (2 against 3).
    model, x = _CompiledInside().eval(), torch.randn(3, 4)
    result = tl.report.flops_vs_dispatch(model, x)
    assert result.native_total == native_total(model, x) == 2 * 3 * 4 * (4 + 4 + 2)
    (compiled,) = result.torchlens_unknown
    assert compiled.startswith("compiled") and any("no torchlens formula (compiled)" in n for n in result.notes)
    matmul = next(row for row in result.families if row["family"] == "matmul")
    assert matmul["torchlens"] == 2 * 3 * 4 * (4 + 2) + 3 * (4 + 2)  # the two plain linears and their biases


def test_a_forward_flop_counter_mode_cannot_run_is_refused_naming_the_tool_and_the_count_that_remains():
    # A jagged nested input raised torch's bare "Multiple dispatch failed for ... sym_is_contiguous" TypeError.
    model = nn.Linear(4, 3).eval()
    x = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged)
    with pytest.raises(tl.TorchlensError, match=r"FlopCounterMode could not run this forward: .*jagged nested "
                                                r"tensor.*tl\.trace\(model, x\)\.flops"):
        tl.report.flops_vs_dispatch(model, x)
    assert tl.trace(model, x).flops.unknown == ("linear_1_1:1",)  # a ragged size: unknown, and said so
