"""Analytic FLOPs per captured op: the registry, its formulas, and the totals a trace and its module calls read
(the side-by-side comparison with FlopCounterMode is tests/test_flops_vs_dispatch.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import torchlens as tl
from torchlens.report import flops as registry
from accel_paths import PATHS, on_path
from zoo import zoo


def native_total(model, *args):
    with FlopCounterMode(display=False) as counter:
        model(*args)
    return counter.get_total_flops()


# ----- the registry -------------------------------------------------------------------------------------
def test_report_flops_is_the_registry_module_and_trace_flops_uses_it():
    assert tl.report.flops is registry
    assert callable(tl.report.op_flops) and callable(tl.report.total_flops)
    model = nn.Linear(8, 4)
    log = tl.trace(model, torch.randn(3, 8))
    assert int(log.flops) == int(tl.report.total_flops(log)) == tl.report.op_flops(log["linear_1_1:1"])


def test_importing_the_comparison_module_does_not_shadow_the_function():
    import importlib

    importlib.import_module("torchlens.report.flops_compare")
    importlib.import_module("torchlens.debug.hotspots")
    assert callable(tl.report.flops_vs_dispatch) and callable(tl.debug.hot_path)
    result = tl.report.flops_vs_dispatch(nn.Linear(3, 2, bias=False).eval(), torch.randn(1, 3))
    assert result.difference == 0


@pytest.mark.parametrize("bias", [False, True])
def test_linear_and_conv_match_flop_counter_mode_up_to_bias(bias):
    model = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1, bias=bias), nn.Flatten(),
                          nn.Linear(5 * 6 * 6, 7, bias=bias)).eval()
    x = torch.randn(2, 3, 6, 6)
    log = tl.trace(model, x)
    # FlopCounterMode does not count bias additions; torchlens adds one per output element.
    bias_adds = sum(math.prod(op.shape) for op in log.ops if op.kind == "op" and op.params and bias)
    assert int(log.flops) - native_total(model, x) == bias_adds
    assert log.flops.complete



class ScoresIntoABuffer(nn.Module):
    """Attention scores written into an uninitialized buffer with ``beta=0``, which torch never reads, beside the
    same product added to a bias (``beta`` 1)."""

    def forward(self, q, k, bias):
        scores = torch.baddbmm(torch.empty(2, 3, 5), q, k, beta=0.0, alpha=0.5)
        outer = bias[0].addr(q[0, :, 0], k[0, 0], beta=0)
        return scores, torch.baddbmm(bias, q, k), bias[0].addmm(q[0], k[0], beta=0), outer


def test_a_product_that_reads_no_input_with_beta_zero_counts_no_adds_of_it():
    q, k, bias = torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.randn(2, 3, 5)
    log = tl.trace(ScoresIntoABuffer(), (q, k, bias))
    counts = {}
    for op in log.ops:
        if op.func_name in ("baddbmm", "addmm", "addr"):
            counts.setdefault(op.func_name, []).append(tl.report.op_flops(op))
    (buffered, added), (method,), (outer,) = counts["baddbmm"], counts["addmm"], counts["addr"]
    product = native_total(torch.bmm, q, k)
    assert product == 2 * 2 * 3 * 5 * 4
    assert (buffered, added, method) == (product, product + bias.numel(), product // 2)
    assert outer == 3 * 5  # a multiply per element of the outer product, and no add

def test_matmul_family_spellings_share_one_formula():
    class Spellings(nn.Module):
        def forward(self, a, b):
            # b.__rmatmul__(a) is a @ b: its inner size is b's first dimension, not its last
            return a @ b, torch.matmul(a, b), torch.mm(a, b), a.matmul(b), b.__rmatmul__(a)

    a, b = torch.randn(4, 6), torch.randn(6, 3)
    log = tl.trace(Spellings(), (a, b))
    counts = {tl.report.op_flops(op) for op in log.ops if op.kind == "op"}
    assert counts == {native_total(lambda p, q: p @ q, a, b)}


def test_elementwise_aliases_and_in_place_spellings_count_per_output_element():
    class Adds(nn.Module):
        def forward(self, x, y):
            z = x + y
            z = torch.add(z, y)
            z.add_(1.0)
            z += y
            return (2.0 + z).relu()

    x, y = torch.randn(3, 5), torch.randn(3, 5)
    log = tl.trace(Adds(), (x, y))
    ops = [op for op in log.ops if op.kind == "op"]
    assert len(ops) == 6
    assert all(tl.report.op_flops(op) == x.numel() for op in ops)


def test_sdpa_formula_counts_both_matrix_products():
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
    log = tl.trace(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (q, k, v))
    op = next(op for op in log.ops if op.kind == "op")
    batch, length, source = 2 * 3, 5, 7
    assert tl.report.op_flops(op) == 2 * batch * length * source * 8 + 2 * batch * length * source * 4
    assert registry.op_flops_by_family(op) == {"attention": tl.report.op_flops(op)}


def test_chained_batched_and_grouped_products_count_every_multiply_add():
    a, b, c = torch.randn(3, 3, 5), torch.randn(3, 5, 7), torch.randn(7, 2)
    x = torch.randn(3, 7)
    chain = tl.trace(lambda p, q, r: torch.linalg.multi_dot([p, q, r]), (a[0], b[0], c))
    (op,) = [op for op in chain.ops if op.kind == "op"]
    # torch multiplies the chain in its cheapest order, as two mm calls that FlopCounterMode counts.
    assert tl.report.op_flops(op) == native_total(lambda p, q, r: torch.linalg.multi_dot([p, q, r]), a[0], b[0], c)
    for ends in ((torch.randn(5), b[0], c), (a[0], b[0], c[:, 0].clone())):  # a vector at either end
        vector = tl.trace(lambda p, q, r: torch.linalg.multi_dot([p, q, r]), ends)
        (op,) = [op for op in vector.ops if op.kind == "op"]
        assert tl.report.op_flops(op) == native_total(lambda p, q, r: torch.linalg.multi_dot([p, q, r]), *ends)
    summed = tl.trace(lambda x, a, b: torch.addbmm(x, a, b), (x, a, b))
    (op,) = [op for op in summed.ops if op.kind == "op"]
    as_bmm = native_total(lambda a, b: torch.bmm(a, b), a, b)
    assert tl.report.op_flops(op) == as_bmm + x.numel()  # the products, then one add of the input per element
    left, right = torch.ones(24, 8, dtype=torch.bfloat16), torch.ones(3, 8, 16, dtype=torch.bfloat16)
    offsets = torch.tensor([8, 16, 24], dtype=torch.int32)
    grouped = tl.trace(lambda p, q, o: torch._grouped_mm(p, q, offs=o), (left, right, offsets))
    (op,) = [op for op in grouped.ops if op.kind == "op"]
    assert tl.report.op_flops(op) == native_total(lambda p, q: p.float() @ q[0].float(), left, right)


class _Contractions(nn.Module):
    """tensordot with each spelling of its dims, and chain_matmul with parameters around the input."""

    def __init__(self):
        super().__init__()
        self.cube, self.first, self.last = (nn.Parameter(torch.randn(*s)) for s in ((3, 4, 5), (2, 5), (4, 7)))

    def forward(self, x):
        pair = torch.tensordot(x, self.cube, dims=([-2, 2], [0, 1]))  # x is (2, 3, 4): a (2, 5) result
        last = torch.tensordot(x, self.cube[0], dims=1).sum() + torch.tensordot(x, self.cube, 2).sum()
        return pair.sum() + last + torch.chain_matmul(self.first, pair.T @ pair[:, :4], self.last).sum()


@pytest.mark.parametrize("compiled", PATHS)
def test_tensordot_and_chain_matmul_count_the_products_torch_runs(compiled):
    # Neither had a formula: their FLOPs were unknown, where FlopCounterMode counts the products inside them.
    model, x = _Contractions(), torch.randn(2, 3, 4)
    with on_path(compiled):
        log = tl.trace(model, x)
    ops = [op for op in log.ops if op.func_name in ("tensordot", "chain_matmul")]
    assert len(ops) == 4 and all(registry.op_flops_by_family(op).keys() == {"matmul"} for op in ops)
    products = [op for op in log.ops if registry.op_flops_by_family(op).get("matmul")]
    assert sum(tl.report.op_flops(op) for op in products) == native_total(model, x) and not log.flops.unknown


class _ChainAroundTheInput(nn.Module):
    """A multi_dot chain whose first and last matrices are parameters and whose middle one is the input."""

    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(4, 6))

    def forward(self, x):
        return torch.linalg.multi_dot([self.first, x, self.last])


@pytest.mark.parametrize("compiled", PATHS)
def test_a_chain_of_parameters_and_inputs_is_read_in_its_order(compiled):
    # Parameters are recorded apart from the parents, and the list's shapes were read parents first: the chain
    # was counted as (3, 4) @ (2, 3) @ (4, 6), 180 where torch multiplies (2, 3) @ (3, 4) @ (4, 6).
    model, x = _ChainAroundTheInput(), torch.randn(3, 4)
    with on_path(compiled):
        log = tl.trace(model, x)
    (op,) = [op for op in log.ops if op.kind == "op"]
    assert tl.report.op_flops(op) == native_total(model, x)


def test_data_movement_and_selection_count_zero_and_named_aliases_count_as_their_op():
    class Moves(nn.Module):
        def forward(self, x):
            return (x.as_strided((2, 2), (1, 1)), torch.nonzero(x > 0), torch.repeat_interleave(x, 2, dim=0),
                    torch.multiply(x, 2), torch.subtract(x, 1), torch.diff(x, dim=1))

    x = torch.randn(3, 7)
    log = tl.trace(Moves(), x)
    counts = {op.func_name: tl.report.op_flops(op) for op in log.ops if op.kind == "op"}
    assert counts == {"as_strided": 0, "gt": 21, "nonzero": 0, "repeat_interleave": 0, "multiply": 21,
                      "subtract": 21, "diff": 18}
    assert log.flops.complete
    second = tl.trace(lambda x: torch.diff(x, n=2, dim=1), x)
    assert not second.flops.complete  # higher differences are not modelled: unknown, not a guess


def test_unknown_ops_are_listed_never_counted_as_zero():
    class Sorts(nn.Module):
        def forward(self, x):
            values, _ = torch.sort(x, dim=-1)
            return F.interpolate(values.unsqueeze(0), scale_factor=2.0) * 3

    log = tl.trace(Sorts(), torch.randn(4, 6))
    unknown = [op.label for op in log.ops if op.kind == "op" and tl.report.op_flops(op) is None]
    assert {log[label].func_name for label in unknown} == {"sort", "interpolate"}
    total = log.flops
    assert set(total.unknown) == set(unknown) and not total.complete
    assert int(total) == sum(tl.report.op_flops(op) or 0 for op in log.ops)  # only the mul is counted
    assert "unknown" in repr(total) and unknown[0] in repr(total)


def test_a_multi_output_call_is_counted_once_on_its_first_output():
    log = tl.trace(lambda x: torch.max(x, dim=1), torch.randn(4, 9))
    values, indices = [op for op in log.ops if op.kind == "op"]
    assert tl.report.op_flops(values) == 36 and tl.report.op_flops(indices) == 0


def test_pooling_formulas_follow_torch_windows():
    x = torch.randn(1, 2, 7, 5)
    log = tl.trace(lambda x: (F.max_pool2d(x, 3, stride=2), F.adaptive_avg_pool2d(x, (3, 2))), x)
    pool, adaptive = [op for op in log.ops if op.kind == "op"]
    assert tl.report.op_flops(pool) == math.prod(pool.shape) * 9
    # Adaptive windows overlap when sizes do not divide: count the elements each window really reads.
    rows = [(math.floor(i * 7 / 3), math.ceil((i + 1) * 7 / 3)) for i in range(3)]
    cols = [(math.floor(j * 5 / 2), math.ceil((j + 1) * 5 / 2)) for j in range(2)]
    expected = 2 * sum((r1 - r0) * (c1 - c0) for r0, r1 in rows for c0, c1 in cols)
    assert tl.report.op_flops(adaptive) == expected


def test_lp_pooling_reads_its_kernel_size_not_its_norm_type():
    """``lp_pool2d(input, norm_type, kernel_size)``: each output element reads one kernel window, counted
    here by torch's own ``unfold`` (one column entry per element read)."""
    x = torch.randn(2, 3, 9, 9)
    log = tl.trace(nn.LPPool2d(2, kernel_size=3), x)
    (pool,) = [op for op in log.ops if op.kind == "op"]
    assert tl.report.op_flops(pool) == F.unfold(x, 3, stride=3).numel()
    assert log.flops.complete


