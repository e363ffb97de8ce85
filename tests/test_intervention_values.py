"""Interventions on values that are not plain float tensors: an integer value between float ones, a float
value patched from a wider-dtype run, and sparse, nested and quantized values.  Each is edited as a
hand-written hook would edit it, in its own dtype and layout, or refused naming the helper and the value."""

from __future__ import annotations

import copy
import os
import re
import sys
import warnings

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from untouched import assert_clean_process  # noqa: E402


class Retrieve(nn.Module):
    """Token ids chosen by argmax and looked up again: an integer value between float ones."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 10)

    def forward(self, ids):
        chosen = self.head(self.embed(ids)).argmax(-1)
        return self.embed(chosen).sum(-1)


@pytest.mark.parametrize("action, named", [
    (tl.mean_ablate(), "mean_ablate"), (tl.noise(1.0), "noise"),
    (tl.steer(torch.tensor([0.6, 0.6, 0.6])), "steer's vector"), (torch.tensor([[1.7, 2.2, 3.9]]), "replacement")])
def test_a_helper_that_would_round_into_an_integer_value_is_refused(action, named):
    # The mean (2.5), the noise, a float steering vector or a float tensor were cast into the int64 ids
    # (a mean 2.5 read 2, 1.7 read 1) and the trace showed a value nobody asked for; noise raised torch's
    # "normal_kernel_cpu not implemented for 'Long'" naming no site.
    model, ids = Retrieve(), torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(tl.InterventionError, match=f"{named}.*argmax_1_3:1.*torch.int64"):
        tl.trace(model, ids, intervene={"argmax_1_3:1": action})
    assert_clean_process()
    kept = tl.trace(model, ids, intervene={"argmax_1_3:1": torch.tensor([[1, 2, 3]])})
    assert torch.equal(kept["argmax_1_3:1"].activation, torch.tensor([[1, 2, 3], [1, 2, 3]]))


_AT = r"value\[at\] of shape \(2,\), in "  # with at=, the part a tensor argument broadcasts to is named too


@pytest.mark.parametrize("action, part", [(tl.scale(torch.tensor([1.0, 2.0])), ""), (tl.noise(torch.ones(5)), ""),
                                          (tl.clamp(min=torch.zeros(4)), ""),
                                          (tl.scale(torch.ones(3), at=(slice(None), 1)), _AT)],
                         ids=["scale", "noise", "clamp", "scale at"])
def test_a_helper_tensor_argument_that_does_not_fit_the_value_is_named_with_the_site(action, part):
    # torch's "The size of tensor a (3) must match the size of tensor b (2)" came through, naming no helper or site;
    # with at=, the message named the whole value's shape, to which the argument need not broadcast.
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    says = rf"^{type(action).__name__}\(.*\) at 0:1: torch could not compute it on {part}this value of shape \(2, 3\) "
    with pytest.raises(tl.InterventionError, match=says + r"\(RuntimeError: .*broadcast"):
        tl.trace(model, torch.randn(2, 4), intervene={"0": action})
    assert_clean_process()


def test_a_float_value_patched_from_a_wider_float_run_is_rounded_as_a_hook_rounds_it():
    # Within a kind the cast stays: a float32 run's value patched into a bfloat16 run reads as the
    # bfloat16 number a forward hook copying it there would make.
    model, x = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 4)
    clean = tl.trace(model, x)
    half = copy.deepcopy(model).to(torch.bfloat16)
    patched = tl.trace(half, x.bfloat16(), intervene={"0": tl.patch_from(clean)})
    handle = half[0].register_forward_hook(lambda m, a, out: clean["0"].activation.to(out.dtype))
    try:
        assert torch.equal(patched.output, half(x.bfloat16()))
    finally:
        handle.remove()


class SparseGraph(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, adj, x):
        return self.fc(torch.sparse.mm(adj * 2, x))


def test_a_sparse_value_is_patched_and_replaced_in_its_layout_or_refused_by_name():
    # patch_from at a sparse site raised "a value of shape (3, 3) cannot replace one of shape (3, 3)" (no
    # broadcast for sparse tensors); a dense replacement made the value strided unnoticed; clamp raised
    # torch's "Could not run 'aten::clamp' with arguments from the 'SparseCPU' backend".
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adj = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [1, 2, 0]]), torch.ones(3), (3, 3)).coalesce()
    model, x = SparseGraph(), torch.randn(3, 4)
    patched = tl.trace(model, (adj, x), intervene={"mul_1_1:1": tl.patch_from(tl.trace(model, (adj * 3, x)))})
    assert patched["mul_1_1:1"].activation.layout == torch.sparse_coo
    assert torch.equal(patched.output, model(adj * 3, x))
    ones = torch.ones(3, 3)
    replaced = tl.trace(model, (adj, x), intervene={"mul_1_1:1": ones})
    assert replaced["mul_1_1:1"].activation.layout == torch.sparse_coo
    assert torch.equal(replaced.output, model.fc(torch.sparse.mm(ones.to_sparse(), x)))
    with pytest.raises(tl.InterventionError, match="strided tensor for a sparse_coo value.*keep the layout"):
        tl.trace(model, (adj, x), intervene={"mul_1_1:1": lambda t, op: t.to_dense()})
    with pytest.raises(tl.InterventionError, match=r"clamp\(min=0, max=1\) at mul_1_1:1: .*sparse_coo value"):
        tl.trace(model, (adj, x), intervene={"mul_1_1:1": tl.clamp(0, 1)})
    assert_clean_process()


def test_a_helper_torch_cannot_compute_on_a_complex_value_is_refused_naming_the_site():
    # tl.clamp at a complex value raised torch's bare "clamp is not supported for complex types" from inside
    # the forward, naming neither the helper nor the site.
    def spectral_gain(x):
        return torch.fft.irfft(torch.fft.rfft(x) * 2, n=8)

    x = torch.randn(3, 8)
    with pytest.raises(tl.InterventionError, match=r"clamp\(min=0, max=1\) at rfft_1_1:1: .*complex64 value"):
        tl.trace(spectral_gain, x, intervene={"rfft_1_1:1": tl.clamp(0, 1)})
    scaled = tl.trace(spectral_gain, x, intervene={"rfft_1_1:1": tl.scale(0.5)})  # helpers with a kernel still apply
    assert torch.equal(scaled.output, torch.fft.irfft(torch.fft.rfft(x) * 0.5 * 2, n=8))
    assert_clean_process()


def test_a_nested_value_is_ablated_and_patched_component_by_component():
    # Every action at a strided nested value raised torch's "NestedTensorImpl doesn't support sizes" (the
    # checks of the new value read .shape), and patching between two jagged runs was refused for ragged
    # sizes (j1, j2) that differ by name only.
    # Each result is compared with the untraced nested forward it stands for: a nested Linear may round
    # differently from the same Linear on each component alone, depending on the CPU's kernels.
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    parts = [torch.randn(3, 8), torch.randn(5, 8)]
    for layout in (torch.strided, torch.jagged):
        nt = torch.nested.nested_tensor(parts, layout=layout)
        doubled = torch.nested.nested_tensor([p * 2 for p in parts], layout=layout)
        with torch.no_grad():
            zeroed_untraced = model[2](model[1](torch.zeros_like(model[0](nt))))
            doubled_untraced = model(doubled)
        zeroed = tl.trace(model, nt, intervene={"0": tl.zero_ablate()})
        for got, expected in zip(zeroed.output.unbind(), zeroed_untraced.unbind(), strict=True):
            assert torch.equal(got, expected)
        assert zeroed["0"].shape == (2, None, 8)
        other = tl.trace(model, doubled)
        patched = tl.trace(model, nt, intervene={"0": tl.patch_from(other)})
        for got, expected in zip(patched.output.unbind(), doubled_untraced.unbind(), strict=True):
            assert torch.equal(got, expected)
        assert not torch.equal(patched.output.unbind()[0], tl.trace(model, nt).output.unbind()[0])
        with pytest.raises(tl.InterventionError, match=r"noise\(std=0.1\) at 0:1: .*nested"):
            tl.trace(model, nt, intervene={"0": tl.noise(0.1)})
    assert_clean_process()


def _quantized_linear():
    """A Linear quantized statically (eager mode): its output is a quint8 tensor standing for real numbers."""
    import torch.ao.quantization as tq

    class Quantized(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.fc, self.dequant = tq.QuantStub(), nn.Linear(8, 4), tq.DeQuantStub()

        def forward(self, x):
            return self.dequant(self.fc(self.quant(x)))

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Quantized().eval()
        model.qconfig = tq.get_default_qconfig("fbgemm")
        prepared = tq.prepare(model)
        prepared(torch.randn(16, 8))
        return tq.convert(prepared)


def test_a_quantized_value_is_patched_or_refused_naming_the_helper():
    # zero_ablate and scale at a quantized Linear's output raised torch's "Could not run 'aten::zero_' with
    # arguments from the 'QuantizedCPU' backend" and "promoteTypes with quantized numbers is not handled yet".
    quantized = _quantized_linear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x, other = torch.randn(3, 8), tl.trace(quantized, torch.randn(3, 8))
        patched = tl.trace(quantized, x, intervene={"fc": tl.patch_from(other)})
        assert torch.equal(patched.output, quantized.dequant(other["fc"].activation))
        for action, named in ((tl.zero_ablate(), r"zero_ablate\(\)"), (tl.scale(2.0), r"scale\(2.0\)")):
            with pytest.raises(tl.InterventionError, match=named + r" at fc:1: .*quantized \(quint8\) value"):
                tl.trace(quantized, x, intervene={"fc": action})
    assert_clean_process()


def test_a_quantized_value_takes_a_fraction_as_the_real_number_it_stands_for():
    # A quantized value was taken for indices, counts or a mask: tl.clamp(0.1, 0.5), which torch computes on it, was
    # refused saying to give a whole number, and scale(0.5), noise and mean_ablate were refused the same way, though
    # no whole number or float value would have helped them.
    quantized, x = _quantized_linear(), torch.randn(3, 8)
    expected = quantized.dequant(torch.clamp(quantized.fc(quantized.quant(x)), 0.1, 0.5))
    assert torch.equal(tl.trace(quantized, x, intervene={"fc": tl.clamp(0.1, 0.5)}).output, expected)
    for action in (tl.scale(0.5), tl.noise(0.1), tl.mean_ablate()):
        with pytest.raises(tl.InterventionError, match=r" at fc:1: torch cannot compute it on this quantized \(quint8"):
            tl.trace(quantized, x, intervene={"fc": action})
    assert_clean_process()


def test_an_action_that_raises_is_named_with_its_site_not_left_as_the_models_failure():
    # A user function that raised was noted only "raised in module call 0:1", which reads as the model failing; the
    # note now names the action and the site it ran at.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError) as raised:
        tl.trace(model, x, intervene={"linear_1_1:1": lambda t, op: t @ torch.ones(5, 5)})
    assert re.fullmatch(r"torchlens: raised by the intervention action \S*<lambda>.* at 'linear_1_1:1', given a "
                        r"\(3, 4\) torch.float32 value; the model itself did not fail", raised.value.__notes__[0])
    assert_clean_process()
    # A helper's own refusal (a scale or steering tensor that does not broadcast) names the site already, and is left
    # without a second note.
    for helper in (tl.scale(torch.ones(5)), tl.steer(torch.ones(5))):
        with pytest.raises(tl.InterventionError, match="at linear_1_1:1") as refused:
            tl.trace(model, x, intervene={"linear_1_1:1": helper})
        assert not any("intervention action" in note for note in getattr(refused.value, "__notes__", []))
        assert_clean_process()


class _Counted(nn.Module):
    """An int64 running count and a bool mask, each a module's output, read by float ops after them."""

    class Count(nn.Module):
        def forward(self, ids):
            return ids.ne(0).long().cumsum(-1)

    class Mask(nn.Module):
        def forward(self, ids):
            return ids.ne(0)

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.count, self.mask, self.embed = self.Count(), self.Mask(), nn.Embedding(16, 4)

    def forward(self, ids):
        return self.embed(self.count(ids)) * self.mask(ids)[..., None]


