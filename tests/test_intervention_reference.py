"""Runs checked against the reference trace their label sites were resolved against: a forward that ran one
op past the reference's end is refused, and a stopped trace takes the reference's labels only when its ops
are, op for op, those the reference made."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl
import real_models


class _Repeat(nn.Module):
    """``tanh`` applied ``n`` times: the run's length is set by an argument, not by the values."""

    def forward(self, x, n):
        for _ in range(n):
            x = torch.tanh(x)
        return x


class _SignBranch(nn.Module):
    """A positive input goes through ``relu``, any other through ``sigmoid``; both then reach the same ``add``."""

    def forward(self, x):
        h = torch.relu(x) if x.sum() > 0 else torch.sigmoid(x)
        return h + 1


def test_a_predicate_site_of_a_run_one_op_longer_than_its_reference_is_refused():
    # The one op past the reference's end is made by the call right after its last: a check that began one
    # call later would pass the run off as an edit of every tanh when its last was not edited.
    model, x = _Repeat(), torch.randn(2, 3)
    reference = tl.trace(model, (x,), {"n": 2})
    assert len(reference.calls) == 2
    with pytest.raises(tl.InterventionError, match="this forward ran longer") as caught:
        tl.trace(model, (x,), {"n": 3}, intervene={(lambda op: op.type == "tanh"): tl.scale(2.0)},
                 reference=reference)
    assert "tanh_3_3" in str(caught.value)


def test_a_stopped_trace_that_took_another_path_keeps_its_own_labels():
    # The stop site matches (the same add from the same line), but the op before it is sigmoid where the
    # reference ran relu: the reference's labels would call the sigmoid a relu.
    model = _SignBranch()
    positive = torch.rand(2, 3) + 0.1
    reference = tl.trace(model, positive)
    add = next(op.label for op in reference.ops if op.type == "add")
    stopped = tl.trace(model, -positive, stop_after=add, reference=reference)
    assert stopped.stopped_after == add
    squash = next(op for op in stopped.ops if op.func_name == "sigmoid")
    assert squash.type == "sigmoid" and squash.label.startswith("sigmoid")
    assert not any(op.label.startswith("relu") for op in stopped.ops)
    assert torch.equal(stopped[squash.label].activation, torch.sigmoid(-positive))
    same_path = tl.trace(model, positive * 2, stop_after=add, reference=reference)
    assert [op.label for op in same_path.ops] == [op.label for op in reference.ops][:len(same_path.ops)]


class _Grow(nn.Module):
    """Adds ``grow(x)`` until the sum reaches 3, then a head: the edit sets how many passes the loop makes, and
    ops the sites do not name follow the loop."""

    def __init__(self):
        super().__init__()
        self.grow, self.head = nn.Linear(2, 2), nn.Linear(2, 2)
        with torch.no_grad():
            self.grow.weight.zero_()
            self.grow.bias.fill_(1.0)  # each pass adds 1 to every element: two passes unedited

    def forward(self, x):
        h = torch.zeros_like(x)
        while h.sum() < 3:
            h = h + self.grow(x)
        return self.head(h)


def test_a_layer_site_whose_edit_makes_a_loop_run_longer_is_refused():
    # Halved, the loop made a third pass, at the position of the reference's head: no site was placed there and
    # the check looked only past the reference's last call, so the trace came back as an edit of every pass while
    # the third ran unedited (its output that of h = 2 where halving every pass gives 1.5).
    model, x = _Grow(), torch.ones(1, 2)
    layer = next(op.layer_label for op in tl.trace(model, x).ops if op.module == "grow:1")
    with pytest.raises(tl.InterventionError, match=rf"also name {layer}:3, which the reference run .* did not make: "
                                                   "this forward ran longer"):
        tl.trace(model, x, intervene={layer: tl.scale(0.5)})
    handle = model.grow.register_forward_hook(lambda module, args, out: out * 0.5)
    try:
        expected = model(x)
    finally:
        handle.remove()
    every_call = tl.trace(model, x, intervene={"grow": tl.scale(0.5)})  # the way out the error names
    assert torch.equal(every_call.output, expected)
    assert torch.equal(expected, model.head(torch.full((1, 2), 1.5)))


