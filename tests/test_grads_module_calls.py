"""``module_call.grad`` of a call returning several tensors: a tuple in the call's return order, also where an
output has no op holding it (a tensor written through a view after the op that made it, see docs/tracing.md), which
is None in its place rather than dropped, so that each gradient stays with the output it is the gradient of."""

import pytest
import torch
import torch.nn as nn

import torchlens as tl


class MaskedFeatures(nn.Module):
    """Returns ``(hidden, features)``: ``hidden`` is a linear's output whose last time steps (padding) are zeroed
    in place through a view, ``features`` a second projection of the same input."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.features = nn.Linear(4, 6)

    def forward(self, x):
        hidden = self.proj(x)
        hidden[:, -2:].zero_()  # written through a view of the projection
        return hidden, self.features(x)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mask = MaskedFeatures()

    def forward(self, x):
        hidden, features = self.mask(x)
        return (hidden * features).sum()


@pytest.fixture(scope="module")
def traced():
    torch.manual_seed(0)
    model, x = Encoder(), torch.randn(2, 5, 4)
    log = tl.trace(model, x, grads=True)
    log.backward(log.output)
    hidden, features = model.mask(x)  # the untraced reference: the features' gradient, by retain_grad()
    features.retain_grad()
    (hidden * features).sum().backward()
    return log, features.grad


def test_a_call_output_no_op_holds_is_none_in_its_place(traced):
    log, features_grad = traced
    (call,) = [c for c in log.module_calls if c.address == "mask"]
    assert len(call.output_ops) == 1  # the written hidden state has no op holding it
    grad = call.grad
    assert isinstance(grad, tuple) and len(grad) == 2
    assert grad[0] is None  # not the features' gradient, which is the second output's
    assert torch.equal(grad[1], features_grad)


def test_a_loaded_trace_keeps_the_return_order(traced, tmp_path):
    log, features_grad = traced
    loaded = tl.load(log.save(str(tmp_path / "trace")))
    (call,) = [c for c in loaded.module_calls if c.address == "mask"]
    grad = call.grad
    assert isinstance(grad, tuple) and grad[0] is None and torch.equal(grad[1], features_grad)


def test_the_calls_address_names_the_call_not_its_second_output(traced):
    # log["mask:1"] is the op of the call's first output, as a forward hook's output[0]; no op holds it here, so
    # the key is the call, whose .grad keeps both places, and not the features' op, read as the call's output
    log, features_grad = traced
    for key in ("mask", "mask:1"):
        found = log[key]
        assert not isinstance(found, tl.Op), key
    call = log["mask:1"]
    assert isinstance(call, tl.ModuleCall) and call.grad[0] is None and torch.equal(call.grad[1], features_grad)


def test_extract_refuses_a_call_whose_first_output_no_op_holds(tmp_path):
    # It streamed the features' activation and gradient under the name "mask", as if they were the call's output
    torch.manual_seed(0)
    batches = [torch.randn(2, 5, 4) for _ in range(2)]
    for name in ("mask", "mask:1"):
        with pytest.raises(ValueError, match="does not name one op: .*written through a view"):
            tl.extract(Encoder(), batches, [name], str(tmp_path / name), grads=True,
                       loss_fn=lambda out, batch: out, progress=False)


def test_a_module_site_returning_a_tensor_written_through_a_view_is_refused_for_what_it_is():
    # The refusal said the call "read the tensor it returns" and pointed at the call's output_ops, which leave
    # that output out: following it would have edited the other output.
    torch.manual_seed(0)
    with pytest.raises(tl.InterventionError, match=r"written in place inside the call after the op that made it") \
            as refused:
        tl.trace(Encoder(), torch.randn(2, 5, 4), intervene={"mask": tl.zero_ablate()})
    assert "output_ops leave it out" in str(refused.value) and "log['mask:1'].ops" in str(refused.value)
    # The advice holds: the submodule that made it is a site, and the write applies to the changed value.
    log = tl.trace(Encoder(), torch.randn(2, 5, 4), intervene={"mask.proj": tl.zero_ablate()})
    assert log.output.item() == 0.0


class ScaledAndWeight(nn.Module):
    """Returns ``(x * 2, self.weight)``: its input needs no gradient, its weight, returned as it is, does."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * 2, self.weight


class Weighted(nn.Module):
    def __init__(self):
        super().__init__()
        self.part = ScaledAndWeight()

    def forward(self, x):
        scaled, weight = self.part(x)
        return (scaled * weight).sum()


def test_a_call_whose_only_op_output_has_no_gradient_names_the_output_no_op_holds():
    # It was refused as if nothing it returned could have a gradient, naming the product alone, while the weight it
    # returned as it is has one.
    torch.manual_seed(0)
    model = Weighted()
    log = tl.trace(model, torch.randn(3), grads=True)
    log.backward(log.output)
    (call,) = [c for c in log.module_calls if c.address == "part"]
    with pytest.raises(tl.GradientUnavailable, match=r"does not require grad.*part:1's output 2 of 2 is a tensor no "
                                                     r"op holds \(a parameter or buffer returned as it is"):
        call.grad
    assert model.part.weight.grad is not None
