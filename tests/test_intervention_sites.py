"""Intervention sites, actions and stop_after (``tl.trace(intervene=..., stop_after=...)``): which sites are
refused and why, what each helper computes, and what a stopped trace holds, against plain traces and
hand-written forward hooks doing the same edit."""

from __future__ import annotations

from collections import Counter
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from untouched import assert_clean_process, assert_untouched, snapshot  # noqa: E402
from zoo import InplaceViews, LoopRNN, SharedModule, zoo  # noqa: E402

CASES = {k: v for k, v in zoo().items() if k != "transformer_fastpath"}


# ----- sites ----------------------------------------------------------------------------------------------
class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return self.fc(x).relu()


@pytest.mark.parametrize("site", ["fcc", "fc.weight"])
def test_an_unknown_module_like_site_raises_before_the_model_runs(site):
    model = _Counting()
    with pytest.raises(KeyError, match="fc"):
        tl.trace(model, torch.randn(2, 4), intervene={site: tl.zero_ablate()})
    assert model.runs == 0


def test_an_unknown_label_raises_with_the_closest_labels_before_the_intervened_run():
    model = _Counting()
    reference = tl.trace(model, torch.randn(2, 4), save="none")
    runs = model.runs
    with pytest.raises(KeyError, match="closest: relu_1_2"):
        tl.trace(model, torch.randn(2, 4), intervene={"relu_1_3": tl.zero_ablate()}, reference=reference)
    assert model.runs == runs


def test_a_module_call_never_made_is_an_error():
    model, x = SharedModule().eval(), torch.randn(2, 8)
    # It did not say which calls there were: the error names them now.
    with pytest.raises(tl.InterventionError, match=r"^intervention site\(s\) 'fc:4' were never reached: .*it\) \(fc "
                                                   r"made 3 calls in this forward: fc:1 to fc:3\); nothing was "
                                                   "changed there"):
        tl.trace(model, x, intervene={"fc:4": tl.zero_ablate()})
    # As a stop_after= site it was called an intervention site, and said nothing was changed: nothing was to be.
    with pytest.raises(tl.InterventionError, match=r"^stop_after site 'fc:4' was never reached: the forward ran no "
                                                   r"such op or module call .*, and the forward ran to its end; name a "
                                                   "site it reaches"):
        tl.trace(model, x, stop_after="fc:4")
    with pytest.raises(tl.InterventionError, match=r"^intervention site\(s\) 'fc:5' were never reached"):
        tl.trace(model, x, intervene={"fc:5": tl.zero_ablate()}, stop_after="fc:4")
    assert_clean_process()


def test_control_flow_diverging_from_the_reference_names_the_site():
    model = CASES["branchy"][0]
    positive = torch.ones(2, 8)
    reference = tl.trace(model, positive, save="none")
    site = reference["a"].label
    with pytest.raises(tl.InterventionError, match=site):
        tl.trace(model, -positive, intervene={site: tl.zero_ablate()}, reference=reference)


def grow_until_large(x):
    h = x * 1.0
    while h.norm() < 10:
        h = h * 1.5
    return h * 2


def test_a_loop_that_ran_fewer_times_is_divergence_not_a_later_op():
    # An earlier edit makes the loop stop after two passes: at the position of the loop's third pass the
    # forward calls the same function in the same module call, but from the return line.  The site must
    # not land there.
    x = torch.full((4,), 0.5)
    reference = tl.trace(grow_until_large, (x,))
    loop = reference["mul_2_4"]
    assert len(loop.ops) == 6
    with pytest.raises(tl.InterventionError, match=r"mul_2_4:3.*another path.*:\d+\), where the reference"):
        tl.trace(grow_until_large, (x,), reference=reference,
                 intervene={"mul_1_1:1": tl.scale(5.0), "mul_2_4:3": tl.zero_ablate()})
    # The same site, reached: the edit is the hand-made one.
    log = tl.trace(grow_until_large, (x,), reference=reference, intervene={"mul_2_4:3": tl.scale(2.0)})
    h = x * 1.0
    for k in range(3):
        h = h * 1.5 * (2.0 if k == 2 else 1.0)
    while h.norm() < 10:
        h = h * 1.5
    assert torch.equal(log.output, h * 2)


