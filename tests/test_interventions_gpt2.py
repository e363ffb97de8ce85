"""Interventions on a transformers GPT-2 built from a small config: patching from a clean run, module
sites against forward hooks, one attention head, activation and attribution patching tables."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from hooked import differing_activations, keep, with_hook  # noqa: E402
from real_models import small_gpt2_lm  # noqa: E402


@pytest.fixture(scope="module")
def gpt2():
    pytest.importorskip("transformers")
    model = small_gpt2_lm()
    clean = torch.tensor([[5, 9, 13, 21, 7, 30]])
    corrupt = clean.clone()
    corrupt[0, 1] = 40
    return model, clean, corrupt


def _logit_diff(output):
    return output.logits[0, -1, 11] - output.logits[0, -1, 12]


def test_gpt2_patching_the_last_block_from_the_clean_run_restores_the_clean_logits(gpt2):
    model, clean, corrupt = gpt2
    clean_log = tl.trace(model, clean)
    corrupt_log = tl.trace(model, corrupt)
    patched = tl.trace(model, corrupt, intervene={"transformer.h.1": tl.patch_from(clean_log)})
    assert torch.equal(patched.output.logits, clean_log.output.logits)
    assert not torch.equal(corrupt_log.output.logits, clean_log.output.logits)
    # Upstream of the site the patched run is the corrupted run, bit for bit.
    site = patched["transformer.h.1"].index
    upstream = [op.label for op in patched.ops[:site] if op.activation is not None]
    assert upstream and all(torch.equal(patched[k].activation, corrupt_log[k].activation) for k in upstream)


def test_gpt2_module_site_equals_a_forward_hook(gpt2):
    model, clean, _ = gpt2
    expected = with_hook(model.transformer.h[0].mlp, model, (clean,), lambda m, i, o: o * 0.25).logits
    log = tl.trace(model, clean, intervene={"transformer.h.0.mlp": tl.scale(0.25)})
    assert torch.equal(log.output.logits, expected)



def test_gpt2_module_site_edits_after_the_modules_own_hook(gpt2):
    model, clean, _ = gpt2
    mlp = model.transformer.h[0].mlp
    own = mlp.register_forward_hook(lambda m, i, o: o + 1.0)
    try:
        expected = with_hook(mlp, model, (clean,), lambda m, i, o: o * 0.25).logits  # registered after own
        log = tl.trace(model, clean, intervene={"transformer.h.0.mlp": tl.scale(0.25)})
    finally:
        own.remove()
    assert torch.equal(log.output.logits, expected)

def test_gpt2_one_attention_head_ablated_at_the_sdpa_output(gpt2):
    model, clean, _ = gpt2
    plain = tl.trace(model, clean)
    sdpa = [op for op in plain.ops if op.type == "scaleddotproductattention"]
    assert len(sdpa) == 2 and sdpa[0].shape[1] == 4  # (batch, heads, positions, head dim)
    log = tl.trace(model, clean, intervene={sdpa[0].label: tl.zero_ablate(at=(slice(None), 2))})
    value = log[sdpa[0].label].activation
    assert torch.equal(value[:, 2], torch.zeros_like(value[:, 2]))
    keep = [0, 1, 3]
    assert torch.equal(value[:, keep], plain[sdpa[0].label].activation[:, keep])
    assert not torch.equal(log.output.logits, plain.output.logits)


def test_gpt2_activation_and_attribution_patching_tables(gpt2):
    model, clean, corrupt = gpt2
    sites = ["transformer.h.0:1", "transformer.h.0.attn:1", "transformer.h.1.mlp:1", "transformer.ln_f:1"]
    exact = tl.report.activation_patching(model, clean, corrupt, _logit_diff, sites=sites, progress=False)
    assert list(exact.site) == sites and not exact.error.any()
    by_site = exact.set_index("site").normalized
    assert by_site["transformer.ln_f:1"] == 1.0  # everything downstream of ln_f is the clean run
    with torch.no_grad():
        patched = tl.trace(model, corrupt, intervene={"transformer.h.0.attn:1": tl.patch_from(tl.trace(model, clean))})
    assert exact.set_index("site").metric["transformer.h.0.attn:1"] == pytest.approx(_logit_diff(patched.output).item())
    estimate = tl.report.attribution_patching(model, clean, corrupt, _logit_diff)
    calls = estimate[estimate.kind == "module call"].set_index("site").normalized
    assert calls["lm_head:1"] == pytest.approx(1.0, abs=1e-4)  # the metric is linear in the logits
    assert set(sites) <= set(calls.index)
    agreement = torch.corrcoef(torch.tensor([list(by_site[sites]), list(calls[sites])]))[0, 1]
    assert agreement > 0.9
    assert (estimate.kind == "op").sum() == sum(1 for op in tl.trace(model, clean, save="none").ops if op.kind == "op")


def test_gpt2_attribution_of_a_call_returning_the_cache_its_attention_read_counts_each_change_once(gpt2):
    """transformer:1 returns the hidden states and the key/value tensors its attention read: summing the estimate
    of those too counted their effect twice (2.19 for a call whose exact patching restores 1.00)."""
    model, clean, corrupt = gpt2
    estimate = tl.report.attribution_patching(model, clean, corrupt, _logit_diff).set_index("site")
    row = estimate.loc["transformer:1"]
    # ln_f's output is transformer:1's hidden-state output: the same value, so the same estimate
    assert row.estimate == pytest.approx(estimate.loc["transformer.ln_f:1"].estimate)
    assert row.normalized == pytest.approx(1.0, abs=1e-3) and "leaves out the outputs the call itself read" in row.note
    exact = tl.report.activation_patching(model, clean, corrupt, _logit_diff, sites=["transformer"], progress=False)
    assert exact.normalized[0] == 1.0
    assert estimate.loc["transformer.ln_f:1"].note == ""


def test_gpt2_patching_tables_of_a_callable_with_root_match_the_models(gpt2):
    """``lambda ids: model(ids)`` with ``root=model``: its modules are the model's module sites, and the table is
    the model's own; without ``root=`` each module row says to pass it."""
    model, clean, corrupt = gpt2
    sites = ["transformer.h.0:1", "transformer.h.1.mlp:1", "transformer.ln_f:1"]
    direct = tl.report.activation_patching(model, clean, corrupt, _logit_diff, sites=sites, progress=False)
    through = tl.report.activation_patching(lambda ids: model(ids), clean, corrupt, _logit_diff, sites=sites,
                                            progress=False, root=model)
    assert not through.error.any() and list(through.metric) == list(direct.metric)
    every = tl.report.activation_patching(lambda ids: model(ids), clean, corrupt, _logit_diff, progress=False,
                                          root=model)
    assert "root module itself" in every.set_index("site").error["self:1"]
    estimate = tl.report.attribution_patching(lambda ids: model(ids), clean, corrupt, _logit_diff, root=model)
    assert estimate.set_index("site").normalized["lm_head:1"] == pytest.approx(1.0, abs=1e-4)
    norm = next(op.layer_label for op in tl.trace(lambda ids: model(ids), clean, save="none").ops
                if op.func_name == "layer_norm")
    unnamed = tl.report.activation_patching(lambda ids: model(ids), clean, corrupt, _logit_diff, progress=False,
                                            sites=[norm])
    assert not unnamed.error.any() and unnamed.metric.notna().all()  # op labels need no model
    rows = tl.report.activation_patching(lambda ids: model(ids), clean, corrupt, _logit_diff, progress=False)
    assert rows.metric.isna().all() and rows.error.str.contains("pass root=").all()


