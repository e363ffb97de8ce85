"""Finding rows of tl.report.kernel_profile by label: a module known by two names has its calls labelled by its
first name, and a label spelled with the second one is refused saying so, as log[...] says it."""

import pytest
import torch
import torch.nn as nn

import torchlens as tl


class SharedUnderTwoNames(nn.Module):
    """One linear registered as ``fc`` and ``tied``, and held by ``block`` as ``block.0``: three names, one module."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.tied = self.fc
        self.block = nn.Sequential(self.fc)

    def forward(self, x):
        return self.block(self.tied(x))


@pytest.fixture(scope="module")
def profile():
    return tl.report.kernel_profile(SharedUnderTwoNames(), torch.randn(2, 4))


def test_a_second_name_of_a_module_points_to_the_calls_labelled_by_its_first(profile):
    assert [call.label for call in profile.trace.module_calls] == ["fc:1", "block:1", "fc:2"]
    with pytest.raises(KeyError, match=r"block\.0 is another name of the module fc, .*: fc:1, fc:2; the calls made "
                                       r"from block: fc:2"):
        profile["block.0:1"]
    with pytest.raises(KeyError, match=r"'tied:1' in this profile; tied is another name of the module fc"):
        profile["tied:1"]
    assert profile["fc:2"]["module_call"] == "fc:2"


def test_an_unknown_label_of_no_module_still_names_the_closest(profile):
    with pytest.raises(KeyError, match=r"'fc:3' in this profile; closest: fc:2"):
        profile["fc:3"]



@pytest.fixture(scope="module")
def routed():
    """A mixture-of-experts decoder: its router's topk returns weights and expert indices, one call, two layers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.OlmoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                                      num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return tl.report.kernel_profile(transformers.OlmoeForCausalLM(config).eval(), torch.tensor([[3, 5, 7, 9]]))


def test_every_layer_of_the_trace_finds_its_row_those_of_further_outputs_too(routed):
    # A call's further outputs have no row of their own: their op labels and layers lead to its first output's row.
    layers = {op.layer_label: op for op in routed.trace.ops if op.kind == "op"}
    further = {layer: op for layer, op in layers.items() if routed.trace.calls[op._trace.call_indices[op.index]]
               .first_record != op.index}
    assert any(op.func_name == "topk" for op in further.values())
    for layer, op in layers.items():
        first = routed[op.label]["layer"]  # the op row of the call that made it
        assert routed[layer]["layer"] == first
        assert (layer in routed[first]["outputs"]) == (layer in further)
