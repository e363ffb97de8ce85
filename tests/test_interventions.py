"""Interventions (``tl.trace(intervene=..., stop_after=...)``) on real models, against plain traces and
hand-written forward hooks doing the same edit."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from torchlens.tree import structures_equal  # noqa: E402
from hooked import differing_activations, held_activations, keep, with_hook  # noqa: E402
from untouched import assert_clean_process, assert_untouched, snapshot  # noqa: E402
from zoo import InplaceViews, LoopRNN, SharedModule, zoo  # noqa: E402

CASES = {k: v for k, v in zoo().items() if k != "transformer_fastpath"}


def _seeded(fn, model, seed=0):
    """``fn()`` from the same RNG seed and model state (train-mode batch norm updates its buffers)."""
    if not hasattr(model, "_pristine"):
        model._pristine = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(model._pristine)
    torch.manual_seed(seed)
    result = fn()
    return result, torch.get_rng_state()


# ----- identity actions: bit-identical to a plain trace ----------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("how", ["every op", "every module"])
def test_identity_action_gives_a_bit_identical_trace(name, how):
    model, args, kwargs = CASES[name]
    plain, rng_plain = _seeded(lambda: tl.trace(model, args, kwargs), model)
    held = held_activations(plain)  # the next _seeded may restore buffers the plain trace holds
    if how == "every op":
        sites = {(lambda op: True): keep}
    else:
        sites = {mc.module.address: keep for mc in plain.module_calls}
        if not sites:
            pytest.skip("no submodules")
    touched, rng_touched = _seeded(lambda: tl.trace(model, args, kwargs, intervene=sites), model)
    assert torch.equal(rng_plain, rng_touched), "the intervened trace consumed different random numbers"
    assert structures_equal(plain.output, touched.output)[0]
    assert not differing_activations(held, touched)
    assert touched.interventions, "the identity action was never applied"


def test_identity_returning_a_copy_keeps_values_and_records_the_original():
    model, args, _ = CASES["mlp"]
    plain = tl.trace(model, args)
    touched = tl.trace(model, args, intervene={"layers.1": lambda t, op: t.clone()})
    assert structures_equal(plain.output, touched.output)[0]
    assert not differing_activations(plain, touched)
    op = touched["layers.1"]
    assert op.intervention is not None and op.intervention.site == "layers.1"
    assert torch.equal(op.original, op.activation)


# ----- an action at site k changes only what k reaches ------------------------------------------------
def _descendants(trace, label):
    children = trace._children()
    todo, seen = [trace[label].index], set()
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo.extend(children[i])
    return {trace._labels[i] for i in seen}


@pytest.mark.parametrize("name,site", [("mlp", "relu_1_2:1"), ("loop_rnn", "tanh_1_4:5"), ("branchy", "linear_1_3:1"),
                                       ("recurrent", "lstm_1_3:1"), ("small_cnn", "features.1")])
def test_an_action_changes_only_ops_reachable_from_its_site(name, site):
    model, args, kwargs = CASES[name]
    plain = tl.trace(model, args, kwargs)
    label = plain[site].label
    touched = tl.trace(model, args, kwargs, intervene={site: tl.scale(3.0)})
    reachable = _descendants(plain, label)
    differ = set(differing_activations(plain, touched))
    assert label in differ
    assert differ <= reachable, f"ops not reachable from {label} changed: {sorted(differ - reachable)}"
    assert torch.equal(touched[label].original, plain[label].activation)
    assert torch.equal(touched[label].activation, plain[label].activation * 3.0)


# ----- the same edit as a hand-written forward hook ---------------------------------------------------
def test_module_call_site_hits_only_that_call_of_a_reused_module():
    model, x = SharedModule().eval(), torch.randn(2, 8)
    calls = []

    def second_call_times_two(module, inputs, output):
        calls.append(1)
        return output * 2 if len(calls) == 2 else None

    expected = with_hook(model.fc, model, (x,), second_call_times_two)
    log = tl.trace(model, x, intervene={"fc:2": tl.scale(2.0)})
    assert torch.equal(log.output, expected)
    assert [a.label for a in log.interventions] == [log["fc:2"].label]
    plain = tl.trace(model, x)
    assert torch.equal(log["fc:1"].activation, plain["fc:1"].activation)


def test_a_module_site_edits_after_the_modules_own_forward_hooks():
    """Callers of the module get the edited value, as from a hook the user registered last: the module's own
    hooks run first (here one adding 1), and the site edits what they made."""
    model, x = SharedModule().eval(), torch.randn(2, 8)
    own = model.fc.register_forward_hook(lambda module, inputs, output: output + 1.0)
    try:
        calls = []

        def second_call_zeroed(module, inputs, output):
            calls.append(1)
            return torch.zeros_like(output) if len(calls) == 2 else None

        expected = with_hook(model.fc, model, (x,), second_call_zeroed)
        plain = tl.trace(model, x)
        log = tl.trace(model, x, intervene={"fc:2": tl.zero_ablate()})
        assert torch.equal(log.output, expected)
        assert torch.equal(log["fc:2"].activation, torch.zeros(2, 8))
        assert torch.equal(log["fc:2"].original, plain["fc:2"].activation)  # the own hook's value
        assert log["fc:2"].type == "add"  # the op the own hook ran, inside the call
        stopped = tl.trace(model, x, stop_after="fc:2")
        assert torch.equal(stopped["fc:2"].activation, plain["fc:2"].activation)

        def fails(t, op):
            raise ValueError("bad action")

        with pytest.raises(ValueError, match="bad action"):
            tl.trace(model, x, intervene={"fc": fails})
        assert list(model.fc._forward_hooks) == [own.id] and not model.fc._forward_pre_hooks
    finally:
        own.remove()


class _Checkpointed(nn.Module):
    """A block run through torch.utils.checkpoint: its backward recomputes the block's forward."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("site,hooked", [("block.0", 0), ("tanh_1_2:1", 1)])
