"""What an intervened trace records and says at the edges: which sites an input or output record points to,
a stop_after site never reached, the order of sites naming one value, and actions returning a value that
shares memory with the one they were given."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from zoo import zoo  # noqa: E402

CASES = {k: v for k, v in zoo().items() if k != "transformer_fastpath"}


class _ReturnsWhatNoOpMade(nn.Module):
    """Returns its input and a parameter as they are, beside the one value an op made."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x, self.fc(x), self.fc.weight


@pytest.mark.parametrize("site, says", [
    ("output_1:1", r"output_1:1, its input input_1:1 passed through unchanged, which no op of the forward makes"),
    ("output.2", r"output_3:1, a tensor the forward returns as it is \(a parameter"),
    ("output_2:1", r"name the op that produces it \(linear_1_1:1\)"),
    ("input_1", r"name the ops that read it \(linear_1_1:1\), or pass"),  # not the output record reading it
])
def test_an_output_or_input_site_names_only_ops_as_what_to_intervene_at(site, says):
    """The refusal of an input or output record never sends the user to another record that is no site
    either: an output no op made (an input or a parameter returned as it is) says so."""
    with pytest.raises(KeyError, match=says):
        tl.trace(_ReturnsWhatNoOpMade(), torch.randn(2, 4), intervene={site: tl.zero_ablate()})
    with pytest.raises(KeyError, match="no stop_after" if site == "output_1:1" else "stop_after site"):
        tl.trace(_ReturnsWhatNoOpMade(), torch.randn(2, 4), stop_after=site)


def test_label_sites_apply_before_module_sites_at_one_value_whatever_the_dict_order():
    """A label site runs as its op returns, a module site as the call returns: at the module's output op the
    label's action always comes first, and the record lists the sites in the order they applied."""
    model, args, _ = CASES["mlp"]
    plain = tl.trace(model, args)
    made = plain["layers.0"].activation
    label = plain["layers.0"].label
    add_one, double = (lambda t, op: t + 1), (lambda t, op: t * 2)
    for intervene in ({"layers.0": double, label: add_one}, {label: add_one, "layers.0": double}):
        site = tl.trace(model, args, intervene=intervene)["layers.0"]
        assert torch.equal(site.activation, (made + 1) * 2) and torch.equal(site.original, made)
        assert site.intervention.site == (label, "layers.0")


class _WritesItsLinearInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        h.relu_()
        return h * 2


@pytest.mark.parametrize("site", ["linear_1_1:1", "fc"])
@pytest.mark.parametrize("alias", [lambda t, op: t.view_as(t), lambda t, op: t.detach(), lambda t, op: t[:]],
                         ids=["view_as", "detach", "slice"])
def test_an_action_returning_an_alias_of_its_value_keeps_the_original_from_later_writes(site, alias):
    """The relu_ after the site writes the action's value, which shares memory with the value the op made:
    op.original was changed with it, and validate() then reported a mismatch at an op that replays exactly."""
    torch.manual_seed(0)
    model, x = _WritesItsLinearInPlace(), torch.randn(3, 4)
    plain = tl.trace(model, x)
    log = tl.trace(model, x, intervene={site: alias})
    assert torch.equal(log.output, plain.output)  # the model computes what a forward hook returning it gives
    assert torch.equal(log["linear_1_1:1"].original, plain["linear_1_1:1"].activation)
    assert torch.equal(log["linear_1_1:1"].activation, plain["linear_1_1:1"].activation)
    assert log.validate().passed


class _WritesThroughAnOddlyStridedView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        h = self.fc(x).unsqueeze(1).transpose(1, 2)  # (2, 16, 1, 5): a size-1 dimension with a stride of 80
        h[..., 0] = 0.5
        return h.sum(-1)


def test_an_alias_returned_at_an_in_place_site_is_written_into_its_receiver():
    """At an in-place site the action's value is copied into the receiver; an alias of it with other strides
    (view_as gives the size-1 dimension a stride of 5) made torch refuse the copy as overlapping memory, as
    Longformer's masked chunks did."""
    model, x = _WritesThroughAnOddlyStridedView(), torch.randn(2, 16, 5)
    plain = tl.trace(model, x)
    log = tl.trace(model, x, intervene={"setitem_1_4:1": lambda t, op: t.view_as(t)})
    assert torch.equal(log.output, plain.output) and log.validate().passed


class _ContiguousThenSum(nn.Module):
    """``h.contiguous()`` returns ``h`` itself; both are then read."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h.contiguous() + h


def test_an_op_returning_its_argument_as_the_site_leaves_the_argument_its_own_producer():
    # The action's value replaces what contiguous returned; h, which the model still reads, stays linear's.
    model, x = _ContiguousThenSum(), torch.randn(2, 4)
    site = next(op.label for op in tl.trace(model, x).ops if op.func_name == "contiguous")
    log = tl.trace(model, x, intervene={site: tl.scale(3.0)})
    add = next(op for op in log.ops if op.func_name == "add")
    assert add.parents == [site, "linear_1_1:1"] and log.unattributed == 0
    with torch.no_grad():
        h = model.fc(x)
    assert torch.equal(log.output, h * 3.0 + h)