def test_a_module_passing_its_input_through_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Identity(), nn.ReLU())
    with pytest.raises(tl.InterventionError, match="did not compute"):
        tl.trace(model, torch.randn(2, 4), intervene={"1": tl.zero_ablate()})


class _BiasPassingBlock(nn.Module):
    """A block that returns the position bias it was given beside its hidden states, as a T5 block does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, h, bias):
        return self.fc(h) + bias, bias


class _BiasPassingStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_BiasPassingBlock() for _ in range(2))

    def forward(self, h):
        bias = h.mean(dim=0)
        for block in self.blocks:
            h, bias = block(h, bias)
        return h


def test_a_passed_through_output_refusal_names_it_and_where_the_labels_to_use_are():
    model, x = _BiasPassingStack(), torch.randn(3, 4)
    with pytest.raises(tl.InterventionError) as refused:
        tl.trace(model, x, intervene={"blocks.0": tl.zero_ablate()})
    message = str(refused.value)
    assert "output.1 (of shape (4,))" in message and "'blocks.0:1' lists them in return order (output_ops)" in message
    # The site the message points to is the block's hidden states, and the edit is the hand-made one.
    call = next(c for c in tl.trace(model, x).module_calls if c.label == "blocks.0:1")
    log = tl.trace(model, x, intervene={call.output_ops[0]: tl.zero_ablate()})
    handle = model.blocks[0].register_forward_hook(lambda module, args, out: (torch.zeros_like(out[0]), out[1]))
    try:
        assert torch.equal(log.output, model(x))
    finally:
        handle.remove()


def test_a_predicate_site_selects_ops_by_metadata():
    model, args, _ = CASES["mlp"]
    log = tl.trace(model, args, intervene={(lambda op: op.type == "relu"): tl.clamp(max=0.1)})
    relus = [op for op in log.ops if op.type == "relu"]
    assert len(log.interventions) == len(relus) == 3
    assert all(bool(op.activation.max() <= torch.tensor(0.1)) for op in relus)

    # A predicate accepting no op was refused as "a intervention predicate matched no op of the reference trace".
    with pytest.raises(KeyError, match="an intervention predicate matched no op .* so it would change nothing"):
        tl.trace(model, args, intervene={(lambda op: op.type == "conv2d"): tl.zero_ablate()})
    with pytest.raises(KeyError, match="a stop_after predicate matched no op .* so it would never stop"):
        tl.trace(model, args, stop_after=lambda op: op.type == "conv2d")


# ----- actions --------------------------------------------------------------------------------------------
def test_helpers_compute_what_they_say():
    model, args, _ = CASES["mlp"]
    plain = tl.trace(model, args)
    base = plain["layers.1"].activation
    vector = torch.arange(16.0)

    def at(action):
        return tl.trace(model, args, intervene={"layers.1": action})["layers.1"].activation

    assert torch.equal(at(tl.zero_ablate()), torch.zeros_like(base))
    assert torch.equal(at(tl.steer(vector, 0.5)), base + 0.5 * vector)
    assert torch.equal(at(tl.clamp(-0.1, 0.1)), base.clamp(-0.1, 0.1))
    assert torch.equal(at(tl.mean_ablate()), base.mean(0, keepdim=True).expand_as(base))
    assert torch.equal(at(tl.mean_ablate(dims=-1)), base.mean(-1, keepdim=True).expand_as(base))  # each row its own
    assert torch.equal(at(torch.ones(16)), torch.ones_like(base))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(at(tl.noise(0.2, generator=g1)), base + 0.2 * torch.randn(base.shape, generator=g2))
    head = at(tl.zero_ablate(at=(slice(None), slice(0, 4))))
    assert torch.equal(head[:, :4], torch.zeros(4, 4)) and torch.equal(head[:, 4:], base[:, 4:])
    other = tl.trace(model, (args[0] * 2,))
    assert torch.equal(at(tl.patch_from(other)), other["layers.1"].activation)
    other_mean = other["layers.1"].activation.mean(0, keepdim=True).expand_as(base)
    assert torch.equal(at(tl.mean_ablate(trace=other)), other_mean)
    with pytest.raises(tl.InterventionError, match="keep shape"):
        at(lambda t, op: t[:2])


def test_an_action_moving_the_value_to_another_device_is_refused():
    model, args, _ = CASES["mlp"]
    with pytest.raises(tl.InterventionError, match="on meta for a value on cpu.*keep the device"):
        tl.trace(model, args, intervene={"layers.1": lambda t, op: torch.zeros(t.shape, device="meta")})
    assert_clean_process()


def test_patch_from_needs_the_source_activation():
    model, args, _ = CASES["mlp"]
    empty = tl.trace(model, args, save="none")
    with pytest.raises(ValueError, match="did not save"):
        tl.trace(model, args, intervene={"layers.1": tl.patch_from(empty)})


# ----- stop_after -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("site", ["layers.1", "layers.1:1", "linear_2_3:1"])
def test_stop_after_holds_everything_up_to_the_site(site):
    model, args, _ = CASES["mlp"]
    plain = tl.trace(model, args)
    before = snapshot(model, args)
    log = tl.trace(model, args, stop_after=site)
    assert_untouched(before, snapshot(model, args))
    assert log.output is None and log.stopped_after in (site, f"{site}:1")
    assert log[-1].label == plain["layers.1"].label
    for op in log.ops:
        assert torch.equal(op.activation, plain[op.label].activation)
    assert "head:1" not in [mc.label for mc in log.module_calls]


def test_extract_accepts_stop_after(tmp_path):
    model, args, _ = CASES["mlp"]
    out = tl.extract(model, [args[0], args[0] * 2], ["layers.0"], tmp_path / "x", stop_after="layers.0",
                     progress=False)
    got = tl.load_extracted(out)
    first = got["layers.0"] if not hasattr(got, "layer") else got.layer("layers.0")
    with torch.no_grad():
        expected = torch.cat([model.layers[0](args[0]), model.layers[0](args[0] * 2)])
    assert torch.equal(torch.as_tensor(first[:].copy()), expected)


def test_mha_head_via_deep_capture():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    model = nn.Sequential()  # a root whose forward calls attention with need_weights=False
    model.attn = mha
    model.forward = lambda x: mha(x, x, x, need_weights=False)[0]
    x = torch.randn(1, 3, 8)
    plain = tl.trace(model, x, deep=True)
    sdpa = next(op for op in plain.ops if op.type == "scaleddotproductattention")
    log = tl.trace(model, x, deep=True, intervene={sdpa.label: tl.zero_ablate(at=(slice(None), 1))})
    with torch.no_grad():  # the same edit by hand: zero head 1's half of the concatenated heads
        q, k, v = F.linear(x.transpose(0, 1), mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
        heads = [t.reshape(3, 2, 4).transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        attended = F.scaled_dot_product_attention(*heads)
        attended[:, 1] = 0
        expected = mha.out_proj(attended.permute(2, 0, 1, 3).reshape(3, 8)).view(3, 1, 8).transpose(0, 1)
    assert torch.allclose(log.output, expected, atol=1e-6)
    assert not torch.allclose(plain.output, expected, atol=1e-6)


def test_a_stopped_trace_keeps_the_labels_of_the_whole_forward_when_it_has_a_reference():
    model, x = SharedModule().eval(), torch.randn(2, 8)
    plain = tl.trace(model, x)
    site = plain["act:1"].label
    for log in (tl.trace(model, x, stop_after=site), tl.trace(model, x, stop_after="act:1", reference=plain)):
        assert log.output is None and log[-1].label == site
        assert log._labels == plain._labels[:len(log)]
        assert all(torch.equal(op.activation, plain[op.label].activation) for op in log.ops)


def test_a_stopped_trace_recounts_its_passes_in_one_pass_over_its_ops():
    """Taking the whole forward's labels counts each layer's passes in one pass over the ops, not one pass per
    layer (which a stop late in a long forward, with thousands of layers, would take minutes over)."""
    model, x = LoopRNN(steps=16).eval(), torch.randn(2, 8)
    plain = tl.trace(model, x)
    log = tl.trace(model, x, stop_after="cell:16", reference=plain)
    n = len(log)
    assert log["linear_1_2:1"].num_passes == 16 and log.group_sizes == Counter(plain.groups[:n])
    comparisons = 0

    class Group(int):  # a group id that counts how often it is compared
        __hash__ = int.__hash__

        def __eq__(self, other):
            nonlocal comparisons
            comparisons += 1
            return int.__eq__(self, other)

    groups = [Group(g) for g in plain.groups[:n]]
    log.relabel(plain.labels[:n], plain.op_layer_labels[:n], plain.pass_numbers[:n], groups)
    assert log.group_sizes == Counter(plain.groups[:n])
    assert comparisons <= 2 * n, (comparisons, n)


def test_setitem_and_in_place_view_sites():
    model, x = InplaceViews().eval(), torch.randn(3, 8)
    plain = tl.trace(model, x)
    setitem = next(op for op in plain.ops if op.func_name == "__setitem__")
    iadd = next(op for op in plain.ops if op.func_name == "add_")
    log = tl.trace(model, x, intervene={setitem.label: tl.zero_ablate()})
    assert torch.equal(log[setitem.label].activation, torch.zeros(3, 8))
    assert torch.equal(log[setitem.label].original, plain[setitem.label].activation)
    view = next(op for op in log.ops if op.func_name == "view" and setitem.label in op.parents)
    assert torch.equal(log[view.label].activation, torch.zeros(24))
    log = tl.trace(model, x, intervene={iadd.label: tl.scale(-1.0)})
    assert torch.equal(log[iadd.label].activation, -plain[iadd.label].activation)
    assert torch.equal(log["fc"].activation, plain["fc"].activation)


def test_several_sites_at_one_op_apply_in_order_and_keep_the_first_original():
    model, x = SharedModule().eval(), torch.randn(2, 8)
    plain = tl.trace(model, x)
    log = tl.trace(model, x, intervene={"fc": tl.scale(2.0), "fc:2": lambda t, op: t + 1})
    first, second = log["fc:1"], log["fc:2"]
    assert torch.equal(first.original, plain["fc:1"].activation) and first.intervention.site == "fc"
    assert torch.equal(second.activation, second.original * 2 + 1)
    with torch.no_grad():
        assert torch.equal(second.original, model.fc(model.act(plain["fc:1"].activation * 2)))
    assert second.intervention.site == ("fc", "fc:2")
    label = plain["fc:1"].label
    log = tl.trace(model, x, intervene={label: tl.scale(2.0), (lambda op: op.label == label): tl.scale(3.0)})
    assert torch.equal(log[label].activation, plain[label].activation * 6)


def test_an_action_writing_its_tensor_in_place_is_refused():
    model, args, _ = CASES["mlp"]

    def zero_in_place(t, op):
        t[:, 0] = 0

    with pytest.raises(tl.InterventionError, match="in place"):
        tl.trace(model, args, intervene={"layers.0": zero_in_place})
    assert_clean_process()


def test_a_saved_or_cleaned_up_trace_serves_as_the_reference(tmp_path):
    model, x = SharedModule().eval(), torch.randn(2, 8)
    plain = tl.trace(model, x)
    site = plain["act:2"].label
    expected = tl.trace(model, x, intervene={site: tl.scale(2.0)}).output
    plain.save(tmp_path / "run")
    loaded = tl.load(tmp_path / "run")
    assert torch.equal(tl.trace(model, x, intervene={site: tl.scale(2.0)}, reference=loaded).output, expected)
    plain.cleanup()
    assert torch.equal(tl.trace(model, x, intervene={site: tl.scale(2.0)}, reference=plain).output, expected)


@pytest.mark.parametrize("site, says", [("linear_2_30", "no op, layer, module call or module named"),
                                         ("layers.9", "neither an op or layer label nor a module address")])
def test_a_stop_after_site_that_names_nothing_is_refused_as_a_stop_after_site(site, says):
    model, args, _ = CASES["mlp"]
    with pytest.raises(KeyError) as raised:
        tl.trace(model, args, stop_after=site)
    assert f"stop_after site {site!r}" in str(raised.value) and says in str(raised.value)
    assert "intervention" not in str(raised.value)


@pytest.mark.parametrize("site", [5, ("layers.1",), b"layers.1"])
def test_a_site_of_another_type_is_refused_naming_the_option_it_was_given_to(site):
    model, args, _ = CASES["mlp"]
    with pytest.raises(TypeError, match=r"^stop_after= must be a label") as raised:
        tl.trace(model, args, stop_after=site)
    assert "intervention" not in str(raised.value)
    with pytest.raises(TypeError, match=r"^an intervention site must be a label"):
        tl.trace(model, args, intervene={site: tl.zero_ablate()})


def test_stop_after_with_an_intervention_before_it():
    model, args, _ = CASES["mlp"]
    log = tl.trace(model, args, intervene={"layers.0": tl.zero_ablate()}, stop_after="layers.1")
    assert log.output is None and log.interventions[0].label == log["layers.0"].label
    with torch.no_grad():
        assert torch.equal(log["layers.1"].activation, model.layers[1](torch.relu(torch.zeros(4, 16))))


def test_one_output_of_chunk_and_of_max_keeps_the_others_and_the_result_type():
    model, args, _ = CASES["multi_output"]
    x = args[0]
    plain = tl.trace(model, args)
    chunk_b = next(op for op in plain.ops if op.type == "chunk" and op.multi_output_index == 1)
    max_values = next(op for op in plain.ops if op.type == "max" and op.multi_output_index == 0)
    a, b = torch.chunk(x, 2, dim=1)
    log = tl.trace(model, args, intervene={chunk_b.label: tl.scale(-1.0)})
    values, indices = torch.max(a * -b, dim=1)
    assert torch.equal(log.output[0], values) and torch.equal(log.output[1], indices)
    seen = {}

    def probe(t, op):
        seen["result"] = t
        return t + 100

    log = tl.trace(model, args, intervene={max_values.label: probe})
    plain_values, plain_indices = plain.output
    assert torch.equal(log.output[0], plain_values + 100) and torch.equal(log.output[1], plain_indices)
    assert torch.equal(seen["result"], plain_values)


def test_a_module_site_may_use_an_alias_address():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model.alias = model[0]
    x = torch.randn(2, 4)
    by_alias = tl.trace(model, x, intervene={"alias": tl.zero_ablate()})
    by_name = tl.trace(model, x, intervene={"0": tl.zero_ablate()})
    assert torch.equal(by_alias.output, by_name.output) and torch.equal(by_alias.output, torch.zeros(2, 4))
    clean = tl.trace(model, x * 2)
    # nn.Sequential runs the Linear twice, as "0" and as "alias": calls are numbered per object, so "alias:1"
    # would be the call made as "0".  Refused; the call made as "alias" is the object's second, "0:2".
    with pytest.raises(tl.InterventionError, match=r"'alias:1': alias is another name of the module 0, which ran 2"):
        tl.trace(model, x, intervene={"alias:1": tl.patch_from(clean)})
    patched = tl.trace(model, x, intervene={"0:2": tl.patch_from(clean)})
    assert torch.equal(patched.output, clean.output)


def test_a_replaced_value_counts_once_against_max_saved_bytes():
    model, args, _ = CASES["mlp"]
    plain = tl.trace(model, args)
    exact = sum(op.activation.numel() * op.activation.element_size() for op in plain.ops if not op.is_output)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "max_saved_bytes reached" would mean the old value was still counted
        touched = tl.trace(model, args, max_saved_bytes=exact, intervene={"layers.1": tl.scale(2.0)})
    assert all(op.activation is not None for op in touched.ops)
    assert torch.equal(touched["layers.1"].activation, plain["layers.1"].activation * 2)


def test_an_action_changing_dtype_at_a_predicate_site_names_the_op_and_the_way_out():
    class Positions(nn.Module):
        def forward(self, x):
            return x + torch.arange(x.shape[-1])  # an integer op among float ones

    x = torch.randn(2, 4)
    with pytest.raises(tl.InterventionError, match=r"\(arange_1_1:1\) returned a \(4,\) torch.float32 tensor for a "
                                                   r"\(4,\) torch.int64 value.*op.dtype.is_floating_point"):
        tl.trace(Positions(), x, intervene={(lambda op: True): lambda t, op: t * 2.0})
    with pytest.raises(tl.InterventionError, match=r"scale\(0.5\) at arange_1_1:1: .*op.dtype.is_floating_point"):
        tl.trace(Positions(), x, intervene={(lambda op: True): tl.scale(0.5)})
    floats = tl.trace(Positions(), x, intervene={(lambda op: op.dtype.is_floating_point): tl.scale(2.0)})
    assert torch.equal(floats.output, 2 * (x + torch.arange(4)))


class _LinearNamedLikeALabel(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.linear_1_1 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.linear_1_1(self.first(x).relu())


def test_a_module_site_whose_address_is_a_label_of_other_ops_is_refused(tmp_path):
    # linear_1_1 is both the module and the label of first's linear: which one the user meant is unknowable.
    model, x = _LinearNamedLikeALabel(), torch.randn(2, 4)
    with pytest.raises(tl.errors.AmbiguousKey, match="intervention site 'linear_1_1' names two things"):
        tl.trace(model, x, intervene={"linear_1_1": tl.zero_ablate()})
    with pytest.raises(tl.errors.AmbiguousKey, match="layers= entry 'linear_1_1' names two things"):
        tl.extract(model, [x], ["linear_1_1"], str(tmp_path / "out"), progress=False)
    # A site naming only one of them still edits it, as forward hooks would.
    log = tl.trace(model, x, intervene={lambda op: op.module_address == "linear_1_1": tl.zero_ablate()})
    assert not log.output.any()


class _SharedByTwoParents(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Linear(4, 4)
        self.p1, self.p2 = nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared, nn.Tanh())

    def forward(self, x):
        return self.p2(self.p1(x))


def test_a_call_number_after_a_modules_name_under_another_parent_is_refused():
    # p2.0 is p1.0, whose calls are numbered per object: "p2.0:1" would edit the call made from p1.
    # Refused before the run (under another parent); one parent's second name is refused after it (see above).
    model, x = _SharedByTwoParents(), torch.randn(2, 4)
    with pytest.raises(tl.InterventionError, match=r"'p2.0:1': p2.0 is another name of the module p1.0, .* p1.0:N"):
        tl.trace(model, x, intervene={"p2.0:1": tl.zero_ablate()})
    log = tl.trace(model, x)
    with pytest.raises(KeyError, match=r"p2.0 is another name of the module p1.0.*the calls made from p2: p1.0:2"):
        log["p2.0:1"]
    with pytest.raises(KeyError, match=r"p2.0 is another name of the module p1.0"):
        tl.trace(model, x, save=["p2.0:1"])
    # The call made from p2 by its label, as a forward hook sees it; the alias alone still names every call.
    seen = []
    handle = model.p2[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    try:
        edited = tl.trace(model, x, intervene={"p1.0:2": tl.zero_ablate()})
    finally:
        handle.remove()
    assert not seen[-1].any() and torch.equal(edited.output, torch.zeros(2, 4))
    both = tl.trace(model, x, intervene={"p2.0": tl.zero_ablate()})
    assert [op.activation.any().item() for op in both if op.type == "linear"] == [False, False]


class _OneBlockThreeTimes(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4)] * 3)  # one block under three names, as weight-tied layers

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return x


def test_a_call_number_after_a_second_name_of_a_module_run_several_times_is_refused():
    model, x = _OneBlockThreeTimes(), torch.randn(2, 4)
    with pytest.raises(tl.InterventionError, match=r"'layers.2:1': layers.2 is another name of the module layers.0, "
                                                   r"which ran 3 times; .* layers.0:1, layers.0:2, layers.0:3"):
        tl.trace(model, x, intervene={"layers.2:1": tl.zero_ablate()})
    # The third call by its label: what a hook on that call sees after the edit, and the forward's output.
    edited = tl.trace(model, x, intervene={"layers.0:3": tl.zero_ablate()})
    assert [op.activation.any().item() for op in edited if op.type == "linear"] == [True, True, False]
    assert not edited.output.any()


class _CountedCallNumber(int):
    """A module site's call number that counts the equality tests made against it."""

    compared = 0

    def __eq__(self, other):
        _CountedCallNumber.compared += 1
        return int(self) == other

    __hash__ = int.__hash__