def test_module_call_totals_are_inclusive_and_sum_their_ops():
    model, args, kwargs = zoo()["small_cnn"]
    log = tl.trace(model, args, kwargs)
    per_call = registry.module_call_flops(log)
    assert set(per_call) == {c.label for c in log.module_calls}
    for call in log.module_calls:
        own = sum(tl.report.op_flops(log[label]) for label in call.op_labels)
        assert int(per_call[call.label]) == own
    assert int(per_call["features:1"]) >= int(per_call["features.4:1"]) + int(per_call["features.0:1"])
    top_level = sum(int(per_call[c.label]) for c in log.module_calls if c.parent is None)
    assert top_level == int(log.flops) - sum(tl.report.op_flops(op) for op in log.ops if op.module is None)


def test_flops_survive_cleanup_unchanged():
    model, args, kwargs = zoo()["transformer_fastpath"]
    log = tl.trace(model, args, kwargs)
    before = [tl.report.op_flops(op) for op in log.ops]
    fresh = tl.trace(model, args, kwargs)
    fresh.cleanup()  # FLOPs never asked for before cleanup: they are derived on the way out
    assert [tl.report.op_flops(op) for op in fresh.ops] == before
    assert int(fresh.flops) == int(log.flops) > 0


def test_deep_capture_counts_what_the_shallow_attention_formula_counts():
    """Deep capture records the torch calls inside ``multi_head_attention_forward``; their formulas must
    add up to the one-op formula of the shallow trace, family by family."""
    model, args, kwargs = zoo()["transformer_fastpath"]
    shallow, deep = tl.trace(model, args, kwargs), tl.trace(model, args, kwargs, deep=True)
    assert len(deep) > len(shallow) and deep.flops.complete and shallow.flops.complete
    assert int(deep.flops) == int(shallow.flops)
    assert registry.family_totals(deep) == registry.family_totals(shallow)