def _hooked(model, module, edit, ids):
    handle = module.register_forward_hook(lambda m, args, out: edit(out))
    try:
        return model(ids)
    finally:
        handle.remove()


@pytest.mark.parametrize("site, action, edit", [
    ("count", tl.steer(torch.tensor([1, 0, 2, 0])), lambda out: out + torch.tensor([1, 0, 2, 0])),
    ("count", tl.scale(2.0), lambda out: out * 2),
    ("count", tl.clamp(0.0, 2.0), lambda out: out.clamp(0, 2)),
    ("mask", tl.clamp(max=0), torch.zeros_like),
    ("mask", tl.clamp(min=1), torch.ones_like),
    ("mask", tl.scale(0), torch.zeros_like)], ids=["steer", "scale", "clamp", "clamp mask", "fill mask", "scale mask"])
def test_a_whole_number_helper_edits_an_integer_or_bool_value_as_a_hook_does(site, action, edit):
    # torch computes count + 1.0 * v, count * 2.0 and mask.clamp(max=0) in float or int64, so every one of these was
    # refused as "an action must keep shape and dtype", tl.steer with an int64 vector at its default scale=1.0 and
    # tl.clamp at a mask among them, which the helpers' own rules accept.
    model, ids = _Counted(), torch.tensor([[3, 0, 4, 5], [0, 2, 0, 7]])
    edited = tl.trace(model, ids, intervene={site: action})
    expected = _hooked(model, getattr(model, site), edit, ids)
    assert torch.equal(edited.output, expected)
    assert edited[site].activation.dtype == edited[site].original.dtype
    label = edited[site].label
    assert torch.equal(tl.trace(model, ids, intervene={label: action}).output, expected)
    assert_clean_process()