def test_an_edit_inside_a_checkpoint_region_with_grad_is_refused(reentrant, site, hooked):
    """The backward would recompute the region without the edit: gradients of another forward than the
    one traced.  Without gradients nothing is recomputed, and the edit is the hand-written hook's."""
    torch.manual_seed(0)
    model, x = _Checkpointed(reentrant), torch.randn(3, 4, requires_grad=True)
    kind = "reentrant" if reentrant else "non-reentrant"
    tl.trace(model, x)  # plain: allowed (a first trace may also import torch's lazy submodules)
    before = snapshot(model, (x,))
    with pytest.raises(tl.InterventionError, match=f"inside a {kind} torch.utils.checkpoint region"):
        tl.trace(model, x, intervene={site: tl.scale(3.0)})
    assert_untouched(before, snapshot(model, (x,)))
    assert_clean_process()
    probed = tl.trace(model, x, intervene={site: keep})  # a probe changes nothing: allowed
    assert probed.interventions
    expected = with_hook(model.block[hooked], model, (x,), lambda module, inputs, output: output * 3.0)
    with torch.no_grad():
        log = tl.trace(model, x, intervene={site: tl.scale(3.0)})
    assert torch.equal(log.output, expected)
    if reentrant:  # inputs that need no grad: autograd records no checkpoint node, nothing is recomputed
        log = tl.trace(model, x.detach(), intervene={site: tl.scale(3.0)})
        assert torch.equal(log.output, expected)