def test_activation_patching_by_position_and_its_heatmap(gpt2, tmp_path):
    model, clean, corrupt = gpt2
    table = tl.report.activation_patching(model, clean, corrupt, _logit_diff, sites=["transformer.h.1"],
                                          positions=1, progress=False)
    assert list(table.position) == list(range(clean.shape[1]))
    clean_log = tl.trace(model, clean)
    at_two = tl.trace(model, corrupt, intervene={"transformer.h.1": tl.patch_from(clean_log, at=(slice(None), 2))})
    assert table.metric[2] == pytest.approx(_logit_diff(at_two.output).item())
    tl.viz.heatmap(table)  # twice: the function must stay the function after its module is imported
    svg = tl.viz.heatmap(table, tmp_path / "h.svg").read_text()
    assert svg.count("<rect") == clean.shape[1]
    assert "#ff0000" in svg  # the last position restores the clean metric fully: the saturated cell
    with pytest.raises(KeyError, match="closest"):
        tl.report.activation_patching(model, clean, corrupt, _logit_diff, sites=["transformer.h.7"], progress=False)


def test_gpt2_identity_at_every_op_and_module_is_bit_identical(gpt2):
    model, clean, _ = gpt2
    plain = tl.trace(model, clean)
    sites = {(lambda op: True): keep, **{mc.module.address: keep for mc in plain.module_calls}}
    touched = tl.trace(model, clean, intervene=sites)
    assert torch.equal(plain.output.logits, touched.output.logits)
    assert not differing_activations(plain, touched)
    assert len(touched.interventions) == sum(1 for op in plain.ops if op.kind == "op")


