"""Interventions across runs: the reference pass that resolves label sites and the runs of a patching
table each start from the model as the call found it (a cache or flag set by a first forward, train-mode
statistics and dropout), label sites match a module the forward makes anew, and interventions work inside
``torch.inference_mode()``."""

from __future__ import annotations

import copy
import os
import sys
import types
from collections import deque

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
import real_models  # noqa: E402 - imports transformers lazily, per entry
from zoo import ActivationMadePerCall, LoopRNN  # noqa: E402


def test_label_sites_inside_a_module_made_per_forward():
    model, x = ActivationMadePerCall().eval(), torch.randn(2, 4)
    plain = tl.trace(model, x)
    op = plain["gelu_1_2:1"]
    assert op.module == "<unregistered GELU #1>:1"
    expected = torch.zeros(2, 4) * 2
    # Against the default metadata pass, the plain trace, its cleaned-up copy and a loaded copy: each run
    # makes a new GELU, so the intervened call's module is another object of the same class at the same call.
    for reference in (None, plain):
        log = tl.trace(model, x, intervene={op.label: tl.zero_ablate()}, reference=reference)
        assert torch.equal(log.output, expected)
        assert [a.label for a in log.interventions] == [op.label]
    every = tl.trace(model, x, intervene={(lambda o: True): tl.scale(1.0)}, reference=plain)
    assert torch.equal(every.output, plain.output)
    plain.cleanup()
    assert torch.equal(tl.trace(model, x, intervene={op.label: tl.zero_ablate()}, reference=plain).output, expected)


def test_a_module_made_per_forward_of_another_class_is_another_path():
    model, x = ActivationMadePerCall().eval(), torch.randn(2, 4)
    reference = tl.trace(model, x, save="none")
    model.act = _OtherGelu  # the same op at the same position, in a module of another class
    with pytest.raises(tl.InterventionError, match="another path"):
        tl.trace(model, x, intervene={"gelu_1_2:1": tl.zero_ablate()}, reference=reference)


class _OtherGelu(nn.GELU):
    """A GELU of another class."""


class _FirstCallState(nn.Module):
    """State set by the first forward: a cache built on first use (as rotary embeddings do) and a flag, and,
    with ``rescale``, a weight written in place once (as RWKV rescales its weights in eval mode)."""

    def __init__(self, rescale=False):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.rescale = rescale
        self.cache = None

    def forward(self, x):
        if self.rescale:
            with torch.no_grad():
                self.fc.weight.div_(2)
            self.rescale = False
        if self.cache is None:
            self.cache = torch.arange(4.0).exp()
        return torch.tanh(self.fc(x) * self.cache)


def test_a_label_site_on_a_model_whose_first_forward_builds_a_cache():
    """The metadata pass that resolves a label is a forward too: it must leave the cache (and any flag) as
    it found them, or the intervened forward takes another path than the one its label was resolved on."""
    torch.manual_seed(0)
    model, x = _FirstCallState().eval(), torch.randn(2, 4)
    first = tl.trace(copy.deepcopy(model), x)
    site = next(op.label for op in first.ops if op.type == "mul")
    log = tl.trace(model, x, intervene={site: tl.zero_ablate()})
    assert [a.label for a in log.interventions] == [site]
    assert torch.equal(log.output, torch.zeros(2, 4))  # tanh(0): the product zeroed
    assert log.labels == first.labels  # the first forward's path, cache building included
    assert torch.equal(model.cache, torch.arange(4.0).exp())  # built once, by the intervened run


