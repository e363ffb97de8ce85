"""Module sites: how a call is numbered, a call returning one tensor twice, and a call whose hook raised."""

from __future__ import annotations

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
    with pytest.raises(tl.InterventionError, match=r"'pair' were never reached.*returned None, or raised an "
                                                   r"exception, in its forward or one of its hooks"):
        tl.trace(model, x, intervene={"pair": tl.scale(3.0)})
    assert torch.equal(tl.trace(model, x).output, x * 2)


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