@pytest.mark.parametrize("reentrant", [False, True])
def test_gpt2_with_gradient_checkpointing_refuses_an_edit_inside_a_block(reentrant):
    """transformers runs each block through torch.utils.checkpoint in train mode: the backward would
    recompute the block without the edit.  Refused, saying what to do; with checkpointing off it runs."""
    pytest.importorskip("transformers")
    model = small_gpt2_lm()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    ids = torch.tensor([[5, 9, 13, 21]])
    with pytest.raises(tl.InterventionError, match="checkpoint region.*gradient_checkpointing_disable"):
        tl.trace(model, ids, intervene={"transformer.h.0.mlp": tl.scale(0.5)})
    model.gradient_checkpointing_disable()
    model.eval()
    expected = with_hook(model.transformer.h[0].mlp, model, (ids,), lambda m, i, o: o * 0.5).logits
    log = tl.trace(model, ids, intervene={"transformer.h.0.mlp": tl.scale(0.5)})
    assert torch.equal(log.output.logits, expected)


def test_gpt2_mean_ablate_and_steer_at_one_position_read_dimensions_of_the_whole_value(gpt2):
    """``dims`` and ``dim`` name dimensions of the whole (batch, seq, d) value; ``at=`` only picks the part
    changed: the mean over the positions put at position 2, a direction added along d at position 3."""
    model, clean, corrupt = gpt2
    batch = torch.cat([clean, corrupt])
    mlp = model.transformer.h[0].mlp

    def mean_at_2(module, inputs, output):
        hidden = output.clone()
        hidden[:, 2] = output.mean(1)
        return hidden

    expected = with_hook(mlp, model, (batch,), mean_at_2).logits
    log = tl.trace(model, batch, intervene={"transformer.h.0.mlp": tl.mean_ablate(dims=1, at=(slice(None), 2))})
    assert torch.allclose(log.output.logits, expected, atol=1e-6)

    direction = torch.linspace(-1, 1, 32)

    def steer_at_3(module, inputs, output):
        hidden = output.clone()
        hidden[:, 3] += 2.0 * direction
        return hidden

    expected = with_hook(mlp, model, (batch,), steer_at_3).logits
    steered = tl.steer(direction, 2.0, dim=2, at=(slice(None), 3))
    log = tl.trace(model, batch, intervene={"transformer.h.0.mlp": steered})
    assert torch.allclose(log.output.logits, expected, atol=1e-6)


@pytest.mark.parametrize("helper, wrong", [
    (lambda: tl.steer(torch.linspace(-1, 1, 32), dim=5), r"5 is not a dimension of this value of shape \(1, 6, 32\)"),
    (lambda: tl.steer(torch.linspace(-1, 1, 32), dim=-4), r"-4 is not a dimension .* \(dimensions -3 to 2\)"),
    (lambda: tl.mean_ablate(dims=(1, 3)), r"3 is not a dimension of this value of shape \(1, 6, 32\)"),
    (lambda: tl.zero_ablate(at=(slice(None), 10)), r"at=\(slice\(None, None, None\), 10\) is outside this value"),
    (lambda: tl.scale(2.0, at=(0, 0, 40)), r"scale\(2.0, at=\(0, 0, 40\)\) at transformer.h.0.mlp:1: at=.* is outside"),
    # a vector of another length was a plain ValueError, which a patching table does not report in the site's row
    (lambda: tl.steer(torch.ones(6)), r"the vector has 6 entries but dimension -1 of the value \(of shape \(1, 6, 32"),
    # a source trace of another model was a plain KeyError, raised past a patching table's row
    (lambda: tl.patch_from(tl.trace(torch.nn.Linear(2, 2), torch.ones(1, 2))), r"the source trace has no op at"),
], ids=["steer-dim-5", "steer-dim-minus-4", "mean-dims-3", "zero-at-10", "scale-at-40", "steer-length-6",
        "patch-from-another-model"])
