"""Module sites: how a call is numbered, a call returning one tensor twice, and a call whose hook raised."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from accel_paths import PATHS, on_path


class _Pair(nn.Module):
    """Returns one tensor twice, as a tuple."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h, h


class _SumOfPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = _Pair()

    def forward(self, x):
        a, b = self.pair(x)
        return a + b


def test_a_module_call_numbered_zero_is_refused_as_such():
    # Else it would be a site no call ever reaches, reported as control flow that skipped it.
    model, x = _SumOfPair(), torch.randn(2, 4)
    with pytest.raises(KeyError, match="module call 'pair:0': calls are numbered from 1"):
        tl.trace(model, x, intervene={"pair:0": tl.scale(2.0)})


def test_a_tensor_a_module_site_returns_twice_is_one_value_edited_once():
    model, x = _SumOfPair(), torch.randn(2, 4)
    seen = []

    def triple(t, op):
        seen.append(op.output_index)
        return t * 3

    log = tl.trace(model, x, intervene={"pair": triple})
    assert seen == [0]  # the action ran once, for the first place the tensor is returned
    assert [applied.site for applied in log.interventions] == ["pair"]
    with torch.no_grad():
        h = model.pair.fc(x)
    assert torch.equal(log.output, h * 3 + h * 3)


class _CaughtHookFailure(nn.Module):
    """Calls ``pair``, whose forward hook raises, and falls back to ``x * 2`` when it does."""

    def __init__(self):
        super().__init__()
        self.pair = _Pair()

        def refuse(module, args, output):
            raise ValueError("hook refused the output")

        self.pair.register_forward_hook(refuse)

    def forward(self, x):
        try:
            a, b = self.pair(x)
        except ValueError:
            return x * 2
        return a + b


def test_a_module_call_whose_hook_raised_is_not_edited_nor_counted_as_reached():
    # The call computed an output, but its caller never received it: nothing to edit, and the site says so.
    model, x = _CaughtHookFailure(), torch.randn(2, 4)
    with pytest.raises(tl.InterventionError, match=r"'pair' were never reached.*returned None or no tensor, or "
                                                   r"raised an exception, in its forward or one of its hooks"):
        tl.trace(model, x, intervene={"pair": tl.scale(3.0)})
    assert torch.equal(tl.trace(model, x).output, x * 2)


class _CountsRows(nn.Module):
    """A submodule returning a number, no tensor: a module site there has nothing to edit."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.rows = _Rows()

    def forward(self, x):
        return self.fc(x) * self.rows(x)


class _Rows(nn.Module):
    def forward(self, x):
        return x.shape[0]


@pytest.mark.parametrize("site", ["rows", "rows:1"])
def test_a_module_site_whose_calls_return_no_tensor_is_refused_not_returned_as_edited(site):
    # It used to return the plain forward with no intervention applied and nothing said.
    model, x = _CountsRows(), torch.randn(2, 4)
    with pytest.raises(tl.InterventionError, match=rf"'{site}' were never reached.*returned None or no tensor") as e:
        tl.trace(model, x, intervene={site: tl.zero_ablate()})
    assert "ran no such op or module call" not in str(e.value)  # it ran: the message said both
    assert tl.trace(model, x, stop_after=site).stopped_after == "rows:1"  # a stop needs no tensor to change


@pytest.fixture(scope="module")
def falcon_mamba():
    """FalconMamba's mixer applies ``ACT2FN["silu"](x)``, a module made in the forward, to its B and C states."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.FalconMambaConfig(hidden_size=16, state_size=4, num_hidden_layers=1, vocab_size=32,
                                            expand=2, conv_kernel=3, time_step_rank=4, use_mambapy=False)
    ids = torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(1))
    return transformers.FalconMambaForCausalLM(config).eval(), ids


@pytest.mark.parametrize("compiled", PATHS)
def test_a_module_the_forward_makes_itself_is_refused_as_a_site_naming_the_op_to_use(falcon_mamba, compiled):
    # The trace names it <unregistered SiLUActivation #1>; as a site it was refused as neither a label nor an address.
    model, ids = falcon_mamba
    with on_path(compiled):
        plain = tl.trace(model, ids)
        call = next(c for c in plain.module_calls if c.label.startswith("<unregistered SiLUActivation"))
        for key in (call.label, call.label.rpartition(":")[0]):
            for option in ("intervene", "stop_after"):
                given = {"intervene": {key: tl.scale(2.0)}} if option == "intervene" else {"stop_after": key}
                with pytest.raises(KeyError, match=r"names a module that is not in FalconMambaForCausalLM .* "
                                                   r"intervene at the label of the op it returned"):
                    tl.trace(model, ids, **given)
        (label,) = call.output_ops
        assert plain[call.label].label == label
        edited = tl.trace(model, ids, intervene={label: tl.scale(2.0)})
    assert edited[label].intervention is not None
    assert torch.equal(edited[label].activation, 2 * plain[label].activation)