class _GateWithoutGrad(nn.Module):
    """``x`` times a gate computed under no_grad: the product saves the gate for its backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            gate = torch.sigmoid(self.lin(x))
        return x * gate


def test_an_edit_under_no_grad_inside_a_checkpoint_region_with_grad_is_refused():
    # The backward recomputes the region, the no_grad gate among it, without the edit: x's gradient would be
    # the unedited gate's.
    model, x = _GateWithoutGrad(), torch.randn(3, 4, requires_grad=True)
    label = next(op.label for op in tl.trace(model, x).ops if op.func_name == "sigmoid")

    def checkpointed(z):
        return checkpoint(model, z, use_reentrant=False)

    with pytest.raises(tl.InterventionError, match="inside a non-reentrant torch.utils.checkpoint region"):
        tl.trace(checkpointed, x, intervene={label: tl.scale(3.0)})
    assert tl.trace(model, x, intervene={label: tl.scale(3.0)}).interventions  # allowed with no region

def test_label_sites_in_a_python_loop_hit_one_pass_or_every_pass():
    model, x = LoopRNN(steps=4).eval(), torch.randn(2, 8)
    plain = tl.trace(model, x)
    layer = plain["cell"].module.address if hasattr(plain["cell"], "module") else "cell"
    cell_layer = plain[f"{layer}:1"].layer_label
    calls = []

    def third(module, inputs, output):
        calls.append(1)
        return output + 1 if len(calls) == 3 else None

    assert torch.equal(tl.trace(model, x, intervene={f"{cell_layer}:3": lambda t, op: t + 1}).output,
                       with_hook(model.cell, model, (x,), third))
    assert torch.equal(tl.trace(model, x, intervene={cell_layer: lambda t, op: t + 1}).output,
                       with_hook(model.cell, model, (x,), lambda m, i, o: o + 1))
    assert torch.equal(tl.trace(model, x, intervene={"cell": lambda t, op: t + 1}).output,
                       with_hook(model.cell, model, (x,), lambda m, i, o: o + 1))


def test_one_output_of_a_multi_output_op_and_module():
    model, args, _ = CASES["recurrent"]
    plain = tl.trace(model, args)
    lstm_out = plain["lstm:1"]  # the call's first output op, as a hook's output[0]; the others by their labels
    first = next(op for op in plain.ops if op.type == "lstm" and op.multi_output_index == 0)

    def zero_first(module, inputs, output):
        y, hidden = output
        return torch.zeros_like(y), hidden

    expected = with_hook(model.lstm, model, args, zero_first)
    log = tl.trace(model, args, intervene={first.label: tl.zero_ablate()})
    assert torch.equal(log.output, expected)
    others = [op.label for op in plain.ops if op.type == "lstm" and op.label != first.label]
    assert all(torch.equal(log[k].activation, plain[k].activation) for k in others)
    assert lstm_out.label == first.label
    # A module site changes every output tensor of the call.
    zero_all = with_hook(model.lstm, model, args, lambda m, i, o: (torch.zeros_like(o[0]),
                                                                      tuple(torch.zeros_like(h) for h in o[1])))
    assert torch.equal(tl.trace(model, args, intervene={"lstm": tl.zero_ablate()}).output, zero_all)


def test_in_place_ops_after_the_site_keep_saved_values_protected():
    model, x = InplaceViews().eval(), torch.randn(3, 8)
    expected = with_hook(model.fc, model, (x,), lambda m, i, o: o * 3)
    log = tl.trace(model, x, intervene={"fc": tl.scale(3.0)})
    assert torch.equal(log.output, expected)
    fc = log["fc"]
    with torch.no_grad():
        assert torch.equal(fc.activation, model.fc(x) * 3), "the in-place relu_ after the site wrote the saved value"
        assert torch.equal(fc.original, model.fc(x))
    relu = next(op for op in log.ops if op.func_name == "relu_")
    assert torch.equal(relu.activation, torch.relu(fc.activation))


def test_an_in_place_op_as_the_site_writes_its_receiver():
    model, x = InplaceViews().eval(), torch.randn(3, 8)
    plain = tl.trace(model, x)
    relu = next(op for op in plain.ops if op.func_name == "relu_")
    log = tl.trace(model, x, intervene={relu.label: tl.scale(2.0)})

    with torch.no_grad():  # InplaceViews.forward with the relu_ result doubled
        y = model.fc(x)
        y.relu_()
        y.mul_(2.0)
        z = y[:, :4]
        z += 1
        c = y.clone()
        c[:, 0] = 5.0
        expected = c.view(-1).sum() + y.t().contiguous().sum(0).mean()
    assert torch.equal(log.output, expected)
    assert torch.equal(log[relu.label].original, plain[relu.label].activation)
    assert torch.equal(log[relu.label].activation, plain[relu.label].activation * 2)
    assert torch.equal(log["fc"].activation, plain["fc"].activation), "the op before the site changed"



class _ViewThenWrite(nn.Module):
    """A view of a value (its transpose, its first columns) taken before the value is scaled in place, the
    transpose made in the root, the columns inside ``head``, which keeps the value it viewed."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = _FirstColumns()

    def forward(self, x):
        y = self.fc(x)
        flipped = y.t()
        first = self.head(y)
        y.mul_(10)
        return flipped.sum() + first.sum() + y.sum()


class _FirstColumns(nn.Module):
    def forward(self, y):
        self.viewed = y
        return y[:, :2]


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("site", ["t_1_2:1", "head"])
def test_the_original_of_a_view_site_is_its_value_before_a_later_write_to_what_it_views(site, frozen):
    """``op.original`` is the value the op made; a view's value changes when its base is written later, so it
    is kept as it was then, also when the view requires grad (its saved copy is detached, no longer a view)."""
    model = _ViewThenWrite().requires_grad_(not frozen)
    x = torch.randn(3, 4)
    with torch.no_grad():  # the forward by hand, the site's view replaced by its double
        y = model.fc(x)
        flipped, first = y.t(), y[:, :2]
        made = (flipped if site.startswith("t_") else first).clone()
        flipped, first = (made * 2, first) if site.startswith("t_") else (flipped, made * 2)
        y.mul_(10)
        expected = flipped.sum() + first.sum() + y.sum()
    log = tl.trace(model, x, intervene={site: tl.scale(2.0)})
    assert torch.equal(log[site].original, made)
    assert torch.equal(log[site].activation, made * 2)
    assert torch.equal(log.output.detach(), expected)