def test_a_helper_given_a_dimension_or_index_the_value_lacks_is_refused_naming_the_site(gpt2, helper, wrong):
    """A dimension past the value's rank is refused, not taken modulo it (``dim=5`` of a (batch, seq, d) value
    was quietly d), and an index past its shape names the helper, the site and the shape."""
    model, clean, _ = gpt2
    with pytest.raises(tl.InterventionError, match=wrong):
        tl.trace(model, clean, intervene={"transformer.h.0.mlp": helper()})
    direction = torch.linspace(-1, 1, 32)
    expected = with_hook(model.transformer.h[0].mlp, model, (clean,), lambda m, i, o: o + direction).logits
    log = tl.trace(model, clean, intervene={"transformer.h.0.mlp": tl.steer(direction, dim=2)})
    assert torch.equal(log.output.logits, expected)


def test_gpt2_sites_past_stop_after_are_named_not_dropped_silently(gpt2):
    model, clean, _ = gpt2
    before, after = "transformer.h.0.attn", "transformer.h.1.mlp"
    every_tanh = lambda op: op.func_name == "tanh"  # noqa: E731  GELU's tanh: ops on both sides of the stop
    with pytest.warns(UserWarning, match=r"'transformer\.h\.1\.mlp' come after transformer\.h\.0:1") as seen:
        log = tl.trace(model, clean, intervene={before: tl.zero_ablate(), after: tl.zero_ablate(),
                                                every_tanh: tl.scale(2.0)}, stop_after="transformer.h.0")
    message = str(seen[0].message)
    assert before not in message and "<predicate>" not in message  # both changed something before the stop
    applied = [applied.site for applied in log.interventions]
    assert before in applied and every_tanh in applied and after not in applied
    assert not log["transformer.h.0.attn"].activation.any()  # the edit did land before the stop


def test_patching_between_runs_of_other_shapes_is_refused_not_broadcast(gpt2):
    """A clean prompt of another length or batch has no value at a site that stands for the corrupted run's:
    ``tl.patch_from`` refuses it (broadcast, one clean row would be written into every corrupted row), and
    attribution patching gives NaN with the reason instead of an error or a broadcast product."""
    model, clean, _ = gpt2
    shorter = torch.tensor([[5, 40, 13, 21, 7]])
    clean_log = tl.trace(model, clean)
    with pytest.raises(ValueError, match=r"shape \(1, 6, 32\) but this run's has \(1, 5, 32\)"):
        tl.trace(model, shorter, intervene={"transformer.h.0:1": tl.patch_from(clean_log)})
    batch = torch.cat([clean, shorter[:, :1].expand(1, 6)])
    exact = tl.report.activation_patching(model, clean, batch, _logit_diff, sites=["transformer.h.1:1"], progress=False)
    assert exact.metric.isna().all() and "patch between runs of the same shape" in exact.error[0]
    for corrupt in (shorter, batch):
        estimate = tl.report.attribution_patching(model, clean, corrupt, _logit_diff)
        calls = estimate[estimate.kind == "module call"].set_index("site")
        assert math.isnan(calls.estimate["transformer.h.1:1"])
        assert "but the corrupted run's" in calls.note["transformer.h.1:1"]


