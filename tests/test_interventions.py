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
    lstm_out = plain["lstm:1"]  # the call's last output op; name the first by its own label
    first = next(op for op in plain.ops if op.type == "lstm" and op.multi_output_index == 0)

    def zero_first(module, inputs, output):
        y, hidden = output
        return torch.zeros_like(y), hidden

    expected = with_hook(model.lstm, model, args, zero_first)
    log = tl.trace(model, args, intervene={first.label: tl.zero_ablate()})
    assert torch.equal(log.output, expected)
    others = [op.label for op in plain.ops if op.type == "lstm" and op.label != first.label]
    assert all(torch.equal(log[k].activation, plain[k].activation) for k in others)
    assert lstm_out.label in others
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
    with pytest.raises(tl.InterventionError, match="never reached"):
        tl.trace(model, x, intervene={"fc:4": tl.zero_ablate()})


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


def test_a_predicate_site_selects_ops_by_metadata():
    model, args, _ = CASES["mlp"]
    log = tl.trace(model, args, intervene={(lambda op: op.type == "relu"): tl.clamp(max=0.1)})
    relus = [op for op in log.ops if op.type == "relu"]
    assert len(log.interventions) == len(relus) == 3
    assert all(bool(op.activation.max() <= torch.tensor(0.1)) for op in relus)


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


def test_a_module_site_may_use_an_alias_address():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model.alias = model[0]
    x = torch.randn(2, 4)
    by_alias = tl.trace(model, x, intervene={"alias": tl.zero_ablate()})
    by_name = tl.trace(model, x, intervene={"0": tl.zero_ablate()})
    assert torch.equal(by_alias.output, by_name.output) and torch.equal(by_alias.output, torch.zeros(2, 4))
    clean = tl.trace(model, x * 2)
    patched = tl.trace(model, x, intervene={"alias:1": tl.patch_from(clean)})
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
        tl.trace(Positions(), x, intervene={(lambda op: True): tl.scale(2.0)})
    floats = tl.trace(Positions(), x, intervene={(lambda op: op.dtype.is_floating_point): tl.scale(2.0)})
    assert torch.equal(floats.output, 2 * (x + torch.arange(4)))
