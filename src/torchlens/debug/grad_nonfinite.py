"""``nonfinite_origin(log, grads=True)``: where a NaN/Inf entered the backward, by forward address.

A trace taken with ``grads=True`` holds, after a backward, each op's gradient and the order in which the
gradients arrived (the backward's execution order, from the loss towards the inputs).  The first op in
that order whose gradient holds a NaN or Inf is where the backward went non-finite; the ops that read
its output in the forward (its children) and carry gradients ran the backward steps that produced it:
their own gradients were finite, so the non-finite value was born inside the backward formula of one or
more of them (``sqrt`` at 0, ``log`` of 0, a division by a zero norm...).  Which one, the trace can say
only when there is one such child: autograd sums the children's contributions into one gradient before
torchlens sees it, so with several children the report names them as candidates
(``born_in_certain`` is False); anomaly mode names the first node that returns NaN (it does not check
for Inf).  When the loss itself was non-finite,
the forward is the culprit and ``nonfinite_origin(log)`` (without ``grads``) names its origin.

Parameters are not ops, so a gradient that goes non-finite only on its way into a parameter (``sqrt`` of
a parameter at 0) shows on no op: the parameters' own ``.grad`` are examined too, and such a parameter is
reported with the ops that read it, in whose backward it was born.

A custom ``autograd.Function`` runs its forward under ``no_grad``, and its backward sends its output's gradient
straight to its inputs: its output is a reader of the ops its inner ops read, and the report names the Function
whose backward that is.  A backward step torchlens did not see as an op (what a Function's backward computes, a
fused kernel's backward) shows only as its outcome; the report always carries the anomaly-mode recipe, which
names the first backward node that returns NaN (anomaly mode does not check for Inf).
"""

from __future__ import annotations

import torch

from ..record.columns import Kind
from ..record.finite import nonfinite_flags
from ..errors import GradientUnavailable, counted, listed
from ..record.grads import FROM_BATCHED_BACKWARD, grad_capture_of, gradient_holder, output_nodes, unreadable
from ..tree import without_values
from .nonfinite import DETECT_ANOMALY_RECIPE