@pytest.mark.parametrize("site, action, named", [
    ("count", tl.scale(0.5), r"scale\(0.5\) at count:1: k=0.5 .*torch.int64.*whole number"),
    ("count", tl.steer(torch.tensor([1, 1, 1, 1]), scale=0.5), r"steer\(.*\) at count:1: scale=0.5 .*torch.int64"),
    ("count", tl.scale(torch.tensor([1.0, 2.0, 1.0, 1.0])), r"scale\(.*\)'s k at count:1: .*float32.*torch.int64"),
    ("mask", tl.scale(2), r"scale\(2\) at mask:1: k=2 .*torch.bool.*0 or 1"),
    ("mask", tl.steer(torch.tensor([True, False, True, False])), r"steer\(.*\) at mask:1: .*bool mask"),
    # An int64 or float vector was refused as one to give in torch.bool instead, which the mask then refused too.
    ("mask", tl.steer(torch.tensor([1, 0, 1, 0])), r"steer\(.*\) at mask:1: .*bool mask, to which nothing"),
    ("mask", tl.steer(torch.ones(4)), r"steer\(.*\) at mask:1: .*bool mask, to which nothing")],
    ids=["scale", "steer", "scale tensor", "scale mask", "steer mask", "steer mask int", "steer mask float"])
