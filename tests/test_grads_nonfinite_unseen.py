"""nonfinite_origin(grads=True) when the trace did not receive every gradient near the first non-finite one: a
``grads=[...]`` selection, or a write into a view (whose earlier gradient hook autograd never calls).  The report
may not call the loss non-finite, nor name one op as certainly where the NaN was born, on gradients it never saw;
autograd's anomaly mode, run on the same GPT-2, shows the birthplace lies beyond them."""

import os
import re
import sys
import warnings

import pytest
import torch

import torchlens as tl

sys.path.insert(0, os.path.dirname(__file__))
import real_models  # noqa: E402


def sqrt_at_zero(module, args, output):
    """A finite forward whose backward turns NaN in ``sqrt`` (its derivative at 0, times 0)."""
    h = output[0]
    return (h + torch.sqrt(h - h) * 0,) + tuple(output[1:])


def sqrt_written_into_a_view(module, args, output):
    """The same NaN, from ``sqrt_`` written into a view: anomaly mode names the base's CopySlices."""
    h = output[0]
    zero = h - h
    zero[..., :4].sqrt_()
    return (h + zero * 0,) + tuple(output[1:])


@pytest.fixture(scope="module")
def gpt2():
    return real_models.small_gpt2_lm(), torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))


def _report(model, ids, hook, grads):
    handle = model.transformer.h[1].attn.register_forward_hook(hook)
    try:
        model.zero_grad(set_to_none=True)
        log = tl.trace(model, (ids,), grads=grads, save="none", record_finite=True)
        log.backward(log.output.logits.sum())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # anomaly mode also warns with the forward traceback
            with torch.autograd.set_detect_anomaly(True), pytest.raises(RuntimeError) as error:
                model(ids).logits.sum().backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    node = re.search(r"Function '([\w:]+)' returned nan", str(error.value)).group(1)
    return log, tl.debug.nonfinite_origin(log, grads=True), node


def test_a_selection_is_not_read_as_a_non_finite_loss(gpt2):
    log, report, node = _report(*gpt2, sqrt_at_zero, grads=["sub"])
    assert node == "SqrtBackward0" and not tl.debug.nonfinite_origin(log).found  # the forward is finite
    assert report.origin.func_name == "sub" and not report.loss_nonfinite
    assert "the loss side" not in str(report)
    assert [log[label].func_name for label in report.born_in] == ["sqrt"]
    assert report.born_in_unseen == report.born_in and not report.born_in_certain
    assert "did not receive the gradient of sqrt" in str(report)


def test_a_gradient_a_view_write_replaced_is_not_called_finite(gpt2):
    log, report, node = _report(*gpt2, sqrt_written_into_a_view, grads=True)
    assert node == "torch::autograd::CopySlices"  # the write's node, beyond the view the report can name
    assert report.origin.func_name == "sub" and not report.born_in_certain
    assert [log[label].func_name for label in report.born_in_unseen] == ["__getitem__"]
    assert "its output gradient was finite" not in str(report)


def test_a_birthplace_whose_gradient_arrived_is_still_certain(gpt2):
    log, report, node = _report(*gpt2, sqrt_at_zero, grads=True)
    assert report.born_in_certain and not report.born_in_unseen and not report.loss_nonfinite
    assert log[report.born_in[0]].grad_fn == node == "SqrtBackward0"