def test_the_torch_calls_inside_normalize_all_have_formulas():
    model, args, kwargs = zoo()["functional"]
    deep = tl.trace(model, args, kwargs, deep=True)
    assert deep.flops.complete and deep.flops.counted > tl.trace(model, args, kwargs).flops.counted


def test_op_flops_refuses_a_module_call_whose_index_counts_calls_not_ops():
    # op_flops(log.module_calls[1]) read op 1's FLOPs: the ReLU call answered with the Linear's 42.
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    log = tl.trace(model, torch.randn(2, 3))
    with pytest.raises(TypeError, match=r"op_flops takes an op of a trace .* got ModuleCall; for a module call's "
                                        r"FLOPs read log\.summary\(\)"):
        tl.report.op_flops(log.module_calls[1])
    # module_call_flops(model) and family_totals(model) failed on "'Sequential' object has no attribute '_flops_col'".
    for reader in (tl.report.total_flops, registry.module_call_flops, registry.family_totals):
        with pytest.raises(TypeError, match=rf"{reader.__name__} takes a Trace .* got Sequential: trace the model"):
            reader(model)
    assert tl.report.op_flops(log["linear_1_1"]) == 42 and log.summary()["1:1"]["flops"] == 2 * 3


def test_op_flops_of_a_layer_that_ran_several_passes_says_to_give_one_pass():
    # A layer of two passes failed with an AttributeError about its per-pass 'index', which op_flops never named.
    linear = nn.Linear(3, 3)
    log = tl.trace(lambda x: linear(linear(x)), torch.randn(2, 3), root=linear)
    layer = log["linear_1_1"]
    assert layer.num_passes == 2
    for reader in (tl.report.op_flops, registry.op_flops_by_family):
        with pytest.raises(ValueError, match=r"layer linear_1_1 ran 2 passes, .* give one pass "
                                             r"\(log\['linear_1_1:1'\]\)"):
            reader(layer)
    per_pass = [tl.report.op_flops(op) for op in layer.ops]
    assert per_pass == [2 * 2 * 3 * 3 + 2 * 3] * 2 and sum(per_pass) == int(log.flops)
    with pytest.raises(TypeError, match="op_flops takes an op of a trace .* got ModuleCall"):
        registry.op_flops_by_family(log.module_calls[0])


