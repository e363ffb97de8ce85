"""``nonfinite_origin(log, grads=True)``: where a NaN/Inf entered the backward, by forward address.

A trace taken with ``grads=True`` holds, after a backward, each op's gradient and the order in which the
gradients arrived (the backward's execution order, from the loss towards the inputs).  The first op in
that order whose gradient holds a NaN or Inf is where the backward went non-finite; the ops that read
its output in the forward (its children) and carry gradients ran the backward steps that produced it:
their own gradients were finite, so the non-finite value was born inside the backward formula of one or
more of them (``sqrt`` at 0, ``log`` of 0, a division by a zero norm...).  Which one, the trace can say
only when there is one such child: autograd sums the children's contributions into one gradient before
torchlens sees it, so with several children the report names them as candidates
(``born_in_certain`` is False) and anomaly mode names the node.  When the loss itself was non-finite,
the forward is the culprit and ``nonfinite_origin(log)`` (without ``grads``) names its origin.

A backward step torchlens did not see as an op (the internals of a custom ``autograd.Function``, a
fused kernel's backward) shows only as its outcome; the report always carries the anomaly-mode recipe
that names the exact backward node.
"""

from __future__ import annotations

import torch

from ..record.columns import Kind
from ..record.finite import nonfinite_flags
from ..record.grads import grad_capture_of
from .nonfinite import DETECT_ANOMALY_RECIPE


class GradNonfiniteReport:
    """The first op (in backward order) whose gradient is non-finite, and what produced it."""

    def __init__(self, *, origin, kind, born_in, nonfinite, examined, num_backwards, loss_nonfinite):
        self.origin = origin  # Op, or None
        self.kind = kind  # "nan", "inf", "both" or None
        self.born_in = tuple(born_in)  # labels of the ops whose backward produced it: one, or candidates
        self.nonfinite = tuple(nonfinite)  # every op with a non-finite gradient, in backward order
        self.examined = examined
        self.num_backwards = num_backwards
        self.loss_nonfinite = loss_nonfinite  # the very first gradient (nearest the loss) was non-finite
        self.recipe = DETECT_ANOMALY_RECIPE

    @property
    def found(self) -> bool:
        return self.origin is not None

    @property
    def born_in_certain(self) -> bool:
        """Whether ``born_in`` names the one op whose backward produced the first non-finite gradient.

        With several candidates, their contributions reached the gradient already summed, so the trace
        cannot tell which produced it (anomaly mode can)."""
        return len(self.born_in) == 1

    @property
    def origin_label(self):
        return self.origin.label if self.origin is not None else None

    def __bool__(self) -> bool:
        return self.found

    def __str__(self) -> str:
        lines = [f"non-finite gradient origin ({self.examined} gradients examined, in backward order, over "
                 f"{self.num_backwards} backward(s)):"]
        if not self.found:
            lines.append("  every gradient the trace received is finite")
        else:
            op = self.origin
            where = f" in {op.module}" if op.module else ""
            source = f" at {op.source}" if op.source else ""
            lines.append(f"  first non-finite gradient: d loss / d {op.label} ({op.func_name}){where}{source} holds "
                         f"{self.kind.upper()}")
            if self.loss_nonfinite:
                lines.append("  it is the first gradient of the backward: the loss side was already non-finite; "
                             "check the forward with tl.debug.nonfinite_origin(log)")
            elif self.born_in_certain:
                lines.append(f"  born in the backward of {self.born_in[0]} (its output gradient was finite)")
            elif self.born_in:
                lines.append(f"  born in the backward of one or more of {', '.join(self.born_in)} (their output "
                             "gradients were finite; autograd summed their contributions before the trace saw "
                             "them, so which one produced it the trace cannot tell: anomaly mode names the "
                             "node)")
            if len(self.nonfinite) > 1:
                shown = ", ".join(self.nonfinite[1:9]) + (" ..." if len(self.nonfinite) > 9 else "")
                lines.append(f"  then propagated to {len(self.nonfinite) - 1} op(s): {shown}")
        lines += ["", self.recipe]
        return "\n".join(lines)

    __repr__ = __str__


def grad_nonfinite_origin(log) -> GradNonfiniteReport:
    capture = grad_capture_of(log)
    if log.is_cleaned_up:
        from ..errors import TraceCleanedUp

        raise TraceCleanedUp("nonfinite_origin(grads=True) reads the gradients, which cleanup() released; call it "
                             "before cleanup()")
    if not capture.order:
        raise ValueError("nonfinite_origin(grads=True) needs gradients: run a backward through log.output first "
                         "(or log.backward(loss))")
    status = {}
    with torch.no_grad():
        for i in capture.order:
            flags = nonfinite_flags(capture.grads[i])
            if flags is not None:
                status[i] = flags
    bad = [i for i in capture.order if status.get(i, (False, False)) != (False, False)]
    if not bad:
        return GradNonfiniteReport(origin=None, kind=None, born_in=(), nonfinite=(), examined=len(status),
                                   num_backwards=log.num_backwards, loss_nonfinite=False)
    first = bad[0]
    kinds = {(True, False): "nan", (False, True): "inf", (True, True): "both"}
    children = _backward_children(log, first)
    return GradNonfiniteReport(
        origin=log.ops[first], kind=kinds[status[first]], born_in=[log.labels[c] for c in children],
        nonfinite=[log.labels[i] for i in bad], examined=len(status), num_backwards=log.num_backwards,
        loss_nonfinite=first == capture.order[0])


def _backward_children(log, index) -> list:
    """The ops that read op ``index``'s output in the forward and whose own output requires grad: only
    their backward can have sent a gradient to it (an output node runs no backward, and a child made
    without grad, such as a comparison or a detach, has no backward edge to it)."""
    return [c for c in log.op_children[index] if log.kinds[c] != Kind.OUTPUT and log.ops[c].requires_grad]