class _KeepsRecentStates(nn.Module):
    """Adds the states of its last forwards, kept in a deque (as a streaming model keeps its recent context), and
    appends its own: each forward reads what the one before it left."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.recent = deque([torch.zeros(4)], maxlen=3)

    def forward(self, x):
        h = self.fc(x) + sum(self.recent)
        self.recent.append(h.detach().mean(0))
        return torch.tanh(h)


class _KeepsRunningStats(nn.Module):
    """Counts its forwards and sums its inputs in a plain object it holds (``self.stats.calls += 1``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.stats = types.SimpleNamespace(calls=0, total=torch.zeros(4))

    def forward(self, x):
        self.stats.calls += 1
        self.stats.total.add_(x.sum(0))
        return torch.tanh(self.fc(x) * self.stats.calls + self.stats.total)


@pytest.mark.parametrize("model_type", [_KeepsRecentStates, _KeepsRunningStats], ids=["deque", "object"])
def test_a_label_sites_reference_pass_puts_back_the_state_a_module_keeps(model_type):
    # The pass that resolves the label left a state appended to the deque, and the object's count and sum advanced
    # once more: the intervened run read the state of two forwards where the same edit made by hand reads that of
    # one, and every untraced forward after it read one forward too many.
    torch.manual_seed(0)
    by_hand, x = model_type(), torch.randn(2, 4)
    traced = copy.deepcopy(by_hand)
    by_hand.fc.register_forward_hook(lambda module, args, out: out * -3.0)
    site = tl.trace(copy.deepcopy(traced), x)["fc"].label  # the label of fc's output op
    log = tl.trace(traced, x, intervene={site: tl.scale(-3.0)})  # resolved by an extra pass
    assert torch.equal(log.output, by_hand(x))
    traced.fc.register_forward_hook(lambda module, args, out: out * -3.0)
    assert torch.equal(traced(x), by_hand(x))  # the next untraced forward reads the same state


def test_a_label_site_on_a_model_writing_its_parameters_is_refused_once():
    torch.manual_seed(0)
    model, x = _FirstCallState(rescale=True).eval(), torch.randn(2, 4)
    weight = model.fc.weight.detach().clone()
    with pytest.raises(tl.InterventionError, match=r"writes parameters in place \(fc.weight"):
        tl.trace(model, x, intervene={"tanh_1_6:1": tl.zero_ablate()})
    assert torch.equal(model.fc.weight, weight / 2) and not model.rescale  # as after one forward
    settled = tl.trace(model, x, intervene={"tanh_1_3:1": tl.zero_ablate()})  # no write now: resolved and run
    assert torch.equal(settled.output, torch.zeros(2, 4))
    assert torch.equal(model.fc.weight, weight / 2)


def test_a_label_site_on_a_lazy_modules_first_forward_is_refused_saying_lazy_initialization():
    # The refusal spoke of parameters written in place ("a one-time rescale, a renormalization"), not of the
    # lazy module's first forward, nor of running one forward first.
    pytest.importorskip("pandas")
    x = torch.randn(2, 3)
    for run in (lambda m: tl.trace(m, x, intervene={"relu_1_2:1": tl.zero_ablate()}),
                lambda m: tl.report.activation_patching(m, x, -x, lambda out: out.sum(), progress=False)):
        model = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
        with pytest.raises(tl.TorchlensError, match=r"initialized the parameters of lazy modules \(0\.weight, "
                                                    r"0\.bias: a lazy module, such as nn\.LazyLinear.*"
                                                    r"run one forward, model\(x\)"):
            run(model)
        # Left as that forward left it, a whole nn.Linear: the patching runs put back the lazy module's sizes and
        # its initializing hook beside the made weights, and its next call failed.
        assert type(model[0]) is nn.Linear and model[0].in_features == 3 and not model[0]._forward_pre_hooks
        run(model)
    initialized = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    initialized(x)
    assert torch.equal(tl.trace(initialized, x, intervene={"relu_1_2:1": tl.zero_ablate()}).output, torch.zeros(2, 4))


class _Renormalizing(nn.Module):
    """Renormalizes its weight in place in every forward (as ``nn.Embedding(max_norm=...)`` does the rows
    it reads)."""

    def __init__(self):
        super().__init__()
        self.weight, self.head = nn.Parameter(torch.randn(4, 4)), nn.Linear(4, 1)

    def forward(self, x):
        with torch.no_grad():
            self.weight.div_(self.weight.norm(dim=1, keepdim=True))
        return self.head(torch.tanh(x @ self.weight)).sum()


def test_a_model_writing_its_parameters_in_every_forward_is_put_back_once_known():
    """Refused the first time (the write is found only after the extra forward), then the parameter is
    known: the label pass and every run of a patching table put it back, so retrying works."""
    torch.manual_seed(0)
    model, x, other = _Renormalizing(), torch.randn(2, 4), torch.randn(2, 4)
    with pytest.raises(tl.InterventionError, match=r"writes parameters in place \(weight.*Run the intervention again"):
        tl.trace(model, x, intervene={"tanh_1_4:1": tl.zero_ablate()})
    once = copy.deepcopy(model)  # as one plain forward leaves it
    log = tl.trace(model, x, intervene={"tanh_1_4:1": tl.zero_ablate()})
    assert [a.label for a in log.interventions] == ["tanh_1_4:1"]
    assert torch.equal(log.output, 2 * model.head.bias.sum())  # the head of zeros
    assert torch.allclose(model.weight, once.weight)  # renormalized once more by the intervened run

    fresh = _Renormalizing()
    with pytest.raises(tl.TorchlensError, match=r"weight.*run the experiment again"):
        tl.report.activation_patching(fresh, x, other, lambda out: out, sites=["head:1"], progress=False)
    start = copy.deepcopy(fresh.state_dict())
    table = tl.report.activation_patching(fresh, x, other, lambda out: out, sites=["head:1"], progress=False)
    assert table.metric[0] == table.attrs["clean"]  # the clean head output patched in: the clean output
    assert all(torch.equal(v, start[k]) for k, v in fresh.state_dict().items())  # each run put back


def test_an_embedding_with_max_norm_is_put_back_from_the_first_call():
    """nn.Embedding(max_norm=...) is known to renormalize its weight in every forward: kept and put back
    without a first refusal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 1))
    ids = torch.tensor([[1, 2, 3]])
    once = copy.deepcopy(model)
    once(ids)
    log = tl.trace(model, ids, intervene={"embedding_1_1:1": tl.zero_ablate()})
    assert torch.equal(log.output, model[1].bias.expand(1, 3, 1))
    assert torch.equal(model[0].weight, once[0].weight)  # the rows renormalized as by one plain forward


def test_a_reference_whose_forward_wrote_parameters_says_so():
    torch.manual_seed(0)
    model, x = _FirstCallState(rescale=True).eval(), torch.randn(2, 4)
    reference = tl.trace(model, x)  # the first forward: it rescales fc.weight, the next one does not
    with pytest.raises(tl.InterventionError, match="never reached.*wrote parameters in place"):
        tl.trace(model, x, intervene={"tanh_1_6:1": tl.zero_ablate()}, reference=reference)


class _TrainModeNet(nn.Module):
    """BatchNorm and dropout in train mode, and a call counter: every forward draws, updates running
    statistics and changes an attribute."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.head(F.dropout(torch.relu(self.bn(self.fc(x))), 0.3, training=self.training)).sum()


def test_patching_runs_each_start_from_the_model_as_the_call_found_it():
    pytest.importorskip("pandas")
    torch.manual_seed(0)
    model = _TrainModeNet().train()
    clean, corrupt = torch.randn(5, 6), torch.randn(5, 6)
    torch.manual_seed(3)
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def run(x, intervene=None):
        """One forward from the call's start: the same seed, statistics and counter."""
        model.load_state_dict(start)
        model.calls = 0
        torch.manual_seed(3)
        return tl.trace(model, x, intervene=intervene)

    clean_log = run(clean)
    expected = {site: run(corrupt, {site: tl.patch_from(clean_log)}).output.item() for site in ("fc:1", "bn:1")}
    corrupt_value = run(corrupt).output.item()
    model.load_state_dict(start)
    model.calls = 0
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    table = tl.report.activation_patching(model, clean, corrupt, lambda out: out, sites=["fc:1", "bn:1"],
                                          progress=False)
    assert table.attrs["clean"] == clean_log.output.item() and table.attrs["corrupt"] == corrupt_value
    assert dict(zip(table.site, table.metric)) == expected
    # The model, its counter and the generator end as the call found them.
    assert torch.equal(torch.get_rng_state(), rng) and model.calls == 0
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())
    tl.report.attribution_patching(model, clean, corrupt, lambda out: out)
    assert torch.equal(torch.get_rng_state(), rng) and model.calls == 0
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())


