"""Gradients in ``tl.extract(..., grads=True, loss_fn=...)``: each layer's d loss / d activation.

Per batch the model is traced with ``grads=`` set to the requested layers, the user's
``loss_fn(output, batch)`` is backpropagated through the trace, and each layer's gradient is streamed
beside its activation, under the name ``grad:<layer>``.  The backward must not leave anything behind in
the model: the parameters' ``.grad`` are put back as they were before the batch.
"""

from __future__ import annotations

import torch

from ..capture.grads import NOTHING_REQUIRES_GRAD
from ..capture.restore import backward_leaves, grads_set_aside
from ..checks import check_flag, check_grad_possible, check_takes
from ..errors import GradientUnavailable

GRAD_PREFIX = "grad:"


def grad_columns(layers: list) -> list:
    """The extraction's column names: the layers, then ``grad:<layer>`` for each."""
    return list(layers) + [GRAD_PREFIX + name for name in layers]


def check_request(grads: bool, loss_fn, stop_after=None) -> None:
    """Refuse, before any batch runs, a gradient request no batch could meet: no loss function, or a forward
    stopped early (``stop_after``), which never produces the output the loss is computed from.  ``grads="no"``
    is true to Python, and a ``loss_fn`` without ``grads=True`` would be ignored."""
    check_flag(grads, "grads", "give True to also write each layer's gradient (with loss_fn=), False not to",
               who="tl.extract")
    if not grads and loss_fn is not None:
        raise ValueError("tl.extract: loss_fn= is read only with grads=True (it gives the loss whose backward makes "
                         "each layer's gradient); pass grads=True to extract gradients too, or drop loss_fn=")
    if grads and not callable(loss_fn):
        raise ValueError("tl.extract(..., grads=True) needs loss_fn=f(output, batch) -> scalar loss, whose backward "
                         "gives each layer's gradient")
    if grads:
        check_takes(loss_fn, 2, "tl.extract: loss_fn is called as loss_fn(output, batch), with the model's output and "
                    "the batch", "write it as lambda output, batch: ... (ignore batch when not needed)")
    if grads and stop_after is not None:
        raise ValueError(f"tl.extract(..., grads=True) needs the model's output for loss_fn, but stop_after="
                         f"{stop_after!r} stops each forward before it; extract the gradients without stop_after")
    if grads:
        check_grad_possible("tl.extract(..., grads=True)")


def backward_through(log, loss_fn, batch, position, module=None) -> None:
    """Run ``loss_fn(log.output, batch)``'s backward, leaving the parameter ``.grad`` of ``module`` (the model
    the traced callable runs), of every parameter the forward read, and of every other leaf the backward reaches
    (an input that requires grad, a learnt prompt or steering vector the forward read) untouched."""
    loss = loss_fn(log.output, batch)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        if not any(op.requires_grad for op in log.ops):  # no loss could: not loss_fn's doing (generate() is no_grad)
            raise ValueError(f"batch {position}: {NOTHING_REQUIRES_GRAD}")
        raise ValueError(f"batch {position}: loss_fn returned {type(loss).__name__}"
                         f"{' that does not require grad' if isinstance(loss, torch.Tensor) else ''}; it must "
                         "return a tensor computed from the model's output")
    if loss.numel() != 1:  # autograd's own refusal ("grad can be implicitly created only for scalar outputs")
        raise ValueError(f"batch {position}: loss_fn returned a tensor of shape {tuple(loss.shape)}; it must return "
                         "one number to backpropagate from (reduce it: .sum() or .mean())")
    with grads_set_aside(backward_leaves(log, module, loss)):
        log.backward(loss)


def layer_grad(op, name, position):
    try:
        g = op.grad
    except GradientUnavailable as exc:  # an integer layer (indices, a mask) or an input: none in any batch
        raise GradientUnavailable(f"batch {position}: grads=True writes every layer's gradient, and {name} "
                                  f"({op.label}) has none: {exc}; extract it in a tl.extract call without "
                                  "grads=True") from None
    if g is None:
        raise RuntimeError(f"batch {position}: no gradient reached {name} ({op.label}): the loss does not depend on it")
    return g