class GradNonfiniteReport:
    """The first op (in backward order) whose gradient is non-finite, and what produced it."""

    def __init__(self, *, origin, kind, born_in, nonfinite, examined, num_backwards, loss_nonfinite,
                 parameters=(), parameters_checked=True, born_in_unseen=(), returned=False, functions=None,
                 unreached=()):
        self.origin = origin  # Op, or None
        self.kind = kind  # "nan", "inf", "both" or None
        self.born_in = tuple(born_in)  # labels of the ops whose backward produced it: one, or candidates
        # those of them whose own gradient the trace did not receive (left out by grads=[...], or replaced by a
        # write into a view): not known to be finite, so the NaN may have been born after them
        self.born_in_unseen = tuple(born_in_unseen)
        # the forward returned the origin's tensor: the loss may read it directly, so its gradient also came
        # straight from the loss side, which the trace does not see apart from what the readers in born_in sent
        self.returned = returned
        # those of born_in whose backward is a custom autograd.Function's: label -> the Function's name
        self.functions = dict(functions or {})
        # ops that received no gradient though an op that read them did: the backward stopped before them (it
        # raised, as anomaly mode's does at a NaN) or sent them none; their gradients were not examined
        self.unreached = tuple(unreached)
        self.nonfinite = tuple(nonfinite)  # every op with a non-finite gradient, in backward order
        self.examined = examined
        self.num_backwards = num_backwards
        self.loss_nonfinite = loss_nonfinite  # the very first gradient (nearest the loss) was non-finite
        self.parameters = tuple(parameters)  # addresses of parameters whose .grad holds NaN/Inf
        self.parameters_checked = parameters_checked  # every parameter's .grad could be read
        self.recipe = DETECT_ANOMALY_RECIPE

    @property
    def found(self) -> bool:
        """A non-finite gradient was found: on an op (``origin``), or only on parameters (``parameters``)."""
        return self.origin is not None or bool(self.parameters)

    @property
    def born_in_certain(self) -> bool:
        """Whether ``born_in`` names the one op whose backward produced the first non-finite gradient.

        With several candidates, their contributions reached the gradient already summed, so the trace
        cannot tell which produced it (anomaly mode can).  Nor can it when that op's own gradient never reached
        the trace: it is not known to be finite, and the NaN may come from the backward of ops after it.  Nor
        when the forward returned the origin's tensor: the loss's own gradient of it may hold the NaN."""
        return len(self.born_in) == 1 and not self.born_in_unseen and not self.returned

    @property
    def origin_label(self):
        """The label of the op whose gradient went non-finite first, or None where no op's did."""
        return self.origin.label if self.origin is not None else None

    def __bool__(self) -> bool:
        return self.found

    def __str__(self) -> str:
        lines = [f"non-finite gradient origin ({self.examined} gradients examined, in backward order, over "
                 f"{self.num_backwards} backward(s)):"]
        if not self.found:
            lines.append("  every gradient the trace received is finite, and so is every parameter's .grad"
                         + ("" if self.parameters_checked
                            else " it could read (not those a loaded trace left unsaved, or a model cast since)")
                         + (" the backward wrote" if self.unreached else ""))
        elif self.origin is None:
            lines += self._parameter_lines()
        else:
            op = self.origin
            where = f" in {op.module}" if op.module else ""
            source = f" at {op.source}" if op.source else ""
            lines.append(f"  first non-finite gradient: d loss / d {op.label} ({op.func_name}){where}{source} holds "
                         f"{self.kind.upper()}")
            if self.loss_nonfinite:
                lines.append("  no op of the trace read it: its gradient came from the loss side, already "
                             "non-finite; check the forward with tl.debug.nonfinite_origin(log), then the loss")
            elif self.returned:
                lines.append(f"  born in the loss's own gradient of it (the forward returned it), or in the backward "
                             f"of {' or '.join(self.born_in)}: autograd summed them before the trace saw them, so "
                             "which one the trace cannot tell; anomaly mode names the first node that returns NaN")
            elif self.born_in_certain:
                lines.append(f"  born in the backward of {self.born_in[0]} (its output gradient was finite)")
            elif self.born_in_unseen:
                lines.append(self._unseen_line())
            elif self.born_in:
                lines.append(f"  born in the backward of one or more of {', '.join(self.born_in)} (their output "
                             "gradients were finite; autograd summed their contributions before the trace saw "
                             "them, so which one produced it the trace cannot tell; anomaly mode names the "
                             "first node that returns NaN)")
            lines += self._function_lines()
            if len(self.nonfinite) > 1:
                shown = ", ".join(self.nonfinite[1:9]) + (" ..." if len(self.nonfinite) > 9 else "")
                lines.append(f"  then propagated to {len(self.nonfinite) - 1} op(s): {shown}")
        if self.unreached:
            them = "it" if len(self.unreached) == 1 else "them"
            lines.append(f"  {counted(len(self.unreached), 'op')} received no gradient though ops that read {them} "
                         f"did, so not examined: {listed(self.unreached, 5)}; the backward stopped before {them} "
                         f"(it raised: anomaly mode raises at a node that returns NaN) or sent {them} none (inputs=, a "
                         "Function's backward returning None)")
        if self.kind == "inf":
            lines.append("  only Inf, no NaN: anomaly mode checks for NaN alone, so it raises nothing here until "
                         "an Inf turns into a NaN")
        if self.origin is not None and self.parameters:
            lines.append(f"  parameters with a non-finite .grad: {listed(self.parameters, 8)}")
        lines += ["", self.recipe]
        return "\n".join(lines)

    __repr__ = __str__

    def _function_lines(self) -> list:
        """Which of ``born_in`` ran a custom Function's backward: that code, not its forward's ops, made it."""
        return [f"  {label} is the output of custom autograd.Function {name}: its backward is {name}.backward, "
                "which ran in place of the backward of the ops its forward ran; anomaly mode names it when it "
                "returns NaN" for label, name in self.functions.items()]

    def _unseen_line(self) -> str:
        return (f"  born in the backward of {' or '.join(self.born_in)}, or of ops after "
                f"{'it' if len(self.born_in) == 1 else 'them'}: the trace did not receive the gradient of "
                f"{listed(self.born_in_unseen, 5)} (left out by grads=[...], or replaced by a write into a view), "
                "so it cannot tell where; anomaly mode names the first node that returns NaN")

    def _parameter_lines(self) -> list:
        """Every op gradient is finite; the non-finite values are in parameters' ``.grad`` only."""
        lines = [f"  every op gradient is finite, but the .grad of {len(self.parameters)} parameter(s) holds "
                 f"{self.kind.upper()}: {listed(self.parameters, 8)}"]
        if self.born_in_certain:
            lines.append(f"  born in the backward of {self.born_in[0]}, the op that read it (its output gradient "
                         "was finite)")
        elif self.born_in_unseen:
            lines.append(self._unseen_line())
        elif self.born_in:
            lines.append(f"  born in the backward of one or more of {', '.join(self.born_in)}, the ops that read "
                         "them (their output gradients were finite)")
        else:
            lines.append("  the trace watched only some ops' gradients (grads=[...]), so where it was born is "
                         "not known from the trace; anomaly mode names the first node that returns NaN")
        lines += self._function_lines()
        lines.append("  (a parameter's .grad accumulates over every backward since it was last cleared)")
        return lines