class _Noisy(nn.Module):
    """Adds noise from a generator of its own, or from one passed as ``generator=``."""

    def __init__(self):
        super().__init__()
        self.fc, self.own = nn.Linear(4, 4), torch.Generator().manual_seed(7)

    def forward(self, x, generator=None):
        hidden = self.fc(x)
        return hidden + torch.randn(hidden.shape, generator=self.own if generator is None else generator)


@pytest.mark.parametrize("passed", [False, True])
def test_extra_runs_leave_a_generator_the_forward_draws_from_as_they_found_it(passed):
    # The reference pass of a label site advanced the module's generator (or the caller's generator=), so the
    # intervened run drew other noise than one forward: an identity edit changed the output.
    torch.manual_seed(0)
    model, x = _Noisy(), torch.randn(2, 4)
    kwargs = (lambda: {"generator": torch.Generator().manual_seed(3)}) if passed else dict
    untouched, given, untraced = copy.deepcopy(model), kwargs(), kwargs()
    expected = untouched(x, **untraced)
    log = tl.trace(model, (x,), given, intervene={"linear_1_1": tl.scale(1.0)})
    assert torch.equal(log.output, expected)
    drawn, drawn_once = (given["generator"], untraced["generator"]) if passed else (model.own, untouched.own)
    assert torch.equal(drawn.get_state(), drawn_once.get_state())  # advanced once, by the intervened run
    model, given = copy.deepcopy(untouched), kwargs()
    table = tl.report.activation_patching(model, x, x + 1, lambda out: out[0, 0], sites=["fc"], kwargs=given,
                                          progress=False)
    assert table.attrs["corrupt"] == float(untouched(x + 1, **kwargs())[0, 0])  # the noise one forward draws