def test_mean_ablate_from_runs_of_another_length_is_refused_not_broadcast(gpt2):
    """The batch mean of another trace stands for this run's value only where the two agree outside the
    averaged dimensions: the mean of one-token prompts would otherwise be written at all six positions."""
    model, clean, _ = gpt2
    one_token = tl.trace(model, torch.tensor([[5], [7], [9]]))
    with pytest.raises(tl.InterventionError, match=r"\(3, 1, 32\) but this run's has \(1, 6, 32\), which differ "
                                                   r"outside the dimensions averaged over \(0\)"):
        tl.trace(model, clean, intervene={"transformer.h.0": tl.mean_ablate(trace=one_token)})
    other_batch = tl.trace(model, torch.cat([clean, clean.flip(1)]))  # another batch size, the same length
    log = tl.trace(model, clean, intervene={"transformer.h.0": tl.mean_ablate(trace=other_batch)})
    mean = other_batch["transformer.h.0"].activation.mean(0, keepdim=True)
    assert torch.equal(log["transformer.h.0"].activation, mean)
    everything = tl.trace(model, clean, intervene={"transformer.h.0": tl.mean_ablate(dims=None, trace=one_token)})
    assert torch.equal(everything["transformer.h.0"].activation[0, 3],
                       one_token["transformer.h.0"].activation.mean().expand(32))


def test_patching_by_position_between_prompts_of_other_lengths_is_refused_in_every_row(gpt2):
    """Index 2 of a 6-token run and of a 5-token run are not the same place: each row says why, instead of
    patching the indices both runs have and failing with an index error past the shorter one."""
    model, clean, _ = gpt2
    shorter = torch.tensor([[5, 40, 13, 21, 7]])
    table = tl.report.activation_patching(model, clean, shorter, _logit_diff, positions=1, progress=False,
                                          sites=["transformer.h.0"])
    assert list(table.position) == list(range(6)) and table.metric.isna().all()
    assert table.error.str.contains(r"\(1, 6, 32\) but this run's has \(1, 5, 32\)").all()


def test_patching_by_position_gives_a_site_without_that_dimension_a_row_saying_so(gpt2, tmp_path):
    """``sites="ops"`` holds 1-d values (the position ids' ``arange``): each has one row with the reason,
    and the other sites their rows by position, instead of no table at all."""
    model, clean, corrupt = gpt2
    flat = next(op.label for op in tl.trace(model, clean).ops if op.kind == "op" and len(op.shape) == 1)
    table = tl.report.activation_patching(model, clean, corrupt, _logit_diff, sites=[flat, "transformer.h.1"],
                                          positions=1, progress=False)
    row = table[table.site == flat]
    assert len(row) == 1 and row.metric.isna().all() and "with no dimension 1" in row.error.iloc[0]
    assert list(table[table.site == "transformer.h.1"].position) == list(range(clean.shape[1]))
    tl.viz.heatmap(table, tmp_path / "h.svg")


@pytest.mark.parametrize("site", ["transformer.h.0", "add_6_54:1"])
def test_a_steering_vector_learnt_on_a_frozen_gpt2_gives_the_site_its_gradient(site):
    """Frozen weights: the site's own value needs no gradient, the steered one does (through the vector).
    The site's gradient is the steered value's, as retain_grad() on the value a forward hook returns gives,
    not None as if no backward had reached it."""
    pytest.importorskip("transformers")
    model = small_gpt2_lm().requires_grad_(False)
    tokens = torch.tensor([[5, 9, 13, 21, 7, 30]])
    vector = torch.randn(32, requires_grad=True)
    steered = {}

    def steer_and_keep(module, args, output):
        steered["value"] = output + vector
        steered["value"].retain_grad()
        return steered["value"]

    handle = model.transformer.h[0].register_forward_hook(steer_and_keep)
    try:
        model(tokens).logits[0, -1, 3].backward()
    finally:
        handle.remove()
    expected_vector_grad, vector.grad = vector.grad, None

    log = tl.trace(model, tokens, grads=True, intervene={site: tl.steer(vector)})
    assert log[site].label == "add_6_54:1"  # the block's output op
    log.backward(log.output.logits[0, -1, 3])
    assert log[site].requires_grad and log[site].has_grad
    assert torch.equal(log[site].grad, steered["value"].grad)
    assert torch.equal(vector.grad, expected_vector_grad)


@pytest.mark.parametrize("option", ["intervene", "stop_after"])
def test_a_module_list_as_a_site_is_refused_before_the_forward_naming_its_modules(gpt2, option):
    """``transformer.h`` holds the blocks but is never called: refused before the model runs, naming the
    blocks, instead of after a whole forward as a call that control flow skipped."""
    model, clean, _ = gpt2
    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    options = {"intervene": {"transformer.h": tl.zero_ablate()}} if option == "intervene" else \
        {"stop_after": "transformer.h"}
    try:
        with pytest.raises(tl.InterventionError, match=r"'transformer.h' is a ModuleList, a container .* never "
                                                        r"called.* \(transformer.h.0, transformer.h.1\)"):
            tl.trace(model, clean, **options)
    finally:
        handle.remove()
    assert forwards == []
    assert torch.equal(tl.trace(model, clean, intervene={"transformer.h.0": tl.zero_ablate()})["transformer.h.0"]
                       .activation, torch.zeros(1, 6, 32))