def test_fourier_transforms_their_real_part_and_weight_norm_have_formulas_on_real_models():
    # FNet's token mixing (fftn, then .real) and the weight-normed positional convolution of wav2vec2 (HuBERT's
    # and Encodec's too) had no formula, so those models' totals read incomplete.
    pytest.importorskip("transformers")
    from transformers import FNetConfig, FNetModel

    from real_models import build

    fnet = FNetModel(FNetConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                max_position_embeddings=16)).eval()
    log = tl.trace(fnet, torch.randint(0, 64, (2, 8)))
    assert log.flops.complete
    (fftn,) = [op for op in log.ops if op.func_name == "fftn"]
    assert tl.report.op_flops(fftn) == 2 * 5 * 256 * 8  # two sequences of 8 x 32 = 256 points: 5 n log2 n each
    assert {tl.report.op_flops(op) for op in log.ops if op.func_name == "real"} == {0}  # a view
    model, args, kwargs = build("wav2vec2")
    log = tl.trace(model.eval(), args, kwargs)
    (norm,) = [op for op in log.ops if op.func_name == "_weight_norm"]
    assert log.flops.complete and norm.shape == (32, 16, 8)
    assert tl.report.op_flops(norm) == 3 * norm.numel + 8  # square, add and multiply per weight; a divide per norm