def test_a_callable_naming_no_model_is_put_back_after_the_extra_runs_too():
    """A lambda traced without ``root=`` names no model: the modules it calls are put back all the same (the
    reference pass of a label site, the runs of a patching table), as a forward hook would find them."""
    pytest.importorskip("pandas")
    torch.manual_seed(0)
    model = _TrainModeNet().train()
    clean, corrupt = torch.randn(5, 6), torch.randn(5, 6)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    untraced = copy.deepcopy(model)
    torch.manual_seed(3)
    expected = untraced(corrupt)
    rng = torch.get_rng_state()
    torch.manual_seed(3)
    log = tl.trace(lambda x: model(x), corrupt, intervene={"relu_1_4": tl.scale(1.0)})
    assert [a.label for a in log.interventions] == ["relu_1_4:1"]
    assert torch.equal(log.output, expected)
    # One forward's worth of change, as untraced: the statistics, the counter, the generator.
    assert model.calls == untraced.calls == 1
    assert all(torch.equal(v, untraced.state_dict()[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)

    model.load_state_dict(start)
    model.calls = 0
    tl.report.activation_patching(lambda x: model(x), clean, corrupt, lambda out: out, sites=["relu_1_4"],
                                  progress=False)
    assert model.calls == 0
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())


def test_interventions_inside_inference_mode():
    """Inference tensors have no version counter: an intervened trace inside torch.inference_mode() used to
    raise reading one."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval(), torch.randn(2, 4)
    with torch.inference_mode():
        zeroed = tl.trace(model, x, intervene={"relu_1_2:1": tl.zero_ablate()})
        scaled = tl.trace(model, x, intervene={"1": tl.scale(2.0)})
        assert torch.equal(zeroed.output, model[2](torch.zeros(2, 4)))
        assert torch.equal(scaled.output, model[2](2 * torch.relu(model[0](x))))
    assert torch.equal(zeroed["relu_1_2:1"].original, torch.relu(model[0](x)))


# ----- label sites and patching inputs on another path than the reference ------------------------------------
class _AbsThenSquash(nn.Module):
    """Takes the absolute value only when the input has a negative entry, then squashes it three times from
    one line: one op more or less before the loop moves each pass of ``tanh`` to another position."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if (x < 0).any():
            x = x.abs()
        for _ in range(3):
            x = torch.tanh(x)
        return self.fc(x)


@pytest.mark.parametrize("saved", [False, True])
def test_a_label_site_shifted_onto_another_pass_of_its_line_is_divergence(saved, tmp_path):
    # The reference (no negative entry) has no abs: at the position of its second tanh, a run with a negative
    # entry makes its first tanh, the same function from the same line in the same module call.
    model = _AbsThenSquash().eval()
    positive = torch.rand(2, 4)
    reference = tl.trace(model, positive)
    if saved:  # a loaded reference counts the calls of each line the same way
        reference.save(tmp_path / "reference")
        reference = tl.load(tmp_path / "reference")
    second = [op.label for op in reference.ops if op.type == "tanh"][1]
    with pytest.raises(tl.InterventionError, match=r"made call 1 of 'tanh'.*where the reference made call 2"):
        tl.trace(model, -positive, intervene={second: tl.scale(3.0)}, reference=reference)
    # Inputs that take the reference's path: the second pass, as a hand-made edit.
    log = tl.trace(model, positive * 0.5, intervene={second: tl.scale(3.0)}, reference=reference)
    with torch.no_grad():
        expected = model.fc(torch.tanh(3.0 * torch.tanh(torch.tanh(positive * 0.5))))
    assert torch.equal(log.output, expected)


def test_a_stop_after_label_on_another_path_is_divergence_not_an_early_stop():
    # At the position of the reference's second tanh the other run makes its first: stopping there would
    # return a trace cut one op early under the site's name.
    model = _AbsThenSquash().eval()
    positive = torch.rand(2, 4)
    reference = tl.trace(model, positive)
    second = [op.label for op in reference.ops if op.type == "tanh"][1]
    with pytest.raises(tl.InterventionError, match=r"stop_after site 'tanh_2_4:1'.*another path"):
        tl.trace(model, -positive, stop_after=second, reference=reference)
    linear = [op.label for op in reference.ops if op.type == "linear"][0]
    with pytest.raises(tl.InterventionError, match=r"called 'tanh'.*where the reference called 'linear'"):
        tl.trace(model, -positive, stop_after=linear, reference=reference)
    early = tl.trace(model, positive * 0.5, stop_after=second, reference=reference)
    assert early.stopped_after == second and [op.type for op in early.ops][-1] == "tanh"
    assert torch.equal(early[second].activation, torch.tanh(torch.tanh(positive * 0.5)))


def test_attribution_patching_between_inputs_on_other_paths_says_so_in_its_own_terms():
    pytest.importorskip("pandas")
    model = _AbsThenSquash().eval()
    positive = torch.rand(2, 4)
    with pytest.raises(tl.InterventionError, match=r"attribution_patching: the corrupted input takes another path.*"
                                                   r"intervention site <predicate> \(tanh_1_3:1\)"):
        tl.report.attribution_patching(model, positive, -positive, lambda out: out.sum())


def test_patching_reports_given_a_trace_for_an_input_say_they_take_inputs(tmp_path):
    """A saved clean trace passed where the clean input goes would run the model on the trace object (torch's
    TypeError from deep inside it); both reports name what they take and the way to patch from a saved trace,
    before the model runs."""
    pytest.importorskip("pandas")
    model, x = _AbsThenSquash().eval(), torch.rand(2, 4)
    loaded = tl.load(tl.trace(model, x).save(tmp_path / "clean"))
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    for report in (tl.report.activation_patching, tl.report.attribution_patching):
        with pytest.raises(TypeError, match=r"takes the clean and corrupted inputs.*tl.patch_from\(loaded\)"):
            report(model, loaded, -x, lambda out: out.sum())
    assert not calls
    patched = tl.trace(model, x, intervene={"fc:1": tl.patch_from(loaded)})  # the way the message names
    assert torch.equal(patched.output, model(x))


# ----- a forward that runs longer than its reference: generate() decoding more steps after an edit ----------
def _generate_with_and_without_an_edit():
    """A Llama, a prompt, greedy generate() keywords without an end token, its second block's MLP projection, a
    scale for that module's output, and the tokens decoded without and with that scaling on every call."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, _, kwargs = real_models.CORPUS["llama"]()
    model.eval()
    ids, module, factor = kwargs["input_ids"][:1], model.model.layers[1].mlp.down_proj, 50.0
    free = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    plain = model.generate(ids, **free)[0, ids.shape[1]:].tolist()
    with _scaling(module, factor):
        edited = model.generate(ids, **free)[0, ids.shape[1]:].tolist()
    return model, ids, free, module, factor, plain, edited


def _generate_longer_once_edited():
    """generate() stopping at once on an end token unless the module's output is scaled: the end token is one the
    plain run makes first and the edited run never makes, so the edited run decodes more steps than the
    reference.  ``(model, prompt, generate keywords, the module, the scale)``."""
    model, ids, free, module, factor, plain, edited = _generate_with_and_without_an_edit()
    end = next(token for token in plain if token not in edited)
    return model, ids, {**free, "eos_token_id": end}, module, factor


class _scaling:
    """A forward hook scaling a module's output on every call: what a module site does, written by hand."""

    def __init__(self, module, factor):
        self.module, self.factor = module, factor

    def __enter__(self):
        self.handle = self.module.register_forward_hook(lambda m, args, out: out * self.factor)

    def __exit__(self, *exc):
        self.handle.remove()


def test_a_layer_or_predicate_site_of_a_forward_longer_than_its_reference_is_refused():
    model, ids, generate, module, factor = _generate_longer_once_edited()
    with _scaling(module, factor):
        expected = model.generate(ids, **generate)
    reference = tl.trace(model.generate, (ids,), generate)
    assert expected.shape[1] > reference.output.shape[1]  # the edit makes generate() decode more steps
    layer = next(op for op in reference.ops if op.module_address == "model.layers.1.mlp.down_proj").layer_label
    for site in (layer, lambda op: op.module_address == "model.layers.1.mlp.down_proj"):
        with pytest.raises(tl.InterventionError, match="this forward ran longer") as caught:
            tl.trace(model.generate, (ids,), generate, intervene={site: tl.scale(factor)})
        assert f"{layer}:2" in str(caught.value)  # the pass of the first step past the reference's end
        assert torch._C._len_torch_function_stack() == 0 and not module._forward_hooks
    # A site naming one op of the reference has nothing past its end, and is not named.
    first = next(op for op in reference.ops if op.type == "linear").label  # the first step's first projection
    with pytest.raises(tl.InterventionError, match="this forward ran longer") as caught:
        tl.trace(model.generate, (ids,), generate, intervene={layer: tl.scale(factor), first: tl.scale(1.0)})
    assert repr(layer) in str(caught.value) and first not in str(caught.value)
    # The module site edits every call as the model runs: the same run as the hand-written hook.
    log = tl.trace(model.generate, (ids,), generate, intervene={"model.layers.1.mlp.down_proj": tl.scale(factor)})
    assert torch.equal(log.output, expected)
    assert len(log.interventions) == expected.shape[1] - ids.shape[1]  # one edit per decoding step


def test_a_layer_or_predicate_site_of_a_forward_shorter_than_its_reference_says_it_ended_sooner():
    """The converse: the edit makes generate() decode the end token at its second step, which the plain run
    never decodes.  The site changed the passes the run made; the error names the later ones the run never
    reached, instead of saying that the site was never reached."""
    model, ids, free, module, factor, plain, edited = _generate_with_and_without_an_edit()
    end = next(token for token in edited[1:] if token not in plain)
    generate = {**free, "eos_token_id": end}
    reference = tl.trace(model.generate, (ids,), generate)
    with _scaling(module, factor):
        expected = model.generate(ids, **generate)
    assert expected.shape[1] < reference.output.shape[1]  # the edit makes generate() stop sooner
    layer = next(op for op in reference.ops if op.module_address == "model.layers.1.mlp.down_proj").layer_label
    unreached = f"{layer}:{expected.shape[1] - ids.shape[1] + 1}"  # the pass of the first step it never ran
    for site in (layer, lambda op: op.module_address == "model.layers.1.mlp.down_proj"):
        with pytest.raises(tl.InterventionError, match="changed some of the ops they name") as caught:
            tl.trace(model.generate, (ids,), generate, intervene={site: tl.scale(factor)})
        assert f"ended before {unreached}" in str(caught.value) and "never reached" not in str(caught.value)
        assert torch._C._len_torch_function_stack() == 0 and not module._forward_hooks
    log = tl.trace(model.generate, (ids,), generate, intervene={"model.layers.1.mlp.down_proj": tl.scale(factor)})
    assert torch.equal(log.output, expected)


@pytest.mark.parametrize("run", ["label site", "activation patching", "flops_vs_dispatch"])
def test_a_hook_registered_before_an_extra_run_can_still_be_removed(run):
    """The runs made besides the traced one put the modules' attributes back.  They put back copies of the
    parameter, submodule and hook tables, so a ``RemovableHandle`` taken before removed its hook from a dict
    the module no longer used: the hook kept changing every later output (and each such call made the next
    trace of the model walk it anew)."""
    model, _, kwargs = real_models.gpt2()
    model.eval()
    ids = kwargs["input_ids"]
    before = model(ids).logits
    attention = model.transformer.h[0].attn
    tables = {name: getattr(attention, name) for name in ("_forward_hooks", "_parameters", "_modules", "_buffers")}
    handle = attention.register_forward_hook(lambda module, args, output: (output[0] * 2, *output[1:]))
    hooked = model(ids).logits
    assert not torch.equal(hooked, before)
    if run == "label site":  # resolved by a reference pass
        site = next(label for label in tl.trace(model, (ids,), save="none").labels if label.startswith("tanh_"))
        tl.trace(model, (ids,), intervene={site: tl.scale(1.0)})
    elif run == "activation patching":
        tl.report.activation_patching(model, (ids,), (ids.flip(1),), lambda out: out.logits.sum(),
                                      sites=["transformer.h.1"], progress=False)
    else:
        tl.report.flops_vs_dispatch(model, (ids,))
    assert torch.equal(model(ids).logits, hooked)
    handle.remove()
    assert torch.equal(model(ids).logits, before), "the removed hook still ran"
    assert all(getattr(attention, name) is table for name, table in tables.items())


def test_a_reference_traced_before_a_module_was_replaced_says_so():
    """A module replaced between the reference and the intervened run (a layer re-initialised by assigning a
    new one): the refusal said the forward "took another path", describing both alike ("called 'view' in
    transformer > ... > transformer.h.1.mlp.c_proj (...), where the reference called 'view' in" the same)."""
    from transformers.pytorch_utils import Conv1D

    model, _, kwargs = real_models.gpt2()
    model.eval()
    ids = kwargs["input_ids"]
    reference = tl.trace(model, (ids,), save="none")
    site = next(op.label for op in reference.ops if op.module == "transformer.h.1.mlp.c_proj:1")
    model.transformer.h[1].mlp.c_proj = Conv1D(*model.transformer.h[1].mlp.c_proj.weight.shape[::-1])
    with pytest.raises(tl.InterventionError, match=r"module transformer\.h\.1\.mlp\.c_proj is another object "
                                                   r"than the one the reference trace ran"):
        tl.trace(model, (ids,), intervene={site: tl.zero_ablate()}, reference=reference)
    fresh = tl.trace(model, (ids,), intervene={site: tl.zero_ablate()})  # its own reference pass
    assert [a.label for a in fresh.interventions] == [site]


def test_a_reference_stopped_early_is_named_as_why_it_lacks_the_later_ops():
    """A trace taken with stop_after= names no op after its stop: a layer label resolved against it was refused as
    a forward that 'ran longer (a generate() ...)', and a label after the stop as unknown, without a word of it."""
    model, x = LoopRNN(steps=3).eval(), torch.randn(2, 8)
    early = tl.trace(model, x, stop_after="cell:2")
    whole_forward = r"stopped after cell:2 \(stop_after=\) and so names no op after it: pass reference= a trace"
    with pytest.raises(tl.InterventionError, match=r"'linear_1_2' also name linear_1_2:3, .*" + whole_forward):
        tl.trace(model, x, intervene={"linear_1_2": tl.scale(2.0)}, reference=early)
    with pytest.raises(KeyError, match=r"'linear_1_2:3': no op.*the reference trace stopped after cell:2"):
        tl.trace(model, x, intervene={"linear_1_2:3": tl.scale(2.0)}, reference=early)
    before_the_stop = tl.trace(model, x, intervene={"linear_1_2:1": tl.scale(2.0)}, reference=early)
    assert [applied.label for applied in before_the_stop.interventions] == ["linear_1_2:1"]


def test_a_forward_failing_in_the_extra_run_that_resolves_label_sites_says_so():
    # The exception's only note named the module call, as if the intervened run had raised there; that run never
    # started, and the model and the generators are as they were before the call (the extra run's state is put back).
    class FailsLate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.drop, self.head = torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.drop(self.fc(x))) @ torch.ones(3, 3)  # (2, 2) @ (3, 3): the op raises

    model, x = FailsLate(), torch.randn(2, 4)
    torch.manual_seed(0)
    generator_before = torch.get_rng_state()
    with pytest.raises(RuntimeError) as raised:
        tl.trace(model, x, intervene={"linear_1_1": tl.zero_ablate()})
    notes = raised.value.__notes__
    assert len(notes) == 2 and notes[0].startswith("torchlens: raised by torch call 'matmul'"), notes
    assert "extra forward that resolves label sites, before the intervened run" in notes[1]
    assert torch.equal(torch.get_rng_state(), generator_before)
    with pytest.raises(RuntimeError) as plain:  # a module site needs no extra run: one note, as usual
        tl.trace(model, x, intervene={"fc": tl.zero_ablate()})
    assert len(plain.value.__notes__) == 1