@pytest.mark.parametrize("name", sorted(CASES))
def test_replacing_every_op_with_an_equal_copy_changes_no_value(name):
    """Every op's value is swapped for a copy: the whole record-fixing path runs at each op (receivers of
    in-place ops, ops returning an argument, multi-output calls) and nothing may differ.  Views are kept:
    a copy of a view is no longer an alias, so a later write through it would not reach its base."""
    model, args, kwargs = CASES[name]
    plain, rng_plain = _seeded(lambda: tl.trace(model, args, kwargs), model)
    held = held_activations(plain)  # the next _seeded may restore buffers the plain trace holds
    copy_unless_view = {(lambda op: True): lambda t, op: None if t._base is not None else t.clone()}
    copied, rng_copied = _seeded(lambda: tl.trace(model, args, kwargs, intervene=copy_unless_view), model)
    assert torch.equal(rng_plain, rng_copied)
    assert structures_equal(plain.output, copied.output)[0]
    assert not differing_activations(held, copied)
    applied = [op for op in copied.ops if op.intervention is not None]
    assert len(applied) == sum(1 for op in plain.ops if op.kind == "op")
    assert any(op.original is not None for op in applied)
    assert [op.parents for op in copied.ops] == [op.parents for op in plain.ops]


# ----- nothing left behind ----------------------------------------------------------------------------
def test_model_and_parameters_unchanged_and_nothing_installed():
    model, args, _ = CASES["batchnorm_train"]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tl.trace(model, args)  # a plain train-mode trace updates the running stats once
    once = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    before = snapshot(model, args)
    log = tl.trace(model, args, intervene={"relu_1_4": tl.scale(2.0), "bn": tl.noise(0.1)})
    assert_untouched(before, snapshot(model, args))
    assert_clean_process()
    after = model.state_dict()
    assert all(torch.equal(after[k], once[k]) for k in once), "the reference pass updated the running stats too"
    assert len(log.interventions) == 2


class _DrawsFromGenerators(nn.Module):
    """Noise from a generator it holds and from one passed in, neither of them the global generator."""

    def __init__(self, relu_scale=1.0):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.own = torch.Generator().manual_seed(1)
        self.relu_scale = relu_scale  # the edit, made by hand

    def forward(self, x, passed):
        noisy = x + torch.randn(x.shape, generator=passed)
        return self.fc(noisy).relu() * self.relu_scale + torch.rand(4, generator=self.own)


def test_a_label_sites_reference_pass_leaves_the_models_own_and_passed_generators_as_it_found_them():
    x = torch.randn(2, 4)
    by_hand, traced = _DrawsFromGenerators(relu_scale=-3.0), _DrawsFromGenerators()
    traced.load_state_dict(by_hand.state_dict())
    passed_by_hand, passed_traced = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    expected = by_hand(x, passed_by_hand)
    log = tl.trace(traced, (x, passed_traced), intervene={"relu_1_4:1": tl.scale(-3.0)})  # resolved by an extra pass
    assert torch.equal(log.output, expected)
    assert torch.equal(passed_traced.get_state(), passed_by_hand.get_state())
    assert torch.equal(traced.own.get_state(), by_hand.own.get_state())


