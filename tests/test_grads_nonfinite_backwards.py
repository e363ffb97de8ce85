"""nonfinite_origin(grads=True) where the loss reads more than the final output: over several backwards, and from a
tensor the forward returned.  Gradients are ordered by their first arrival, so an op an earlier, finite backward
reached (an auxiliary loss on a hidden state) comes before the ops a later backward reaches first.  When that later
backward carries a NaN down to it, the origin is still the op where the NaN entered, the one whose readers'
gradients are finite, as autograd's anomaly mode places it.  And a returned tensor's gradient also comes straight
from the loss, which the trace does not see: a NaN there is not placed in its readers' backward for certain."""

import os
import sys

import pytest
import torch

import torchlens as tl

sys.path.insert(0, os.path.dirname(__file__))
import real_models  # noqa: E402
from test_grads_nonfinite_unseen import sqrt_at_zero  # noqa: E402


@pytest.fixture(scope="module")
def gpt2():
    return real_models.small_gpt2_lm(), torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))


def _report(model, ids, auxiliary: bool):
    """The report after a backward from the logits (NaN from ``sqrt`` in the second block's attention), after a
    finite backward from the first block's output when ``auxiliary``."""
    handle = model.transformer.h[1].attn.register_forward_hook(sqrt_at_zero)
    try:
        model.zero_grad(set_to_none=True)
        log = tl.trace(model, (ids,), {"output_hidden_states": True}, grads=True, save="none")
        if auxiliary:
            log.backward(log.output.hidden_states[1].pow(2).sum(), retain_graph=True)
        log.backward(log.output.logits.sum())
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    return log, tl.debug.nonfinite_origin(log, grads=True)


def test_a_nan_a_later_backward_carries_past_an_earlier_backwards_ops_is_placed_where_it_entered(gpt2):
    single_log, single = _report(*gpt2, auxiliary=False)
    log, report = _report(*gpt2, auxiliary=True)
    assert log.num_backwards == 2 and single.born_in_certain
    assert report.origin_label == single.origin_label and report.origin.func_name == "sub"
    assert report.born_in == single.born_in and report.born_in_certain
    assert [log[label].func_name for label in report.born_in] == ["sqrt"]
    # The earlier backward's ops hold NaN too, downstream of the origin, and are listed as reached after it.
    assert report.nonfinite[0] == report.origin_label and set(report.nonfinite) == set(single.nonfinite)
    assert not any(log[label].grad.isnan().any() for label in report.born_in)


def test_a_nan_the_loss_sends_straight_to_a_returned_tensor_is_not_placed_in_its_readers(gpt2):
    # The loss reads the final hidden state, which the forward returns, as well as the logits made from it (through
    # one op, the slice lm_head reads): the NaN comes from the loss's own sqrt at 0, not from that slice's backward,
    # whose gradient is finite.
    model, ids = gpt2
    log = tl.trace(model, (ids,), {"output_hidden_states": True}, grads=True, save="none")
    final = log.output.hidden_states[-1]
    log.backward(log.output.logits.sum() + torch.sqrt(final - final).sum())
    model.zero_grad(set_to_none=True)
    report = tl.debug.nonfinite_origin(log, grads=True)
    (made_by,) = report.origin.parents
    assert log.output_producer(log.outputs[-1].index) == report.origin.index  # the final hidden state
    assert log[made_by].module_address == "transformer.ln_f"
    assert len(report.born_in) == 1 and not log[report.born_in[0]].grad.isnan().any()
    assert not report.born_in_certain and not report.loss_nonfinite and report.returned
    assert "the loss's own gradient" in str(report) and "its output gradient was finite" not in str(report)


def test_a_non_finite_loss_after_an_earlier_backward_is_still_called_the_losss(gpt2):
    model, ids = gpt2
    log = tl.trace(model, (ids,), {"output_hidden_states": True}, grads=True, save="none")
    log.backward(log.output.hidden_states[1].pow(2).sum(), retain_graph=True)
    log.backward(log.output.logits.sum() * float("nan"))
    model.zero_grad(set_to_none=True)
    report = tl.debug.nonfinite_origin(log, grads=True)
    assert log.output_producer(log.outputs[0].index) == report.origin.index  # the logits
    assert report.loss_nonfinite and "the loss side" in str(report)