def test_a_site_per_call_of_a_module_run_many_times_is_found_without_reading_the_other_calls_sites(monkeypatch):
    # Each call of a site module read every site of that module to find its own: a site per call of a cell
    # run n times was n * n comparisons (a 400-round loop with a site per call: 13x the 100-round one).
    from torchlens.intervene.runtime import Interventions

    steps = 120
    model, x = LoopRNN(steps=steps), torch.randn(2, 8)
    real_init = Interventions.__init__

    def counted_init(self, label_sites, module_sites, *rest):
        for site in module_sites:
            if site.call_number is not None:
                site.call_number = _CountedCallNumber(site.call_number)
        real_init(self, label_sites, module_sites, *rest)

    monkeypatch.setattr(Interventions, "__init__", counted_init)
    _CountedCallNumber.compared = 0
    per_call = tl.trace(model, x, intervene={f"cell:{k}": tl.scale(2.0) for k in range(1, steps + 1)})
    assert _CountedCallNumber.compared <= 4 * steps
    every_call = tl.trace(model, x, intervene={"cell": tl.scale(2.0)})
    assert torch.equal(per_call.output, every_call.output) and not torch.equal(per_call.output, model(x))
    # A site for every call and one for a single call both act there, in the order given.
    both = tl.trace(model, x, intervene={"cell:3": tl.scale(2.0), "cell": tl.clamp(-0.1, 0.1)})
    op = both["cell:3"]
    assert op.intervention.site == ("cell:3", "cell")


