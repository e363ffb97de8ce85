"""Tensors held in plain objects' attributes: a transformers key/value cache passed in as
``past_key_values`` and returned extended, a recurrent state object, a module returning its result as an
object.  Their tensors are the trace's inputs and outputs, and a module call's outputs, like any other;
a module site's intervention refuses clearly where it cannot edit them; and every run torchlens makes besides the
traced one (the reference forward of ``tl.validate``, the label-resolving pass of an intervention, the runs of the
patching tables) works on copies, so the caller's inputs end as one forward leaves them."""

from __future__ import annotations

import collections
import copy
import os
import sys

import pytest
import torch
import torch.nn as nn

import torchlens as tl

sys.path.insert(0, os.path.dirname(__file__))  # the real-model corpus lives beside this file
import real_models  # noqa: E402 - imports transformers lazily, per entry
from hooked import with_hook  # noqa: E402


@pytest.fixture(scope="module")
def gpt2():
    pytest.importorskip("transformers")
    return real_models.small_gpt2_lm()


def _cache_tensors(cache) -> list:
    """The key and value tensors of a transformers cache, layer by layer, through its public attributes
    (``layers[i].keys`` since transformers 5, ``key_cache[i]`` before)."""
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [t for pair in zip(cache.key_cache, cache.value_cache) for t in pair]


def _same(saved, tensor) -> bool:
    """A saved activation is a detached reference to the tensor itself: the same memory, the same values."""
    return saved.data_ptr() == tensor.data_ptr() and torch.equal(saved, tensor)


def _prefix(model):
    """A cache after five tokens (made without grad, so that the test can deep-copy it), and the next token."""
    with torch.no_grad():
        out = model(torch.tensor([[5, 9, 13, 21, 7]]))
    return out.past_key_values, torch.tensor([[30]])


def test_a_returned_cache_is_among_the_outputs(gpt2):
    log = tl.trace(gpt2, torch.tensor([[5, 9, 13, 21, 7]]))
    returned = _cache_tensors(log.output.past_key_values)
    outputs = [op for op in log.ops if op.kind == "output"]
    assert len(outputs) == 1 + len(returned) == 5  # the logits, then a key and a value per layer
    assert outputs[0].io_path == "output.logits"
    for op, tensor in zip(outputs[1:], returned):
        assert op.io_path.startswith("output.past_key_values.")
        assert _same(op.activation, tensor)  # the output shows the tensor the caller received
        (producer,) = op.parents
        assert _same(log[producer].activation, tensor)  # and the op that made it is its parent


def test_a_cache_passed_in_is_recorded_as_inputs(gpt2):
    cache, token = _prefix(gpt2)
    given = _cache_tensors(cache)
    log = tl.trace(gpt2, (token,), {"past_key_values": cache})
    assert log.unattributed == 0  # every tensor an op read has a producer: the cache's tensors are inputs
    inputs = [op for op in log.ops if op.kind == "input"]
    assert [op.io_path for op in inputs][0] == "input.input_ids"
    assert len(inputs) == 1 + len(given)
    for op, tensor in zip(inputs[1:], given):
        assert op.io_path.startswith("input.past_key_values.")
        assert torch.equal(op.activation, tensor)
        assert op.children  # attention reads each of them


def test_validate_with_a_cache_passes_and_extends_the_callers_cache_once(gpt2):
    cache, token = _prefix(gpt2)
    untouched = copy.deepcopy(cache)
    expected = gpt2(token, past_key_values=untouched)
    result = tl.validate(gpt2, (token,), {"past_key_values": cache})
    assert result.passed and result.outputs_match
    # The caller's cache went through one forward (the traced one), not two.
    assert [t.shape for t in _cache_tensors(cache)] == [t.shape for t in _cache_tensors(untouched)]
    assert all(torch.equal(a, b) for a, b in zip(_cache_tensors(cache), _cache_tensors(untouched)))
    assert expected.logits.shape == (1, 1, 64)


def test_an_intervention_by_label_sees_the_cache_one_forward_would(gpt2):
    cache, token = _prefix(gpt2)
    untouched = copy.deepcopy(cache)
    expected = gpt2(token, past_key_values=untouched).logits
    # A label site is resolved by a metadata pass first; that pass must not extend the caller's cache.
    log = tl.trace(gpt2, (token,), {"past_key_values": cache}, intervene={"linear_1_99": tl.scale(1.0)})
    assert torch.equal(log.output.logits, expected)
    assert [t.shape[2] for t in _cache_tensors(cache)] == [6, 6, 6, 6]