class _CountsItsCalls(nn.Module):
    """Keeps a step counter and a running sum as plain tensor attributes (not buffers), written in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.steps = torch.zeros(())
        self.sums = [torch.zeros(4)]

    def forward(self, x):
        self.steps += 1
        self.sums[0].add_(x.sum(0))
        return self.fc(x).relu() * self.steps + self.sums[0]


def test_a_label_sites_reference_pass_puts_back_tensors_a_module_holds_and_writes_in_place():
    # The extra pass that resolves label sites put back buffers but not plain tensor attributes: the intervened
    # run then counted its call twice (steps 2) and added the input twice, unlike the same edit by hand.
    x = torch.randn(3, 4)
    by_hand, traced = _CountsItsCalls(), _CountsItsCalls()
    traced.load_state_dict(by_hand.state_dict())
    by_hand.fc.register_forward_hook(lambda module, args, out: out * -3.0)
    expected = by_hand(x)
    log = tl.trace(traced, x, intervene={"linear_1_4:1": tl.scale(-3.0)})  # resolved by an extra pass
    assert torch.equal(log.output, expected)
    assert traced.steps.item() == 1 and torch.equal(traced.sums[0], by_hand.sums[0])


class _RaisesAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = F.relu(self.fc(x))
        if getattr(self, "armed", False):
            raise RuntimeError("boom")
        return y


@pytest.mark.parametrize("site", ["fc", "relu_1_2:1"])
def test_a_model_raising_inside_an_intervened_forward_leaves_nothing_behind(site):
    model, x = _RaisesAfter(), torch.randn(2, 4)
    reference = tl.trace(model, x, save="none")
    model.armed = True
    before = snapshot(model, (x,))
    with pytest.raises(RuntimeError, match="boom"):
        tl.trace(model, x, intervene={site: tl.zero_ablate()}, reference=reference)
    assert_untouched(before, snapshot(model, (x,)))
    assert_clean_process()


@pytest.mark.parametrize("site", ["fc", "relu_1_2:1"])
def test_an_action_raising_leaves_nothing_behind(site):
    model, x = _RaisesAfter(), torch.randn(2, 4)
    before = snapshot(model, (x,))
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def fails(t, op):
        raise ValueError("bad action")

    with pytest.raises(ValueError, match="bad action"):
        tl.trace(model, x, intervene={site: fails})
    assert_untouched(before, snapshot(model, (x,)))
    assert_clean_process()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


# ----- composition with save= ---------------------------------------------------------------------------
def test_interventions_compose_with_save_selections():
    model, args, _ = CASES["mlp"]
    full = tl.trace(model, args, intervene={"layers.0": tl.scale(0.5)})
    picked = tl.trace(model, args, intervene={"layers.0": tl.scale(0.5)}, save=["layers.0", "head"])
    assert torch.equal(full.output, picked.output)
    assert torch.equal(picked["layers.0"].activation, full["layers.0"].activation)
    assert torch.equal(picked["layers.0"].original, full["layers.0"].original)
    assert picked["layers.1"].activation is None
    none = tl.trace(model, args, intervene={"layers.0": tl.scale(0.5)}, save="none")
    assert torch.equal(none.output, full.output)
    assert none["layers.0"].intervention is not None and none["layers.0"].original is None



@pytest.mark.parametrize("save", [["cell:2"], ["linear_1_2:2"], ["tanh_1_4:2"]])
def test_a_selection_of_one_pass_keeps_the_original_only_where_it_keeps_the_value(save, tmp_path):
    """A selection naming one pass is applied after the forward: the values an edit replaced at the other
    passes go with their activations, in the trace and in its saved copy, instead of staying behind as
    originals of ops that hold no value."""
    model = LoopRNN(steps=4).eval()
    x = torch.randn(2, 8)
    sites = {"cell": tl.scale(2.0), "tanh_1_4": tl.scale(1.0)}
    full = tl.trace(model, x, intervene=sites)
    picked = tl.trace(model, x, intervene=sites, save=save)
    kept = [op.label for op in picked.ops if op.activation is not None]
    assert len(kept) == 1 and torch.equal(picked[kept[0]].original, full[kept[0]].original)
    assert [op.label for op in picked.ops if op.original is not None] == kept
    assert len(picked.interventions) == len(full.interventions) == 8
    loaded = tl.load(picked.save(tmp_path / "t"))
    assert [op.label for op in loaded.ops if op.original is not None] == kept


# ----- helper arguments no run could use: refused when the helper is made ----------------------------
@pytest.mark.parametrize("make, message", [
    # tl.scale(nan) and tl.clamp(min=nan) made every value NaN, without a word.
    (lambda: tl.scale(float("nan")), r"tl\.scale: k=nan is not a number \(NaN\); give a float, an int or a tensor"),
    (lambda: tl.clamp(min=float("nan")), r"tl\.clamp: min=nan is not a number \(NaN\)"),
    # torch.clamp with min above max sets every value to max: no clamp into a range.
    (lambda: tl.clamp(5, 1), r"tl\.clamp: min=5 is above max=1, so every value would become 1; give min <= max"),
    (lambda: tl.noise(-0.1), r"tl\.noise: std=-0\.1 is negative; give a standard deviation"),
    (lambda: tl.noise(float("inf")), r"tl\.noise: std=inf is infinite; give a standard deviation"),
    # torch refused a dimension named twice only at the site, mid-forward, in its own words.
    (lambda: tl.mean_ablate(dims=(0, 0)), r"tl\.mean_ablate: dims=\(0, 0\) names a dimension twice"),
    # dims=() gave the mean of the whole value (torch's mean reads no dimension as every one), not "no averaging".
    (lambda: tl.mean_ablate(dims=()), r"tl\.mean_ablate: dims=\(\) names no dimension, which torch's mean reads as "
                                      r"every dimension; .* dims=None for the mean of the whole value"),
])
def test_a_helper_value_no_run_could_use_is_refused_when_made(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_number_torch_cannot_compute_with_is_refused_when_the_helper_is_made():
    # tl.scale(Fraction(1, 2)) and tl.clamp(max=Decimal("1")) were taken, then failed at the site, mid-forward:
    # "unsupported operand type(s) for *: 'Tensor' and 'Fraction'".
    from decimal import Decimal
    from fractions import Fraction

    with pytest.raises(TypeError, match=r"tl\.scale: k=Fraction\(1, 2\) is a Fraction, which torch cannot compute "
                                        r"with; give a float, an int or a tensor \(float\(k\)\)"):
        tl.scale(Fraction(1, 2))
    with pytest.raises(TypeError, match=r"tl\.clamp: max=Decimal\('1'\) is a Decimal; give a float, an int"):
        tl.clamp(max=Decimal("1"))
    model, args, _ = CASES["mlp"]
    scaled = tl.trace(model, args, intervene={"head": tl.scale(0.5)}).output
    assert torch.equal(scaled, model(*args) * 0.5)


def test_a_helper_made_inside_a_traced_forward_records_no_op_of_its_own():
    # Checking the number a helper was given multiplies it by a tensor once; inside a traced forward that
    # product was recorded as one of the model's ops (a mul before the Linear).
    class MakesAHelper(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            self.made = tl.scale(0.5)
            return self.fc(x)

    log = tl.trace(MakesAHelper(), torch.randn(2, 4))
    assert [op.label for op in log.ops] == ["input_1:1", "linear_1_1:1", "output_1:1"]


def test_mean_ablate_naming_one_dimension_twice_from_both_ends_is_named_at_its_site():
    # dims=(0, -2) of a 2-d value is dimension 0 twice: torch's "dim 0 appears multiple times" came mid-forward.
    model, args, _ = CASES["mlp"]
    with pytest.raises(tl.InterventionError, match=r"mean_ablate\(dims=\(0, -2\)\) at head:1: dims=\(0, -2\) name "
                                                    r"one dimension of this value of shape \(4, 4\) twice"):
        tl.trace(model, args, intervene={"head": tl.mean_ablate(dims=(0, -2))})
    clamped = tl.trace(model, args, intervene={"head": tl.clamp(-0.1, 0.1)}).output
    assert torch.equal(clamped, model(*args).clamp(-0.1, 0.1))


@pytest.mark.parametrize("make", [lambda source: tl.mean_ablate(), lambda source: tl.patch_from(source)],
                         ids=["mean_ablate", "patch_from a row-major trace"])
def test_a_value_an_action_computes_keeps_the_memory_format_of_the_value_it_replaces(make):
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3))
    source = tl.trace(model, torch.randn(2, 3, 6, 6))  # row-major activations
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log = tl.trace(model, x, intervene={"1": make(source)})
        clean = log["1"].original
    replaced = log["1"].activation
    assert clean.is_contiguous(memory_format=torch.channels_last)
    assert replaced.stride() == clean.stride() and replaced.dtype == clean.dtype == torch.bfloat16


def test_the_one_line_form_of_an_intervened_trace_says_it_was_intervened_on():
    """A clean and a patched trace of one model printed side by side (a list of them, a notebook cell) looked
    alike: print(log) said an op was changed, repr(log) did not."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    x = torch.randn(3, 4)
    clean = tl.trace(model, x)
    ablated = tl.trace(model, x, intervene={"1": tl.zero_ablate()})
    assert "intervention" not in repr(clean)
    assert repr(ablated) == "<Trace of Sequential: 5 ops, 5 layers, 3 module calls, 1 op changed by interventions>"
    assert torch.equal(ablated.output, model[2](torch.zeros(3, 4)))