class _CountedModules(dict):
    """The site resolver's address -> module table, counting the entries read through ``items()``."""

    read = 0

    def items(self):
        for entry in super().items():
            _CountedModules.read += 1
            yield entry


def test_a_call_site_of_each_of_many_modules_is_checked_without_a_search_of_the_modules_per_site(monkeypatch):
    # Each numbered module site ("layers.7:1") was checked for being a second name of its module by searching
    # every module, once before the run and once after: n such sites were n * n reads (2,000 sites: 5.7 s,
    # 16x the 500 ones).  Each check now looks its module up in a table made once.
    from torchlens.intervene import sites
    from torchlens.record.modules import Module
    from zoo import MLP

    model, x = MLP(width=8, depth=80), torch.randn(2, 8)
    real_site_modules = sites._site_modules
    monkeypatch.setattr(sites, "_site_modules", lambda m, *index: (_CountedModules(real_site_modules(m, *index)[0]),
                                                                   real_site_modules(m, *index)[1]))
    reads = []
    real_addresses = Module.all_addresses
    monkeypatch.setattr(Module, "all_addresses", property(lambda m: reads.append(1) or real_addresses.fget(m)))
    _CountedModules.read = 0
    log = tl.trace(model, x, intervene={f"layers.{i}:1": tl.scale(0.5) for i in range(80)})
    modules = len(log.modules)
    assert _CountedModules.read <= 2 * modules and len(reads) <= 2 * modules
    monkeypatch.undo()
    every_call = tl.trace(model, x, intervene={f"layers.{i}": tl.scale(0.5) for i in range(80)})
    assert torch.equal(log.output, every_call.output) and not torch.equal(log.output, model(x))