class _Normalized(nn.Module):
    """``F.normalize``, a torch function written in Python: one op, or four with ``deep=True``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(nn.functional.normalize(self.a(x)) + 1)


@pytest.mark.parametrize("option", ["intervene", "stop_after"])
def test_a_reference_traced_with_another_deep_is_named_as_why_the_path_differs(option):
    # A reference without deep= numbers normalize's four inner ops as one: its add_1_3:1 is the deep run's
    # clamp_min, and the refusal said only that the forward took another path, as if the inputs had differed.
    model, x = _Normalized(), torch.randn(2, 4)
    reference = tl.trace(model, x, save="none")
    site = {"intervene": {"intervene": {"add_1_3:1": tl.zero_ablate()}}, "stop_after": {"stop_after": "add_1_3:1"}}
    with pytest.raises(tl.InterventionError, match="another path") as refused:
        tl.trace(model, x, deep=True, reference=reference, **site[option])
    assert "The reference was traced with deep=False and this trace has deep=True" in str(refused.value)
    assert "trace the reference with deep=True" in str(refused.value)
    deep = tl.trace(model, x, deep=True, reference=tl.trace(model, x, save="none", deep=True), stop_after="add_1_6:1")
    assert deep.ops[-1].label == "add_1_6:1" and deep.ops[-2].func_name == "div"


@pytest.mark.parametrize("option", ["intervene", "stop_after"])
def test_a_label_missing_from_a_reference_traced_with_deep_names_the_deep_option(option):
    # The other way round the label itself is missing from the reference (its add is add_1_6:1 there): the
    # refusal listed the closest labels only, not why this run's labels are not the reference's.
    model, x = _Normalized(), torch.randn(2, 4)
    reference = tl.trace(model, x, save="none", deep=True)
    site = {"intervene": {"intervene": {"add_1_3:1": tl.zero_ablate()}}, "stop_after": {"stop_after": "add_1_3:1"}}
    with pytest.raises(KeyError, match="add_1_3:1") as refused:
        tl.trace(model, x, reference=reference, **site[option])
    assert "The reference was traced with deep=True and this trace has deep=False" in str(refused.value)
    assert "trace the reference with deep=False" in str(refused.value)
    log = tl.trace(model, x, reference=tl.trace(model, x, save="none"), **site[option])
    if option == "stop_after":
        assert log.ops[-1].label == "add_1_3:1"
    else:
        assert [a.label for a in log.interventions] == ["add_1_3:1"]


def test_a_reference_traced_from_another_model_is_refused_naming_it():
    # A reference of another model answered a label of this trace with "no op ... named 'relu_1_2:1' in this trace"
    # (the user's trace holds it), and a module site ran with the reference unread.
    import copy

    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(2, 4)
    other = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Sigmoid(), nn.Linear(4, 2))
    reference = tl.trace(other, x)
    for site in ("relu_1_2:1", "0"):
        with pytest.raises(tl.InterventionError, match=r"reference= is a trace of another model \(Sequential, whose 1 "
                                                       r"is a GELU, which this model does not have there\)"):
            tl.trace(model, x, intervene={site: tl.zero_ablate()}, reference=reference)
    # A copy of the model (the same classes at the same addresses) is left to the path's checks, as before.
    with pytest.raises(tl.InterventionError, match=r"module 1 is another object than the one the reference trace ran"):
        tl.trace(model, x, intervene={"relu_1_2:1": tl.zero_ablate()}, reference=tl.trace(copy.deepcopy(model), x))


def test_a_callable_holding_a_cache_across_calls_is_named_as_why_its_path_changed():
    """A decoding step written as a closure over one DynamicCache grows that cache in the pass that resolves label
    sites, so the intervened run attends over more positions; the refusal named only other inputs as the cause.
    It now says the reference was a pass of these same inputs, and that state the callable keeps between calls
    makes each run differ."""
    pytest.importorskip("transformers")
    from transformers import DynamicCache

    torch.manual_seed(0)
    model, _, kwargs = real_models.CORPUS["gpt2"]()
    model.eval()
    ids, cache = kwargs["input_ids"][:1], DynamicCache()
    step = tl.trace(lambda i: model(i, past_key_values=cache, use_cache=True).logits, ids, root=model)
    site = next(op.label for op in step.ops if op.func_name == "scaled_dot_product_attention")
    cache = DynamicCache()
    with pytest.raises(tl.InterventionError, match="another path .* The reference was a pass of these same inputs, "
                                                   r"made first.*keeping state of its own between calls \(a cache"):
        tl.trace(lambda i: model(i, past_key_values=cache, use_cache=True).logits, ids, root=model,
                 intervene={site: tl.scale(0.5)})