def test_fft_variants_count_their_sizes_their_real_side_and_their_scaling():
    def transforms(x):
        y = torch.fft.fft(x, n=16, norm="ortho")  # padded to 16 points, scaled both ways by "ortho"
        return (y, torch.fft.ifft(y), torch.fft.rfft(x), torch.fft.irfft(torch.fft.rfft(x), n=8),
                torch.fft.rfftn(x, s=(6, 10)), torch.fft.ihfft2(x), torch.fft.fft2(x, dim=(0, 2)),
                torch.fft.fftshift(x), torch.imag(y))

    log = tl.trace(transforms, torch.randn(2, 4, 8))
    counts = {op.label: tl.report.op_flops(op) for op in log.ops if op.kind == "op"}
    # 5 n log2 n per complex transform, half with a real side, plus a multiply per real output value scaled.
    assert counts == {"fft_1_1:1": 5 * 8 * 16 * 4 + 2 * 128, "ifft_1_2:1": 5 * 8 * 16 * 4 + 2 * 128,
                      "rfft_1_3:1": 2.5 * 8 * 8 * 3, "rfft_2_4:1": 2.5 * 8 * 8 * 3,
                      "irfft_1_5:1": 2.5 * 8 * 8 * 3 + 64, "rfftn_1_6:1": round(2.5 * 2 * 60 * math.log2(60)),
                      "ihfft2_1_7:1": 2.5 * 2 * 32 * 5 + 2 * 40, "fft2_1_8:1": 5 * 4 * 16 * 4,
                      "fftshift_1_9:1": 0, "imag_1_10:1": 0}
    assert log.flops.complete