class _Doubler(nn.Module):
    """Writes its input in place before using it."""

    def forward(self, x):
        x.mul_(2)
        return torch.relu(x + 1)


def test_an_intervention_by_label_leaves_an_input_written_in_place_as_one_forward_would():
    x, y = torch.ones(3), torch.ones(3)
    expected = _Doubler()(y)
    log = tl.trace(_Doubler(), x, intervene={"relu_1_3": tl.scale(1.0)})
    assert torch.equal(log.output, expected)
    assert torch.equal(x, y)  # written once, by the intervened forward


class _State:
    """A plain object carrying tensors, as recurrent models pass their state."""

    def __init__(self, h, c):
        self.h, self.c = h, c


class _Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, state):
        h = torch.tanh(self.linear(x) + state.h)
        return _State(h, state.c + h)


def test_a_plain_object_carrying_state_in_and_out():
    torch.manual_seed(0)
    cell, x, state = _Cell(), torch.randn(2, 4), _State(torch.zeros(2, 4), torch.ones(2, 4))
    log = tl.trace(cell, (x, state))
    assert log.unattributed == 0
    assert [op.io_path for op in log.ops if op.kind == "input"] == ["input.x", "input.state.h", "input.state.c"]
    outputs = [op for op in log.ops if op.kind == "output"]
    assert [op.io_path for op in outputs] == ["output.h", "output.c"]
    assert _same(outputs[0].activation, log.output.h) and _same(outputs[1].activation, log.output.c)


def test_patching_runs_each_start_from_the_callers_inputs(gpt2):
    pytest.importorskip("pandas")
    cache, token = _prefix(gpt2)
    untouched = copy.deepcopy(cache)
    clean, corrupt = token, torch.tensor([[40]])

    def metric(output):
        return output.logits[0, -1, 11] - output.logits[0, -1, 12]

    with torch.no_grad():
        expected_clean = metric(gpt2(clean, past_key_values=copy.deepcopy(cache)))
        expected_corrupt = metric(gpt2(corrupt, past_key_values=copy.deepcopy(cache)))
    table = tl.report.activation_patching(gpt2, clean, corrupt, metric, sites=["transformer.h.1"],
                                   kwargs={"past_key_values": cache}, progress=False)
    # Three runs shared one cache argument: each saw it as the caller passed it.
    assert table.attrs["clean"] == pytest.approx(float(expected_clean), abs=1e-6)
    assert table.attrs["corrupt"] == pytest.approx(float(expected_corrupt), abs=1e-6)
    assert table["normalized"].tolist() == pytest.approx([1.0])  # the last block patched: the clean value
    assert all(torch.equal(a, b) for a, b in zip(_cache_tensors(cache), _cache_tensors(untouched)))


def test_an_empty_cache_is_copied_for_every_extra_run_as_a_filled_one_is(gpt2):
    """A prefill forward given ``DynamicCache()`` fills it, though it holds no tensor yet: the reference pass of a
    label site, tl.validate's untraced run and the patching runs each extended the caller's cache, so the traced
    run met a cache of ten tokens for a five-token prompt (and a label site was refused as another path)."""
    from transformers import DynamicCache

    prompt = torch.tensor([[5, 9, 13, 21, 7]])
    with torch.no_grad():
        expected = gpt2(prompt, past_key_values=DynamicCache()).logits
    cache = DynamicCache()
    in_head = lambda op: op.module_address == "lm_head"  # noqa: E731 - resolved by a reference pass, as a label
    log = tl.trace(gpt2, (prompt,), {"past_key_values": cache}, intervene={in_head: tl.scale(1.0)})
    assert torch.equal(log.output.logits, expected) and cache.get_seq_length() == 5
    cache = DynamicCache()
    assert tl.validate(gpt2, (prompt,), {"past_key_values": cache}).passed and cache.get_seq_length() == 5
    cache = DynamicCache()
    tl.report.activation_patching(gpt2, prompt, prompt.flip(1), lambda out: out.logits[0, -1, 3],
                                  sites=["transformer.h.1"], kwargs={"past_key_values": cache}, progress=False)
    assert cache.get_seq_length() == 0


class _Context:
    """A plain object passed to the forward: a module to call, and a log the forward appends to."""

    def __init__(self, helper):
        self.helper, self.calls = helper, []


class _UsesContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, context):
        context.calls.append(len(context.calls))
        return context.helper(self.fc(x))