def grad_nonfinite_origin(log) -> GradNonfiniteReport:
    capture = grad_capture_of(log)
    if log.is_cleaned_up:
        from ..errors import TraceCleanedUp

        raise TraceCleanedUp("nonfinite_origin(grads=True) reads the gradients, which cleanup() released; call it "
                             "before cleanup()")
    if not capture.order:
        raise ValueError("nonfinite_origin(grads=True) needs gradients: run a backward through log.output first "
                         "(or log.backward(loss))")
    _require_grad_tensors(log, capture)
    status = {}
    with torch.no_grad():
        for i in capture.order:
            flags = nonfinite_flags(capture.grads[i])
            if flags is not None:
                status[i] = flags
    if not status and capture.grads and all(without_values(capture.grads[i]) for i in capture.order):
        raise ValueError("nonfinite_origin(grads=True) has nothing to examine: the backward ran on the meta "
                         "device (or under FakeTensorMode), whose gradients have shapes but no values; trace the "
                         "model on a real device")
    bad = [i for i in capture.order if status.get(i, (False, False)) != (False, False)]
    found = _nonfinite_parameter_grads(log)
    params = [entry for entry in found if entry[1] is not None]
    checked = len(params) == len(found)
    unreached = [log.labels[i] for i in _unreached(log, capture)]
    if not bad:
        return _parameter_report(log, params, status, selected=capture.policy is not None, checked=checked,
                                 unreached=unreached)
    first = _origin(log, bad)
    children = _backward_children(log, first)
    return GradNonfiniteReport(
        origin=log.ops[first], kind=_KINDS[status[first]], born_in=[log.labels[c] for c in children],
        nonfinite=[log.labels[i] for i in (first, *(i for i in bad if i != first))], examined=len(status),
        num_backwards=log.num_backwards,
        # No traced op can have sent it (under grads=[...] too: no op read it in the forward): the loss's own.
        loss_nonfinite=not children,
        parameters=[address for address, _, _ in params], parameters_checked=checked,
        born_in_unseen=[log.labels[c] for c in children if c not in status], returned=first in _returned(log),
        functions=_functions(log, children), unreached=unreached)


_KINDS = {(True, False): "nan", (False, True): "inf", (True, True): "both"}


