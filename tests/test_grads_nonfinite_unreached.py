"""nonfinite_origin(grads=True) after a backward that raised part way, as anomaly mode's does at the first node
that returns NaN: the gradients the trace received are finite, and those of the ops the backward never reached
were not examined.  The report says which ops those are rather than calling the backward finite; after a backward
that finished, no op is left so."""

import os
import sys
import warnings

import pytest
import torch

import torchlens as tl

sys.path.insert(0, os.path.dirname(__file__))
import real_models  # noqa: E402
from test_grads_nonfinite_unseen import sqrt_at_zero  # noqa: E402


@pytest.fixture(scope="module")
def gpt2():
    return real_models.small_gpt2_lm(), torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))


def _traced(model, ids, anomaly: bool):
    """A trace of GPT-2 whose backward turns NaN in ``sqrt``, after a backward from the logits: under anomaly
    mode that backward raises at ``SqrtBackward0``, before it reaches the ops ahead of the ``sqrt``."""
    handle = model.transformer.h[1].attn.register_forward_hook(sqrt_at_zero)
    try:
        log = tl.trace(model, ids, grads=True, save="none")
        with warnings.catch_warnings(), torch.autograd.set_detect_anomaly(anomaly):
            warnings.simplefilter("ignore")  # anomaly mode warns with the forward traceback
            if anomaly:
                with pytest.raises(RuntimeError, match="SqrtBackward0"):
                    log.backward(log.output.logits.sum())
            else:
                log.backward(log.output.logits.sum())
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    return log


def test_a_backward_anomaly_mode_stopped_leaves_its_unreached_ops_named(gpt2):
    log = _traced(*gpt2, anomaly=True)
    report = tl.debug.nonfinite_origin(log, grads=True)
    assert not report.found and report.unreached
    # The op that the sqrt read, whose gradient the sqrt's backward would have sent, is among them.
    sqrt_label = next(label for label in log.labels if label.startswith("sqrt"))
    assert any(log[label].func_name == "sub" and sqrt_label in log[label].children for label in report.unreached)
    assert "received no gradient" in str(report)


def test_a_finished_backward_leaves_no_op_unreached(gpt2):
    report = tl.debug.nonfinite_origin(_traced(*gpt2, anomaly=False), grads=True)
    assert report.found and report.born_in_certain and report.unreached == ()


class _Gated(torch.autograd.Function):
    """Gates ``h`` by a mask; its backward sends ``h`` a gradient and the mask none."""

    @staticmethod
    def forward(ctx, h, mask):
        ctx.save_for_backward(mask)
        return h * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask, None


class _GatedByAComparison(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.value, self.head = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        mask = (self.gate(x) > 0).float()  # a comparison: no gradient reaches the gate from here
        return self.head(_Gated.apply(self.value(x), mask))


def test_an_op_only_a_comparison_read_is_not_unreached_though_a_function_read_the_mask():
    log = tl.trace(_GatedByAComparison(), torch.randn(2, 4), grads=True)
    log.backward(log.output.sum())
    report = tl.debug.nonfinite_origin(log, grads=True)
    assert not report.found and report.unreached == ()