@pytest.fixture(scope="module")
def blip2():
    """BLIP-2's Q-Former returns its hidden states and their first token (pooled inside it) as its outputs."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    config = transformers.Blip2Config(
        vision_config=dict(small, image_size=16, patch_size=8),
        qformer_config=dict(small, encoder_hidden_size=16, cross_attention_frequency=1, vocab_size=32),
        text_config=transformers.OPTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32,
                                           vocab_size=64, max_position_embeddings=32, word_embed_proj_dim=16).to_dict(),
        num_query_tokens=2, image_token_index=63)
    ids = torch.tensor([[63, 63, 5, 6, 7]])
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    return transformers.Blip2ForConditionalGeneration(config).eval(), {"input_ids": ids, "pixel_values": pixels}


@pytest.mark.parametrize("compiled", PATHS)
def test_a_call_reading_what_it_returns_is_refused_naming_the_read(blip2, compiled):
    # The refusal gave attention weights and a T5 position bias as what the call read, never the read itself: here
    # the Q-Former's pooling of its hidden states' first token, a __getitem__.
    model, kwargs = blip2
    with on_path(compiled):
        with pytest.raises(tl.InterventionError, match=r"qformer:1 read the tensor it returns at output\.last_"
                                                       r"hidden_state .* \(read by __getitem__ in qformer at "
                                                       r".*\.py:\d+\), "):
            tl.trace(model, (), kwargs, intervene={"qformer": tl.scale(2.0)})
        plain = tl.trace(model, (), kwargs)
        hidden, pooled = next(call for call in plain.module_calls if call.label == "qformer:1").output_ops
        edited = tl.trace(model, (), kwargs, intervene={hidden: tl.scale(2.0)})
    # The named output op is the site: the pooling inside the call reads the edited value, as a hook on the norm
    # that makes it gives.
    norm = plain[hidden].module.rpartition(":")[0]
    assert norm.startswith("qformer.encoder.layer.0.") and plain[pooled].func_name == "__getitem__"
    handle = model.get_submodule(norm).register_forward_hook(lambda module, args, output: output * 2.0)
    try:
        with torch.no_grad():
            expected = model(**kwargs).logits
    finally:
        handle.remove()
    assert torch.equal(edited.output.logits, expected)


@pytest.mark.parametrize("compiled", PATHS)
def test_a_forward_hook_reading_what_its_module_returns_is_named_by_its_line(compiled):
    # A module's forward hooks run inside its call, so an activation cache's output.detach() is a read the refusal
    # must name: it gave "detach in 0" and listed attention weights and position biases, never the user's hook.
    torch.manual_seed(0)
    model, x, cache = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4), {}

    def cache_output(module, args, output):
        cache["0"] = output.detach()

    line = cache_output.__code__.co_firstlineno + 1
    handle = model[0].register_forward_hook(cache_output)
    try:
        with on_path(compiled), pytest.raises(tl.InterventionError) as refused:
            tl.trace(model, x, intervene={"0": tl.scale(2.0)})
    finally:
        handle.remove()
    message = str(refused.value)
    assert re.search(rf"\(read by detach in 0 at {re.escape(__file__)}:{line}\), ", message), message
    assert "a forward hook of the module reading its output" in message


class _FcTwice(nn.Module):
    """``fc``, then ``mid``, then ``fc`` again."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.mid = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.mid(self.fc(x)))


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("at", ["mid", "linear_2_2:1"], ids=["module site", "label site"])
def test_a_module_an_action_runs_is_no_call_of_the_forward(at, compiled):
    # The action's own model.fc(t) was recorded as fc:2, a call with no ops: the model's second call became fc:3,
    # a site "fc:2" met the action's call (refused as returning a tensor no op made) and stop_after="fc:2" stopped
    # the forward inside the action, before the model's second call ran.
    model, x = _FcTwice(), torch.randn(2, 4)
    probe = lambda t, op: t + 0 * model.fc(t)  # noqa: E731 - reads the model, changes nothing
    with on_path(compiled):
        log = tl.trace(model, x, intervene={at: probe, "fc:2": tl.scale(-2.0)})
        stopped = tl.trace(model, x, intervene={at: probe}, stop_after="fc:2")
    assert [call.label for call in log.module_calls] == ["fc:1", "mid:1", "fc:2"]
    assert [applied.label for applied in log.interventions] == ["linear_2_2:1", "linear_1_1:2"]
    with torch.no_grad():
        assert torch.equal(log.output, model(x) * -2.0)
        assert torch.equal(stopped["fc:2"].activation, model(x))
    assert [op.label for op in stopped.ops] == ["input_1:1", "linear_1_1:1", "linear_2_2:1", "linear_1_1:2"]
    assert not model.fc._forward_hooks and not model.fc._forward_pre_hooks