def _origin(log, bad: list) -> int:
    """The first op of ``bad`` (non-finite gradients, in arrival order) none of whose readers' gradients is
    non-finite.  Within one backward that is ``bad[0]``: a reader's gradient arrives before its input's.  Over
    several backwards the order is that of each gradient's first arrival: an op an earlier backward reached (an
    auxiliary loss on a hidden state) comes first, and a NaN a later backward carried down to it from its readers
    would otherwise be named as born there."""
    nonfinite = set(bad)
    return next(i for i in bad if nonfinite.isdisjoint(_backward_children(log, i)))


def _require_grad_tensors(log, capture) -> None:
    """A loaded trace can hold a gradient's statistics without the gradient itself (saved with
    activations=False, or a gradient no file format encodes); which op went non-finite first needs them all."""
    batched = next((i for i in capture.order if i in capture.grads and unreadable(capture.grads[i])), None)
    if batched is not None:
        raise GradientUnavailable(f"nonfinite_origin(grads=True) reads every gradient, and that of "
                                  f"{log.labels[batched]} cannot be read: {FROM_BATCHED_BACKWARD}")
    missing = [i for i in capture.order if i not in capture.grads]
    if missing:
        first = missing[0]
        why = log._unsaved_grads.get(first, "its gradient is not in the trace")
        raise GradientUnavailable(f"nonfinite_origin(grads=True) reads every gradient, and {len(missing)} of "
                                  f"{len(capture.order)} are not held by the trace loaded from {log.loaded_from} "
                                  f"({log.labels[first]}: {why}); save the trace with its tensors, or call it "
                                  "on the live trace")


def _nonfinite_parameter_grads(log) -> list:
    """``[(address, (has_nan, has_inf), user op indices)]`` for parameters whose ``.grad`` holds NaN/Inf;
    flags None for a parameter whose ``.grad`` could not be read."""
    if not log._params_listed:
        return _nonfinite_saved_param_grads(log)
    found = []
    for param in log.params:
        try:
            grad = param.grad
        except GradientUnavailable:  # a loaded trace saved without them, or a model cast since the trace
            found.append((param.address, None, []))
            continue
        flags = nonfinite_flags(grad) if grad is not None else None
        if flags is not None and flags != (False, False):
            found.append((param.address, flags, [op.index for op in param.ops]))
    return found


def _nonfinite_saved_param_grads(log) -> list:
    """``_nonfinite_parameter_grads`` of a trace loaded from a file that predates the parameter table, which has no
    ``Param`` records: each ``.grad`` the file saved, by address; without any, each parameter an op used, unread."""
    users = {}
    for i, addresses in sorted(log.param_addresses.items()):
        for address in addresses:
            users.setdefault(address, []).append(i)
    if log._param_grads is None:
        return [(address, None, []) for address in users]
    found = []
    for address, grad in log._param_grads.items():
        flags = nonfinite_flags(grad)
        if flags != (False, False):
            found.append((address, flags, users.get(address, [])))
    return found


def _parameter_report(log, params, status, selected, checked, unreached=()) -> GradNonfiniteReport:
    """No op gradient is non-finite: the report names the parameters whose ``.grad`` is, if any, and the ops
    that read them (whose backward wrote their gradient).  With ``grads=[...]`` (``selected``) most ops'
    gradients were not watched, so a finite watched gradient says nothing of the others: no op is named."""
    flags = (any(f[0] for _, f, _ in params), any(f[1] for _, f, _ in params))
    readers = [] if selected else sorted({i for _, _, indices in params for i in indices})
    users = _senders(log, readers) or readers  # (read under no_grad alone: named as before, gradient unseen)
    return GradNonfiniteReport(
        origin=None, kind=_KINDS.get(flags), born_in=[log.labels[i] for i in users], nonfinite=(),
        examined=len(status), num_backwards=log.num_backwards, loss_nonfinite=False,
        parameters=[address for address, _, _ in params], parameters_checked=checked,
        born_in_unseen=[log.labels[i] for i in users if i not in status], functions=_functions(log, users),
        unreached=unreached)


