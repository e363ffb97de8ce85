"""Traces taken inside a training loop: an optimizer step after the trace, a backward run late, an evaluation
step under no_grad asked for gradients, a compiled model traced at some steps."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
from torchlens.errors import ActivationUnavailable

from real_models import bert, gpt2, vit
from zoo import zoo

pytest.importorskip("transformers")


def _trained_after_trace():
    """A ViT traced in train mode, then one optimizer step: its [CLS] token expanded over the batch is an op
    whose output is a view of the ``cls_token`` parameter."""
    torch.manual_seed(0)
    model, (images,), _ = vit()
    model.train()
    log = tl.trace(model, images, kwargs={"labels": torch.tensor([0, 2])}, grads=True)
    log.backward(log.output.loss)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return log


def test_a_parameter_view_updated_by_an_optimizer_step_is_not_replayed_rather_than_a_mismatch():
    log = _trained_after_trace()
    result = log.validate()
    assert result.passed and not result.mismatched, result
    expand = next(op for op in log if op.func_name == "expand" and op.params)
    assert expand.params == ("vit.embeddings.cls_token",)
    why = dict(result.not_replayed)[expand.label]
    assert why.startswith("parameter changed since the trace") and "optimizer step" in why


def test_reading_a_parameter_view_after_an_optimizer_step_names_the_parameter():
    log = _trained_after_trace()
    expand = next(op for op in log if op.func_name == "expand" and op.params)
    with pytest.raises(ActivationUnavailable, match=r"parameter vit\.embeddings\.cls_token's .*optimizer step"):
        expand.activation


@pytest.mark.skipif(not hasattr(BaseException, "add_note"), reason="exception notes need Python 3.11")
def test_a_backward_after_an_optimizer_step_names_the_parameters_it_changed():
    """A trace's loss kept while another micro-batch's backward and an optimizer step ran: autograd refuses
    the late backward naming only a shape and a version; the note says which parameters changed, and why."""
    torch.manual_seed(0)
    model, _, inputs = gpt2()
    ids = inputs["input_ids"]
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tl.trace(model, (), {"input_ids": ids, "labels": ids}, save="none", grads=True)
    late_loss = log.output.loss
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        log.backward(late_loss)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "parameters changed since this trace's forward (an optimizer step?): transformer.wte.weight" in notes
    assert "before optimizer.step()" in notes


def test_grads_asked_of_a_forward_without_gradients_warns_once_saying_why():
    """An evaluation step decorated with torch.no_grad() traced with grads=True: no op can get a gradient."""
    torch.manual_seed(0)
    model, _, inputs = bert()
    model.train()

    @torch.no_grad()
    def evaluate(batch):
        return tl.trace(model, (), batch, grads=True)

    with pytest.warns(UserWarning, match=r"grads=True, but no tensor of this forward requires grad.*no_grad") as seen:
        log = evaluate(inputs)
    assert len([w for w in seen if "grads=True" in str(w.message)]) == 1
    first_linear = next(op for op in log if op.type == "linear")
    with pytest.raises(tl.GradientUnavailable, match="does not require grad"):
        first_linear.grad


def test_grads_of_a_forward_with_gradients_do_not_warn(recwarn):
    torch.manual_seed(0)
    model, _, inputs = bert()
    log = tl.trace(model.train(), (), inputs, grads=True)
    assert not [w for w in recwarn if "grads=True" in str(w.message)]
    log.backward(log.output.logits.sum())
    assert next(op for op in log if op.type == "linear").grad is not None


def test_a_compiled_model_traced_at_some_steps_says_the_trace_ran_it_eagerly():
    """``model = torch.compile(model)`` before the loop: the traced steps run the eager model underneath, which
    may round differently from the compiled steps around them; the trace says so instead of passing silently."""
    torch.manual_seed(0)
    model, (x,), _ = zoo()["mlp"]
    compiled = torch.compile(model.train(), backend="eager")
    with pytest.warns(UserWarning, match="torch.compile'd: the trace ran the eager model it wraps"):
        log = tl.trace(compiled, x, grads=True)
    assert any("torch.compile'd" in caveat for caveat in log.caveats)
    assert log.model is model
    uncompiled = tl.trace(model, x)
    assert not any("torch.compile'd" in caveat for caveat in uncompiled.caveats)