def test_a_helper_number_that_would_round_into_an_integer_or_bool_value_is_refused_by_name(site, action, named):
    # These were refused too, but as an action returning a float32 or int64 tensor, naming neither the helper's
    # number nor what to give instead.
    model, ids = _Counted(), torch.tensor([[3, 0, 4, 5], [0, 2, 0, 7]])
    with pytest.raises(tl.InterventionError, match=named):
        tl.trace(model, ids, intervene={site: action})
    assert_clean_process()


def _noise(std):
    return lambda out: out + std.to(out.dtype) * torch.randn(out.shape, generator=torch.Generator().manual_seed(3),
                                                             dtype=out.dtype)


@pytest.mark.parametrize("dtype, k", [(torch.bfloat16, torch.tensor([0.5, 2.0, 1.0, 3.0])),
                                      (torch.float32, torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64))],
                         ids=["float32 at bfloat16", "float64 at float32"])
def test_a_helper_tensor_of_a_wider_float_dtype_is_cast_to_the_value_as_a_hook_casts_it(dtype, k):
    # torch's promotion widened value * k to k's dtype (a per-channel float32 scale in a bfloat16 model, a float64 one
    # from NumPy), which was refused as an action returning another dtype, though a value given within its kind is
    # cast to the site's dtype (tl.steer's vector always was).
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype), torch.randn(3, 4, dtype=dtype)
    for action, edit in ((tl.scale(k), lambda out: out * k.to(out.dtype)),
                         (tl.clamp(min=-k, max=k), lambda out: out.clamp(-k.to(out.dtype), k.to(out.dtype))),
                         (tl.noise(k, generator=torch.Generator().manual_seed(3)), _noise(k))):
        edited = tl.trace(model, x, intervene={"0": action})
        handle = model[0].register_forward_hook(lambda module, args, out: edit(out))
        try:
            expected = model(x)
        finally:
            handle.remove()
        assert edited["0"].activation.dtype == dtype
        assert torch.equal(edited.output, expected)
    assert_clean_process()