def test_an_input_object_is_copied_for_an_extra_run_but_the_modules_it_refers_to_are_not():
    # Copying the object copied the module it held too: the reference pass ran a copy of the helper (of a whole
    # model, held so, a second copy in memory), which the caller's hooks on it never saw.
    torch.manual_seed(0)
    helper, model, x = nn.Linear(4, 4), _UsesContext(), torch.randn(2, 4)
    context, called = _Context(helper), []
    helper.register_forward_hook(lambda module, args, output: called.append(module))
    log = tl.trace(model, (x, context), intervene={"linear_1_1": tl.scale(1.0)})
    assert torch.equal(log.output, helper(model.fc(x)))
    assert context.calls == [0]  # the reference pass appended to a copy of the object
    assert len(called) == 3 and all(module is helper for module in called)  # reference pass, traced run, above


def test_attribution_patching_leaves_an_input_written_in_place_as_given():
    pytest.importorskip("pandas")
    clean, corrupt = torch.ones(3), torch.full((3,), -1.0)
    table = tl.report.attribution_patching(_Doubler(), clean, corrupt, lambda out: out.sum())
    assert torch.equal(clean, torch.ones(3)) and torch.equal(corrupt, torch.full((3,), -1.0))
    assert table.attrs["clean"] == 9.0 and table.attrs["corrupt"] == 0.0  # relu(2x + 1) summed, from x as given


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_a_real_models_cache_is_traced_in_and_out_and_validates(name):
    pytest.importorskip("transformers")
    model, prefix, step, key = real_models.cache_steps(name)
    assert key == "past_key_values"
    with torch.no_grad():
        cache = model(**prefix, use_cache=True).past_key_values
    untouched = copy.deepcopy(cache)
    log = tl.trace(model, (), {**step, "past_key_values": cache, "use_cache": True})
    assert log.unattributed == 0
    inputs = [op.io_path for op in log.ops if op.kind == "input"]
    outputs = [op.io_path for op in log.ops if op.kind == "output"]
    assert sum(p.startswith("input.past_key_values.") for p in inputs) >= 4  # a key and a value per layer
    assert sum(p.startswith("output.past_key_values.") for p in outputs) >= 4
    # validate runs a reference forward too: on a copy, so the caller's cache is extended once, as here.
    cache = copy.deepcopy(untouched)
    result = tl.validate(model, (), {**step, "past_key_values": cache, "use_cache": True})
    assert result.passed and result.outputs_match
    once = copy.deepcopy(untouched)
    with torch.no_grad():
        model(**step, past_key_values=once, use_cache=True)
    assert cache.get_seq_length() == once.get_seq_length() == untouched.get_seq_length() + 1


class _Returns(nn.Module):
    """Returns its result as a plain object, as a recurrent cell may return its state."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return _State(self.linear(x), x + 1)


class _Uses(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Returns()

    def forward(self, x):
        state = self.inner(x)
        return state.h * 2 + state.c


def test_a_module_returning_an_object_lists_its_tensors_as_outputs():
    torch.manual_seed(0)
    model, x = _Uses(), torch.randn(2, 4)
    log = tl.trace(model, x)
    (call,) = [c for c in log.module_calls if c.label == "inner:1"]
    assert call.output_ops == ["linear_1_1:1", "add_1_2:1"]  # h, then c
    assert log["add_1_2"].module_call.label == "inner:1"


def test_a_module_site_refuses_a_result_whose_tensors_are_all_in_an_object():
    torch.manual_seed(0)
    model, x = _Uses(), torch.randn(2, 4)
    # Before, the site edited nothing and said nothing: the intervened output was the plain one.
    with pytest.raises(tl.InterventionError, match="inside a _State object's attributes"):
        tl.trace(model, x, intervene={"inner": tl.scale(0.0)})
    # The op labels reach the same tensors.
    log = tl.trace(model, x, intervene={"linear_1_1": tl.scale(0.0), "add_1_2": tl.scale(0.0)})
    assert torch.equal(log.output, torch.zeros(2, 4))


class _StateThenHidden(nn.Module):
    """Returns a state object before the hidden value, as a block may return its cache first."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return _State(self.a(x), None), self.b(x)


class _UsesStateThenHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _StateThenHidden()

    def forward(self, x):
        state, h = self.block(x)
        return h * 2 + state.h