def _unreached(log, capture) -> list:
    """The watched ops that received no gradient though one of their readers in the backward did.  A backward
    that finishes runs every node it reached, so each sends its inputs their share: these were left behind by one
    that raised part way (anomaly mode's, at a node that returns NaN), or sent none (``inputs=``, a Function's
    backward returning None for them)."""
    received = set(capture.grads)
    return [i for i in sorted(capture.selected) if i not in received
            and any(c in received for c in _backward_children(log, i))]


def _returned(log) -> set:
    """The ops whose tensors the forward returned (those its output nodes show)."""
    return {gradient_holder(log, i) for i in output_nodes(log)}


def _backward_children(log, index) -> list:
    """The ops that read op ``index``'s output in the forward and whose own output requires grad: only
    their backward can have sent a gradient to it (an output node runs no backward, and a child made
    without grad, such as a comparison or a detach, has no backward edge to it).  A custom Function's output
    read it through the Function's inner ops, which ran under ``no_grad``: its backward sent it one too."""
    return _senders(log, [c for c in log.op_children[index] if log.kinds[c] != Kind.OUTPUT])


def _senders(log, readers) -> list:
    """Of the ops ``readers``, those whose backward sends a gradient back to what they read: the ones made with
    grad, and, for those made without (or with no node: a view of a parameter taken under ``no_grad``, which needs
    grad yet has no backward), the outputs of the custom Functions whose forward ran them."""
    with_grad = [c for c in readers if _has_backward(log, c)]
    inner = [c for c in readers if _made_without_grad(log, c)]
    return with_grad + [c for c in _function_outputs_after(log, inner) if c not in with_grad]


def _functions(log, ops) -> dict:
    """``{label: Function name}`` for those of ``ops`` whose backward is a custom Function's."""
    named = ((c, _function_of(log, c)) for c in ops)
    return {log.labels[c]: name for c, name in named if name is not None}


def _function_outputs_after(log, start) -> list:
    """The outputs of custom autograd Functions that ops ``start`` (made without grad) fed, through ops made
    without grad: a Function's forward runs under ``no_grad``, and only its output gets the Function's node."""
    found, stack, seen = [], list(start), set(start)
    while stack:
        for c in log.op_children[stack.pop()]:
            if c in seen or log.kinds[c] == Kind.OUTPUT:
                continue
            seen.add(c)
            if _function_of(log, c) is not None:
                found.append(c)
            elif _made_without_grad(log, c):
                stack.append(c)
    return sorted(found)


def _has_backward(log, index) -> bool:
    op = log.ops[index]
    return op.requires_grad and op.grad_fn is not None


def _made_without_grad(log, index) -> bool:
    """Whether op ``index`` computed a float value with no backward, as a Function's inner ops do under ``no_grad``;
    not a comparison or an index (``h > 0``, ``argmax``), which has none in any mode: a Function that reads such a
    mask sends it no gradient, nor the tensor it was taken from."""
    dtype = log.ops[index].dtype
    return not _has_backward(log, index) and isinstance(dtype, torch.dtype) and (dtype.is_floating_point
                                                                                  or dtype.is_complex)


def _function_of(log, index):
    """The name of the custom autograd Function whose backward node op ``index``'s output has, or None.  A loaded
    trace keeps only the node's name: torch names a Function's node ``<Function>Backward``, and its own nodes
    otherwise (``AddmmBackward0``), but for a few C++ ones, which it holds in ``torch._C._functions``."""
    node = log._meta[index].grad_fn_class
    if isinstance(node, type):
        is_function = issubclass(node, torch.autograd.function.BackwardCFunction)
    else:
        name = getattr(node, "__name__", "")
        is_function = name.endswith("Backward") and not hasattr(torch._C._functions, name)
    return node.__name__.removesuffix("Backward") if is_function else None