class _Loss(nn.Module):
    """A classifier returning its cross-entropy loss: a 0-d value at the last op."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 3)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(x), y)


@pytest.mark.parametrize("action", [tl.mean_ablate(), tl.steer(torch.ones(1))], ids=["mean_ablate", "steer"])
def test_a_dimension_named_at_a_0d_value_is_refused_saying_it_has_none(action):
    # A predicate site reaching the loss named "dimensions 0 to -1" as the dimensions a scalar has.
    model, args = _Loss(), (torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))
    with pytest.raises(tl.InterventionError, match=r"is not a dimension of this value of shape \(\) \(a 0-d value, "
                                                   r"which has no dimensions\)"):
        tl.trace(model, args, intervene={(lambda op: op.type == "crossentropy"): action})
    assert_clean_process()
    whole = tl.trace(model, args, intervene={"crossentropy_1_2": tl.mean_ablate(dims=None)})
    assert torch.equal(whole.output, model(*args))  # the mean of one number is itself


class _Float8Activations(nn.Module):
    """Keeps a Linear's output in float8, as float8 inference stores activations, and computes on in float32."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.fc(x).to(torch.float8_e4m3fn).float())


def test_a_helper_torch_has_no_kernel_for_on_a_float8_value_is_refused_naming_the_dtype():
    # scale(2.0) at a float8 value was refused saying "give arguments that fit it (a tensor argument must broadcast to
    # its shape)": torch has no float8 multiplication on the CPU, which no argument of the helper's changes.
    model, x = _Float8Activations(), torch.randn(3, 4)
    with pytest.raises(tl.InterventionError, match=r"scale\(2.0\) at to_1_2:1: torch cannot compute it on this "
                                                   r"float8_e4m3fn value \(NotImplementedError: .*\); write the action "
                                                   r"as a function of the tensor .*has a dtype torch computes it on"):
        tl.trace(model, x, intervene={"to_1_2": tl.scale(2.0)})
    doubled = tl.trace(model, x, intervene={"to_1_2": lambda t, op: (t.float() * 2).to(t.dtype)})
    with torch.no_grad():
        expected = model.head((model.fc(x).to(torch.float8_e4m3fn).float() * 2).to(torch.float8_e4m3fn).float())
    assert torch.equal(doubled.output, expected)
    assert_clean_process()