class MatmulAfterAViewWrite(nn.Module):
    """Zeroes two columns of ``h`` through a view, then multiplies ``h`` (3x8) by an 8x8 weight."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        h = x.clone()
        h[:, :2].zero_()
        return h @ self.w + (x @ self.w)


@pytest.mark.parametrize("compiled", PATHS)
def test_an_op_reading_a_tensor_after_a_write_through_its_view_is_unknown_not_counted_from_the_view(compiled):
    # The matmul's parent is the write, whose output is the 3x2 view: its FLOPs were counted as 2*3*2*8, a
    # quarter of what it computed. No record holds h's shape as read, so the op is unknown.
    with on_path(compiled):
        log = tl.trace(MatmulAfterAViewWrite(), torch.randn(3, 8))
    after_write, plain = [op for op in log.ops if op.type == "matmul"]
    assert after_write.parents == ["zero_1_3:1"] and tl.report.op_flops(after_write) is None
    assert tl.report.op_flops(plain) == 2 * 3 * 8 * 8
    assert log.flops.unknown == (after_write.label,)


def test_flops_vs_dispatch_pairs_a_product_left_unknown_with_the_counted_one():
    # The product left unknown was taken for a function with no formula, so the counted run's watch left every
    # call of that function out of its products, and the comparison refused the model as running another
    # program ("2 against 0").
    result = tl.report.flops_vs_dispatch(MatmulAfterAViewWrite(), torch.randn(3, 8))
    matmul = next(row for row in result.families if row["family"] == "matmul")
    assert (matmul["torchlens"], matmul["native"]) == (2 * 3 * 8 * 8, 2 * (2 * 3 * 8 * 8))
    assert len(result.torchlens_unknown) == 1


def test_a_torchscript_module_makes_the_totals_around_it_incomplete(tmp_path):
    # Capture cannot see the ops a TorchScript module runs, so none of them is counted and none is an unknown
    # op either: the total read complete, a plausible wrong count, with only the trace's caveat saying otherwise.
    torch.manual_seed(0)
    scripted = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    model = nn.Sequential(nn.Linear(8, 8), scripted, nn.Linear(8, 2)).eval()
    with pytest.warns(UserWarning, match="TorchScript"):
        log = tl.trace(model, torch.randn(2, 8))
    total = log.flops
    assert int(total) == (2 * 2 * 8 * 8 + 2 * 8) + (2 * 2 * 8 * 2 + 2 * 2)  # the two Linears outside it, biases too
    assert total.unknown == () and total.hidden == ("1",) and not total.complete
    assert "not counted inside TorchScript modules 1" in str(total)
    per_call = registry.module_call_flops(log)
    assert [per_call[label].complete for label in ("0:1", "1:1", "2:1")] == [True, False, True]
    assert "TorchScript modules whose ops go uncounted" in str(log.summary())
    loaded = tl.load(log.save(tmp_path / "t"))  # told by the class name once no model is held
    assert loaded.flops.hidden == ("1",) and not loaded.flops.complete


def test_sdpa_with_broadcast_batch_counts_every_output_batch_as_flop_counter_mode_does():
    # One query batch against three key/value batches: torch broadcasts, computing three batches of attention.
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(6, 5, requires_grad=True))

    log = tl.trace(sdpa, (q, k, v))
    (op,) = [op for op in log.ops if op.func_name == "scaled_dot_product_attention"]
    assert op.shape == (3, 2, 6, 8)
    # A mask that requires grad takes the math path, whose batched products FlopCounterMode counts.
    assert tl.report.op_flops(op) == native_total(sdpa, q, k, v) == 2 * 3 * 2 * 6 * 5 * (8 + 8)


def test_ops_that_only_place_values_count_zero_and_a_scatter_that_combines_stays_unknown():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # WavLM's gated relative position bias broadcasts its gate with broadcast_to: a view, no arithmetic.
    config = transformers.WavLMConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                      conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_buckets=8,
                                      max_bucket_distance=16, num_conv_pos_embeddings=8,
                                      num_conv_pos_embedding_groups=2)
    log = tl.trace(transformers.WavLMModel(config).eval(), torch.randn(1, 200))
    assert any(op.func_name == "broadcast_to" for op in log.ops) and log.flops.complete

    def placed(x, i):
        grid = torch.meshgrid(x, x, indexing="ij")[0]
        return grid.scatter(0, i, x[None].expand(2, -1)), grid.scatter(0, i, 2.0, reduce="add")

    x, i = torch.randn(3), torch.tensor([[0, 1, 2], [2, 0, 1]])
    log = tl.trace(placed, (x, i))
    assert all(tl.report.op_flops(op) == 0 for op in log.ops if op.func_name in ("meshgrid", "expand"))
    placing, adding = [op for op in log.ops if op.func_name == "scatter"]
    assert tl.report.op_flops(placing) == 0
    assert tl.report.total_flops(log).unknown == (adding.label,)  # its adds are not modelled: unknown, not 0


@pytest.mark.parametrize("train", [False, True])
def test_torch_dropout_reads_its_train_keyword(train):
    # torch.dropout spells F.dropout's training= as train=: with train=False it drops nothing, like eval mode.
    x = torch.randn(4, 5)
    log = tl.trace(lambda t: torch.dropout(t, 0.5, train=train), x)
    (op,) = [op for op in log.ops if op.kind == "op"]
    assert tl.report.op_flops(op) == (x.numel() if train else 0)