@pytest.mark.parametrize("site", ["transformer.h.0.mlp", "dropout_3_53:1", "transformer.h.1.ln_1"])
def test_what_an_action_makes_autograd_keep_is_counted_at_its_site_not_the_next_op(gpt2, site):
    """``tl.clamp`` keeps its input for backward.  saved_for_backward=True counts it at the op the action ran
    at: the next op (an ``add`` that keeps nothing) keeps what it kept in a plain trace.  The bytes are those
    the same clamp keeps in an untraced forward hook, seen by a saved-tensors hook of the test's own."""
    model, clean, _ = gpt2
    module = model.get_submodule(site if site.startswith("transformer.") else "transformer.h.0.mlp")
    clamping, packed = [], {}

    def pack(t):
        if clamping:
            packed[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def clamp_hook(m, args, output):
        clamping.append(True)
        try:
            return output.clamp(-0.1, 0.1)
        finally:
            clamping.pop()

    handle = module.register_forward_hook(clamp_hook)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(clean)
    finally:
        handle.remove()

    plain = tl.trace(model, clean, saved_for_backward=True)
    log = tl.trace(model, clean, saved_for_backward=True, intervene={site: tl.clamp(-0.1, 0.1)})
    site_op = log[site]
    changed = {op.label: op.saved_for_backward_bytes - before.saved_for_backward_bytes
               for op, before in zip(log.ops, plain.ops)
               if op.saved_for_backward_bytes != before.saved_for_backward_bytes}
    assert packed and changed == {site_op.label: sum(packed.values())}


def test_an_intervened_gpt2_trace_validates_its_sites_against_the_values_they_made(gpt2):
    # Each site's replay is compared with op.original (the value the op made), later ops with what they
    # read; before, every site read as a MISMATCH, so an intervened trace could never pass.
    model, clean, corrupt = gpt2
    clean_log = tl.trace(model, clean)
    for intervene in ({"transformer.h.0.mlp": tl.patch_from(clean_log)},
                      {(lambda op: op.type in ("tanh", "scaleddotproductattention")): tl.scale(0.5)}):
        log = tl.trace(model, corrupt, intervene=intervene)
        sites = [op for op in log.ops if op.intervention is not None]
        assert sites and all(op.original is not None for op in sites)
        result = log.validate()
        assert result.passed and not result.mismatched, str(result)
        replayed = {label for label, _ in result.not_replayed}
        assert not replayed & {op.label for op in sites}, str(result)
    # A value written over after the trace still shows: the site's saved original is compared.
    log = tl.trace(model, corrupt, intervene={"transformer.h.0.mlp": tl.zero_ablate()})
    site = next(op for op in log.ops if op.intervention is not None)
    log._originals[site.index] = site.original + 1
    result = log.validate()
    assert [label for label, _ in result.mismatched] == [site.label], str(result)
    assert "value it made" in result.mismatched[0][1]


def test_an_action_returning_a_tensor_the_forward_holds_is_refused(gpt2):
    # An action at the attention returning the layer norm's output (which the forward holds) made the value
    # two ops' output at once: the record named the attention site as the parent of the norm's other
    # readers too, a plausible wrong graph.  It is refused, with the way out; a copy is fine.
    model, clean, _ = gpt2
    held = {}

    def keep_normed(tensor, op):
        held["normed"] = tensor
        return None

    sites = {"transformer.h.0.ln_1": keep_normed, "transformer.h.0.attn": lambda t, op: held["normed"]}
    with pytest.raises(tl.InterventionError, match=r"returned a tensor the forward already holds.*clone\(\)"):
        tl.trace(model, clean, intervene=sites)
    copied = tl.trace(model, clean, intervene={**sites, "transformer.h.0.attn": lambda t, op: held["normed"].clone()})
    site = next(op for op in copied.ops if op.intervention is not None
                and op.intervention.site == "transformer.h.0.attn")
    assert torch.equal(site.activation, held["normed"])
    # A parameter returned as the value, at a label site: its readers would read as reading the parameter.
    linear = torch.nn.Linear(4, 4)
    with pytest.raises(tl.InterventionError, match="already holds"):
        tl.trace(torch.nn.Sequential(linear, torch.nn.ReLU()), torch.randn(4, 4),
                 intervene={"relu_1_2": lambda t, op: linear.weight})


@pytest.mark.parametrize("helper", [tl.zero_ablate, tl.mean_ablate, tl.steer, tl.noise])
def test_gpt2_a_helper_given_uncalled_is_refused_saying_to_call_it(gpt2, helper):
    """``tl.zero_ablate`` without ``()`` was run as ``zero_ablate(tensor, op)``: an error from the helper's
    constructor (``Action.__init__() takes ...``), or, for ``mean_ablate``, an action 'returning' a helper."""
    model, clean, _ = gpt2
    from untouched import assert_untouched, snapshot

    before = snapshot(model, (clean,))
    name = helper.__name__
    with pytest.raises(TypeError, match=rf"got the helper {name} uncalled: call it, tl\.{name}\("):
        tl.trace(model, clean, intervene={"transformer.h.0": helper})
    assert_untouched(before, snapshot(model, (clean,)))


def test_gpt2_a_reference_that_is_no_trace_is_refused(gpt2):
    model, clean, corrupt = gpt2
    with pytest.raises(TypeError, match="reference= takes a Trace .* got str"):
        tl.trace(model, corrupt, intervene={"layernorm_1_10": tl.zero_ablate()}, reference="clean_log")
    reference = tl.trace(model, clean, save="none")
    edited = tl.trace(model, corrupt, intervene={"layernorm_1_10": tl.zero_ablate()}, reference=reference)
    assert len(edited.interventions) == 1


def test_gpt2_an_action_of_one_argument_is_refused_before_any_run_saying_it_takes_tensor_and_op(gpt2):
    """``lambda t: t * 0`` failed mid-forward with "takes 1 positional argument but 2 were given", raised
    inside the intervention runtime."""
    model, clean, _ = gpt2
    with pytest.raises(TypeError, match=r"called as action\(tensor, op\).*<lambda>\(t\) cannot take"):
        tl.trace(model, clean, intervene={"transformer.h.0": lambda t: t * 0})
    edited = tl.trace(model, clean, intervene={"transformer.h.0": lambda t, op=None: t * 0,
                                               "transformer.h.1": lambda *values: None})
    assert torch.equal(edited["transformer.h.0"].activation, torch.zeros(1, 6, 32))


@pytest.mark.parametrize("make, message", [
    (lambda: tl.scale("2"), r"tl\.scale: k='2' is a str; give a float, an int or a tensor"),
    (lambda: tl.clamp(max="1"), r"tl\.clamp: max='1' is a str; give a float, an int or a tensor"),
    (lambda: tl.noise("0.1"), r"tl\.noise: std='0\.1' is a str; give a standard deviation"),
    (lambda: tl.noise(0.1, generator=0), r"tl\.noise: generator= takes a torch\.Generator or None, got int"),
    (lambda: tl.steer(torch.ones(32), scale=None),
     r"tl\.steer: scale=None is a NoneType; give a float, an int or a tensor"),
    (lambda: tl.steer(torch.ones(32), dim=1.0), r"tl\.steer: dim=1\.0 is a float, not an int; give a dimension"),
    (lambda: tl.mean_ablate(dims="0"), r"tl\.mean_ablate: dims='0' is a str, not an int; give a dimension"),
    (lambda: tl.mean_ablate(trace="clean_log"), r"tl\.mean_ablate: trace= takes a Trace .* got str"),
    (lambda: tl.patch_from("x"), r"tl\.patch_from: trace= takes a Trace .* got str"),
    (lambda: tl.zero_ablate(at="0"), r"tl\.zero_ablate: at= takes an index of the value .* got str '0'"),
    (lambda: tl.scale(2.0, at=1.5), r"tl\.scale: at= takes an index of the value .* got float 1\.5"),
    (lambda: tl.steer([1.0] * 32), r"tl\.steer: vector= takes a 1-d tensor, .* got list"),  # was a ValueError
])
def test_gpt2_a_helper_given_a_wrong_argument_is_refused_when_made_not_mid_forward(gpt2, make, message):
    """``tl.scale("2")`` failed only in the forward ("only integer tensors of a single element can be converted
    to an index"), ``tl.patch_from("x")`` with "the source trace has no op at ..." or an AttributeError."""
    with pytest.raises(TypeError, match=message):
        make()
    model, clean, _ = gpt2
    assert len(tl.trace(model, clean, intervene={"transformer.h.0": tl.scale(torch.tensor(2.0))}).interventions) == 1


def test_gpt2_an_inputs_or_outputs_path_as_a_site_names_what_to_intervene_at_instead(gpt2):
    # log["output.logits"] finds the output, but as a site the path was "neither an op or layer label nor a module
    # address", where its label (output_1:1) was answered with the op that makes it.
    model, clean, _ = gpt2
    log = tl.trace(model, clean)
    head = log["output.logits"].parents[0]
    with pytest.raises(KeyError, match=rf"site 'output\.logits' is the model's output output_1:1: name the op that "
                                       rf"produces it \({head}\)"):
        tl.trace(model, clean, intervene={"output.logits": tl.zero_ablate()})
    with pytest.raises(KeyError, match=r"stop_after site 'input\.input_ids' is the model's input input_1:1, which no "
                                       r"op of the forward produces: name the ops that read it"):
        tl.trace(model, clean, stop_after="input.input_ids")


@pytest.mark.parametrize("entry", ["transformer.h.0", "transformer.h.0:1"])
def test_gpt2_a_selection_of_a_call_the_stop_cut_short_is_refused_not_empty(gpt2, tmp_path, entry):
    # stop_after= at the block's mlp ends the forward inside the block, which never returns: save= of the block kept
    # nothing and said nothing, and tl.extract said that its call returned no tensor.
    model, clean, _ = gpt2
    cut_short = r"'transformer\.h\.0(:1)?'.*stopped after transformer\.h\.0\.mlp:1.*inside transformer\.h\.0:1"
    with pytest.raises(tl.UnmatchedSelection, match=cut_short):
        tl.trace(model, clean, save=[entry], stop_after="transformer.h.0.mlp")
    with pytest.raises(tl.UnmatchedSelection, match=cut_short):
        tl.extract(model, [clean], [entry], tmp_path / "a", stop_after="transformer.h.0.mlp", progress=False)
    log = tl.trace(model, clean, save=["transformer.h.0.mlp"], stop_after="transformer.h.0.mlp")  # it returned
    assert [op.label for op in log if op.has_activation] == [log["transformer.h.0.mlp"].label]


def test_gpt2_reading_an_ops_value_from_a_module_record_says_where_it_is(gpt2):
    # Of a trace stopped inside the block, log["transformer.h.0"] is the Module and log["transformer.h.0:1"] the
    # ModuleCall, neither with an output op. Reading the Module's activation said the call returned no op's value, as
    # for a module returning no tensor, not that it never returned; the ModuleCall's raised a bare "'ModuleCall'
    # object has no attribute 'activation'".
    model, clean, _ = gpt2
    log = tl.trace(model, clean, stop_after="transformer.h.0.mlp")
    never_returned = r"transformer\.h\.0:1 never returned: the forward stopped after transformer\.h\.0\.mlp:1 inside it"
    with pytest.raises(AttributeError, match=never_returned + r" \(stop_after=\)"):
        log["transformer.h.0"].activation
    with pytest.raises(AttributeError, match=r"'activation' belongs to one op, but " + never_returned):
        log["transformer.h.0:1"].activation
    with pytest.raises(AttributeError, match="'ModuleCall' object has no attribute 'no_such_field'"):
        log["transformer.h.0:1"].no_such_field
    # A call that returned its output, reached as a record (the Module said it returned no op's value).
    call = next(c for c in tl.trace(model, clean).module_calls if c.label == "transformer.h.0:1")
    for record in (call, call.module):
        with pytest.raises(AttributeError, match=r"read it from the call's output op, log\['transformer\.h\.0:1'\]"):
            record.activation
