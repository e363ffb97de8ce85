"""Names that are no op: a parameter, a buffer, or a module holding only parameters (torch.export's unlifted
module inlines its submodules' forwards) given as an intervention site, a stop_after= site or a save=/grads= entry
is refused saying what it is and which ops to name instead."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from untouched import assert_clean_process


def test_a_parameter_or_buffer_address_is_refused_saying_to_name_the_ops_that_read_it():
    # "fc.weight" as a site, a stop_after= site or a save=/grads= entry was refused as an unknown name, with no
    # word that it is a parameter nor what to name instead.
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    x = torch.randn(3, 4)
    reads = r"which no op of the forward makes: {}= takes ops; name the ops that read it, which log\.{}"
    for address, kind, listing in (("0.weight", "parameter", r"params\[k\]\.op_labels lists; its own gradient"),
                                   ("1.running_mean", "buffer", r"buffers\[k\]\.readers lists\)")):
        for option, options in (("intervene", {"intervene": {address: tl.zero_ablate()}}),
                                ("stop_after", {"stop_after": address})):
            with pytest.raises(KeyError, match=rf"site '{address}' is neither .*\({address} is a {kind} of the model, "
                                               + reads.format(option, listing)):
                tl.trace(model, x, **options)
        for option in ("save", "grads"):
            with pytest.raises(tl.UnmatchedSelection, match=rf"{option}= matched nothing for it \({address} is a "
                                                            rf"{kind} of the model, " + reads.format(option, listing)):
                tl.trace(model, x, **{option: [address]})
    assert_clean_process()
    log = tl.trace(model, x)
    assert log.params[0].address == "0.weight" and log.params[0].op_labels == ["linear_1_1:1"]
    mean = next(b for b in log.buffers if b.address == "1.running_mean")
    assert mean.readers == ["batchnorm_1_2:1"]


class _Exportable(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(x))


@pytest.mark.parametrize("option", ["intervene", "save", "grads"])
def test_a_parameter_holder_of_an_exported_module_is_refused_naming_its_ops(option):
    # torch.export's unlifted module inlines the submodules' forwards: "block.0" holds their parameters only.
    x = torch.randn(3, 4)
    exported = torch.export.export(_Exportable(), (x,)).module()
    assert dict(exported.named_children())["block"] is not None
    selection = {"block.0": tl.zero_ablate()} if option == "intervene" else ["block.0"]
    with pytest.raises((tl.InterventionError, tl.UnmatchedSelection)) as raised:
        tl.trace(exported, x, **{option: selection})
    message = str(raised.value)
    assert "no submodules" in message and "ops that read its parameters" in message
    assert "holds (none)" not in message
    log = tl.trace(exported, x)
    assert list(log["linear_1_1:1"].params) == ["block.0.weight", "block.0.bias"]
    assert torch.equal(log.output, exported(x))
    assert_clean_process()


class _LearnedPositions(nn.Module):
    """A module that returns its own parameter or buffer as it is (a learned positional embedding, a fixed mask)."""

    def __init__(self, returns: str):
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 4))
        self.register_buffer("fixed", torch.randn(5, 4))
        self.returns = returns

    def forward(self):
        return getattr(self, self.returns)


class _AddsPositions(nn.Module):
    def __init__(self, returns: str):
        super().__init__()
        self.positions, self.head = _LearnedPositions(returns), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(x + self.positions())


@pytest.mark.parametrize("returns, kind, listing", [("table", "parameter", r"log\.params\[k\]\.op_labels"),
                                                     ("fixed", "buffer", r"log\.buffers\[k\]\.readers")],
                         ids=["parameter", "buffer"])
def test_a_module_returning_its_own_parameter_or_buffer_is_refused_as_a_site_naming_it(returns, kind, listing):
    # The refusal said the tensor was made where the trace cannot see (before the forward, on another thread, inside
    # TorchScript) and to trace the code that makes it as torch calls, which no change to the model could do.
    model, x = _AddsPositions(returns), torch.randn(2, 5, 4)
    with pytest.raises(tl.InterventionError, match=rf"positions:1 returns at output \(of shape \(5, 4\)\) the {kind} "
                                                   rf"positions\.{returns} as it is, which no op of the forward makes, "
                                                   rf"so no record holds it to change\. Intervene at the ops that read "
                                                   rf"it, which {listing} lists"):
        tl.trace(model, x, intervene={"positions": tl.zero_ablate()})
    with pytest.raises(tl.UnmatchedSelection, match=r"positions:1 returned only tensors no op of the trace made \(a "
                                                    r"parameter or buffer returned as it is, or one made where"):
        tl.trace(model, x, save=["positions"])
    assert_clean_process()


def test_an_op_type_as_a_site_is_refused_naming_the_predicate_that_means_it():
    # save=["relu"] keeps every relu op, but intervene={"relu": ...} and stop_after="relu" were refused as unknown
    # names with no word that an op type is no site, nor how to name every op of a type.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU()).eval()
    x = torch.randn(3, 4)
    every = "'relu' is an op type, which names no site: a predicate site, lambda op: op.type == 'relu', names every"
    with pytest.raises(KeyError, match=re.escape(every)):
        tl.trace(model, x, intervene={"relu": tl.zero_ablate()})
    with pytest.raises(KeyError, match=re.escape("stop_after=lambda op: op.type == 'layernorm' stops after its first")):
        tl.trace(model, x, stop_after="layer_norm")  # named as torch spells it, compared as op types are
    with pytest.raises(KeyError, match=re.escape(every)):  # not told to pass root=, which makes no type a site
        tl.trace(lambda t: model(t), x, intervene={"relu": tl.zero_ablate()})
    nested = nn.Sequential()
    nested.add_module("block", nn.Sequential(nn.Linear(4, 4)))
    nested.block.add_module("norm", nn.LayerNorm(4))
    with pytest.raises(KeyError, match=r"'norm' is an op type, .*; closest: block\.norm"):  # or a slip for a module
        tl.trace(nested, x, intervene={"norm": tl.zero_ablate()})
    with pytest.raises(KeyError) as unknown:  # a name no torch function has gets no such hint
        tl.trace(model, x, intervene={"relux": tl.zero_ablate()})
    assert "op type" not in str(unknown.value)
    assert_clean_process()
    # The predicate named edits both relus, as hooks on both modules would.
    handles = [model[k].register_forward_hook(lambda m, i, o: o * 0) for k in (1, 3)]
    try:
        expected = model(x)
    finally:
        for handle in handles:
            handle.remove()
    log = tl.trace(model, x, intervene={(lambda op: op.type == "relu"): tl.zero_ablate()})
    assert [a.label for a in log.interventions] == ["relu_1_2:1", "relu_2_4:1"]
    assert torch.equal(log.output, expected)


def test_a_class_name_that_spells_an_op_type_selects_that_type_wherever_it_ran():
    # Op types are compared without case or underscores, so "Linear" is the type linear: the F.linear the root
    # forward calls outside every nn.Linear is selected with the modules' outputs (docs/tracing.md).
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.weight = nn.Parameter(torch.randn(2, 4))

        def forward(self, x):
            return nn.functional.linear(self.fc(x).relu(), self.weight)

    x = torch.randn(3, 4)
    saved = tl.trace(Head(), x, save=["Linear"])
    assert [op.label for op in saved.ops if op.kind == "op" and op.has_activation] == ["linear_1_1:1", "linear_2_3:1"]
    watched = tl.trace(Head(), x, save="none", grads=["Linear"])
    watched.backward(watched.output.sum())
    assert [op.label for op in watched.ops if op.kind == "op" and op.grad is not None] == ["linear_1_1:1",
                                                                                          "linear_2_3:1"]
    assert_clean_process()