def test_a_plain_tensor_argument_at_a_dtensor_value_is_refused_naming_the_dtensor():
    # A steering vector or replacement that broadcasts, given as a plain tensor at a single-rank DTensor value, was
    # refused saying "a tensor argument must broadcast to its shape", which it did: torch computes a DTensor only
    # with DTensors.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model, x = nn.Linear(4, 4), distribute_tensor(torch.randn(3, 4), mesh, [Replicate()])
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))
        model.bias = nn.Parameter(distribute_tensor(model.bias.detach(), mesh, [Replicate()]))
        refused = r" at linear_1_1:1: .*a tensor argument must broadcast to its shape, and be a DTensor, as the value"
        for helper, named in ((tl.steer(torch.ones(4)), r"steer\(vector\[4\]"), (torch.ones(3, 4), "replace_with")):
            with pytest.raises(tl.InterventionError, match=named + ".*" + refused):
                tl.trace(model, x, intervene={"linear_1_1": helper})
        steered = tl.trace(model, x, intervene={"linear_1_1": tl.steer(distribute_tensor(torch.ones(4), mesh,
                                                                                          [Replicate()]))})
        assert torch.equal(steered.output.full_tensor(), model(x).full_tensor() + 1)
    finally:
        dist.destroy_process_group()
    assert_clean_process()


def test_clamp_takes_a_number_and_a_tensor_bound_together():
    # tl.clamp(min=0.0, max=per_channel) failed at its site with torch's "clamp() received an invalid combination of
    # arguments - got (float, Tensor)": torch.clamp takes two numbers or two tensors.
    from zoo import MLP

    model, x = MLP().eval(), torch.randn(2, 16)
    bound = torch.linspace(-0.5, 0.5, 16)
    made = tl.trace(model, x)["linear_1_1"].activation
    for action, expected in ((tl.clamp(min=-0.2, max=bound), made.clamp(torch.tensor(-0.2), bound)),
                             (tl.clamp(min=bound - 1, max=0.3), made.clamp(bound - 1, torch.tensor(0.3)))):
        log = tl.trace(model, x, intervene={"linear_1_1": action})
        assert torch.equal(log["linear_1_1"].activation, expected)
        with torch.no_grad():
            untraced = model.head(torch.relu(model.layers[2](torch.relu(model.layers[1](torch.relu(expected))))))
        assert torch.equal(log.output, untraced)


@pytest.mark.parametrize("dims", [0, None], ids=["batch", "whole"])
def test_a_mean_from_a_run_with_an_empty_batch_is_refused_not_written_as_nan(dims):
    # The mean of no values is NaN: mean_ablate(trace=) of a run given an empty batch wrote NaN into every element
    # of the site, and the model computed on from it as if from a mean.
    from zoo import transformer_encoder

    torch.manual_seed(0)
    model, x = transformer_encoder().eval(), torch.randn(2, 5, 32)
    empty = tl.trace(model, torch.randn(0, 5, 32))
    with pytest.raises(tl.InterventionError, match=r"mean_ablate\(dims=.*, trace=<trace>\) at layers\.0:1: the "
                                                   r"source trace's value has shape \(0, 5, 32\), which holds no "
                                                   r"values to average over"):
        tl.trace(model, x, intervene={"layers.0": tl.mean_ablate(dims=dims, trace=empty)})
    assert_clean_process()
    clean = tl.trace(model, x)
    log = tl.trace(model, x, intervene={"layers.0": tl.mean_ablate(dims=dims, trace=clean)})
    value = clean["layers.0"].activation
    mean = value.mean() if dims is None else value.mean(dims, keepdim=True)
    assert torch.equal(log["layers.0"].activation, mean.expand(2, 5, 32))