def test_a_module_site_takes_its_source_value_from_the_same_output_of_the_other_trace():
    """The tensors in the object's attributes count among the call's outputs: the site's output number
    must count them too, or patch_from and mean_ablate(trace=) read another output of the source call."""
    torch.manual_seed(0)
    model, clean, corrupt = _UsesStateThenHidden().eval(), torch.randn(2, 4), torch.randn(2, 4)
    clean_log = tl.trace(model, clean)
    (call,) = [c for c in clean_log.module_calls if c.label == "block:1"]
    assert call.output_ops == ["linear_1_1:1", "linear_2_2:1"]  # state.h, then h
    seen = []
    tl.trace(model, corrupt, intervene={"block": lambda t, op: seen.append(op.output_index)})
    assert seen == [1]
    with torch.no_grad():
        clean_h = model.block.b(clean)

    def hidden_replaced(value):
        return lambda module, inputs, output: (output[0], value.expand_as(output[1]))

    patched = tl.trace(model, corrupt, intervene={"block": tl.patch_from(clean_log)})
    assert torch.equal(patched.output, with_hook(model.block, model, (corrupt,), hidden_replaced(clean_h)))
    mean = tl.trace(model, corrupt, intervene={"block": tl.mean_ablate(trace=clean_log)})
    expected = with_hook(model.block, model, (corrupt,), hidden_replaced(clean_h.mean(0, keepdim=True)))
    assert torch.allclose(mean.output, expected)


def test_a_module_site_on_a_model_returning_a_cache_edits_its_hidden_states(gpt2):
    ids = torch.tensor([[5, 9, 13]])
    plain = tl.trace(gpt2, ids)
    (call,) = [c for c in plain.module_calls if c.label == "transformer:1"]
    assert len(call.output_ops) == 5  # the hidden states, and the cache's four tensors
    steered = tl.trace(gpt2, ids, intervene={"transformer": tl.scale(0.0)})
    # The cache's tensors were read inside the call (by attention): the site leaves them as they were.
    assert torch.equal(steered.output.logits, torch.zeros_like(plain.output.logits))
    for a, b in zip(_cache_tensors(steered.output.past_key_values), _cache_tensors(plain.output.past_key_values)):
        assert torch.equal(a, b)


def test_stopping_after_a_module_returning_an_object_records_its_outputs():
    torch.manual_seed(0)
    log = tl.trace(_Uses(), torch.randn(2, 4), stop_after="inner")
    assert log.stopped_after == "inner:1"
    (call,) = [c for c in log.module_calls if c.label == "inner:1"]
    assert call.output_ops == ["linear_1_1:1", "add_1_2:1"]


def test_the_cache_corpus_script_runs():
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import cache_corpus

    assert cache_corpus.row("gpt2") == "| gpt2 | DynamicCache | 4 | 4 | 0 | passed | True |"


class _Slotted:
    """A result object with ``__slots__``: no ``__dict__`` to find its tensors in."""

    __slots__ = ("hidden", "scores")

    def __init__(self, hidden, scores):
        self.hidden, self.scores = hidden, scores


class _ReturnsUnusualContainers(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.fc, self.kind = nn.Linear(4, 4), kind

    def forward(self, x):
        hidden = self.fc(x)
        if self.kind == "slots":
            return _Slotted(hidden, hidden.relu())
        return collections.deque([hidden, hidden.relu()])


@pytest.mark.parametrize("kind", ["slots", "deque"])
def test_tensors_in_a_slotted_object_or_a_deque_are_outputs_and_validate(kind):
    # Both were walked past: the trace had no outputs, and validation reported the outputs as differing.
    log = tl.trace(_ReturnsUnusualContainers(kind), torch.randn(2, 4))
    paths = ["output.hidden", "output.scores"] if kind == "slots" else ["output.0", "output.1"]
    assert [o.io_path for o in log.outputs] == paths
    assert [o.parents for o in log.outputs] == [["linear_1_1:1"], ["relu_1_2:1"]]
    result = tl.validate(_ReturnsUnusualContainers(kind), torch.randn(2, 4))
    assert result.outputs_match is True, result.outputs_differ


def test_an_uncopyable_keyword_leaves_the_others_copied_for_the_extra_runs(gpt2):
    """A streamer holds a lock and cannot be copied: it is shared with tl.validate's untraced run (and says
    so), while the cache passed beside it is still copied, so the caller's cache is extended once."""
    import threading

    from transformers import DynamicCache, TextStreamer

    class Tokenizer:
        def decode(self, ids, **kwargs):
            return ""

    streamer = TextStreamer(Tokenizer())
    streamer.lock = threading.Lock()
    prompt = torch.tensor([[5, 9, 13, 21]])
    cache = DynamicCache()
    with pytest.warns(UserWarning, match="could not copy a TextStreamer input"):
        result = tl.validate(gpt2.generate, (prompt,), {"past_key_values": cache, "streamer": streamer,
                                                        "max_new_tokens": 2, "do_sample": False})
    assert result.passed
    assert cache.get_seq_length() == 5  # the prompt and the first new token, fed once
