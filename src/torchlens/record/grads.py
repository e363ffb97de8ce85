"""Reading gradients and backward memory from a trace captured with ``grads=...``.

``capture/grads.py`` fills a ``GradCapture`` during the forward (hooks) and the backward (gradients);
``capture/packing.py`` a ``PackLog`` of what autograd saved, with ``saved_for_backward=True``.  This
module answers the record views: ``Op.grad``, ``Layer.grads``, ``ModuleCall.grad``, ``Param.grad``, the
gradient statistics columns, ``Trace.backward`` and the saved-for-backward totals.  Everything here is
derived on demand; nothing runs during the forward.
"""

from __future__ import annotations

import math
import re

import torch

from .columns import Kind, is_first_output
from .dropped import MADE_IN_TRANSFORM
from .layouts import dense_values, magnitudes
from .modules import no_output_reason
from ..tree import made_in_transform, without_values
from ..errors import GradientUnavailable, TraceCleanedUp, add_note, first_few, warn_user

GRAD_COLUMNS = ("grad_norm", "grad_min", "grad_max", "grad_nonfinite")
_NO_GRADS = ("this trace was captured without gradients: trace with tl.trace(model, x, grads=True) and run a "
             "backward through log.output (or call log.backward(loss))")
_legacy_batched = torch._C._functorch.is_legacy_batchedtensor
FROM_BATCHED_BACKWARD = (
    "a backward run under vmap or inside a torch.func transform reached it (torch.autograd.grad(..., "
    "is_grads_batched=True), torch.autograd.functional.jacobian(..., vectorize=True), torch.func.jacrev or "
    "torch.func.grad around the trace): autograd hands tensor hooks that backward's batched or wrapped gradient, "
    "which cannot be read once the backward has returned (retain_grad() keeps the same unreadable tensor), and "
    "later backwards add to it; use the gradients that call returns, or trace again for a backward per output")


def unreadable(grad) -> bool:
    """Whether a gradient kept by the trace is a batched or transformed backward's, which no reader can use (see
    ``FROM_BATCHED_BACKWARD``): autograd's own batching (``is_grads_batched``), or any torch.func transform's
    wrapper (vmap's batched tensor, ``torch.func.grad``'s grad-tracking one)."""
    return _legacy_batched(grad) or made_in_transform(grad)


def grad_capture_of(trace):
    """The trace's gradient capture; a trace taken without ``grads=`` raises ``GradientUnavailable`` saying
    how to get one."""
    capture = trace._gradcap
    if capture is None:
        raise GradientUnavailable(_NO_GRADS)
    return capture


def gradient_holder(trace, index: int) -> int:
    """An output node shows its producer's tensor, and so its producer's gradient; one showing a tensor of
    its own (see ``outputs_with_own_tensor``) has its own gradient (capture/grads.py ``_watch_own_outputs``)."""
    if trace._kind[index] == Kind.OUTPUT:
        producer = trace.output_producer(index)
        return producer if producer >= 0 and index not in trace._own_outputs else index
    return index


def grad_of(trace, index: int):
    """d loss / d (op ``index``'s output), accumulated over every backward seen; None before one."""
    capture = grad_capture_of(trace)
    label = trace._labels[index]
    if trace._cleaned:
        raise TraceCleanedUp(f"{label}: the trace was cleaned up; its gradients were released (their norms, "
                             "min, max and non-finite counts stay in to_pandas())")
    index = gradient_holder(trace, index)
    if not trace._meta[index].requires_grad:
        raise GradientUnavailable(f"{label}: {_why_no_grad(trace, index)}")
    grad = capture.grads.get(index)
    if grad is not None and unreadable(grad):
        raise GradientUnavailable(f"{label}: {FROM_BATCHED_BACKWARD}")
    if grad is None and index in trace._unsaved_grads:
        raise GradientUnavailable(f"{label}: {trace._unsaved_grads[index]}")
    if grad is None and _made_in_transform(trace, index):
        raise GradientUnavailable(f"{label}: {_NOT_REACHED_IN_TRANSFORM}")
    if grad is None and index in capture.incomplete:
        raise GradientUnavailable(
            f"{label}: its gradient hook was removed by torch before a later backward (torch resets a leaf "
            "tensor's hooks when a hook is first registered on it after the trace returned), so its gradient "
            "would miss that backward's share; register hooks on the inputs before tracing, or trace with "
            "TORCHLENS_ACCEL=0")
    return grad


_NOT_REACHED_IN_TRANSFORM = (
    "made inside a torch.func transform (grad, vjp, jacrev, ...): its hook sits on the transform's wrapped "
    "tensor, which no backward outside the transform reaches (what the transform returns is a tensor of its "
    "own, which later ops read as of unknown origin); read the gradients of the ops outside the transform")


def _made_in_transform(trace, index: int) -> bool:
    """Whether capture found op ``index``'s saved output to be a torch.func transform's wrapped tensor (known
    only where the activation was saved)."""
    return trace._dropped.get(index) == MADE_IN_TRANSFORM


def output_nodes(trace) -> list:
    """The indices of the trace's output nodes, in the order of the tensors in its output."""
    return [i for i, kind in enumerate(trace._kind) if kind == Kind.OUTPUT]


def outputs_with_own_tensor(trace) -> list:
    """The output nodes that show a tensor of their own: one no op of the trace made (a parameter returned
    as it is), or one last written through a view, whose producer made that view (``Trace._own_outputs``)."""
    own = trace._own_outputs
    return [i for i in output_nodes(trace) if trace.output_producer(i) < 0 or i in own]


def _why_no_grad(trace, index: int) -> str:
    """Why op ``index``'s output needs no gradient: an intervention's value, or how it was made."""
    applied = trace._interventions.get(index)
    if applied is not None:
        return (f"an intervention ({applied.action!r}) replaced its output with a tensor that does not require "
                "grad, so autograd computes no gradient for it")
    if _made_in_transform(trace, index):
        return ("it ran inside a torch.func transform (vmap, ...) on the transform's wrapped tensors, which do not "
                "require grad as autograd outside the transform sees them; the ops after the transform carry "
                "the gradient")
    dtype = trace._meta[index].dtype
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        return f"its output is {str(dtype).replace('torch.', '')}, a dtype autograd computes no gradient for"
    if trace._kind[index] == Kind.INPUT:
        return ("it is an input that does not require grad, so autograd computes no gradient for it: pass it "
                "with requires_grad=True (x.requires_grad_()) to have its gradient")
    return ("its output does not require grad (made under torch.no_grad() or torch.inference_mode(), inside "
            "torch.vmap, or from tensors that do not require grad), so autograd computes no gradient for it")


def has_grad(trace, index: int) -> bool:
    capture = trace._gradcap
    if capture is None:
        return False
    index = gradient_holder(trace, index)
    if not trace._cleaned and index in capture.grads:
        return True
    # A trace cleaned up holds no gradient tensor, and a loaded one none for a gradient no file could hold
    # (complex128), nor any when saved with activations=False; the statistics kept of every gradient that arrived
    # still name them.
    return (trace._cleaned or trace.loaded_from is not None) and index in (trace._grad_stats or ())


def module_call_grad(call):
    """The gradient of a module call's output: one tensor, or a tuple for several outputs.  A call no output of
    which can have a gradient (run under torch.no_grad(), returning integers, ablated), or that has no output op,
    raises saying why, rather than giving a None that reads as "no backward reached it"; in a tuple, an output
    that cannot have one is None beside the others.  The tuple keeps the call's return order: an output no op
    holds (``-1``: a tensor written through a view after the op that made it, a buffer returned as it is) is
    None in its place, so that the gradients after it are not read as those of the outputs before them."""
    trace = call._trace
    slots = call._output_nodes
    outputs = [i for i in slots if i >= 0]
    if not outputs:  # no hook holds what it returned (a TorchScript child's output): None would read as unreached
        raise GradientUnavailable(f"{call.label} {no_output_reason(call)}, so no gradient of its output was kept: "
                                  "read the gradient of an op inside the call or one reading its output")
    if not any(trace._meta[gradient_holder(trace, i)].requires_grad for i in outputs):
        unheld = [str(k + 1) for k, i in enumerate(slots) if i < 0]
        try:
            return grad_of(trace, outputs[0])  # raises, saying why
        except GradientUnavailable as error:
            if not unheld:
                raise
            # The outputs no op holds may have gradients (a parameter returned as it is): the call's are not all gone.
            raise GradientUnavailable(f"{error}; {call.label}'s output {' and '.join(unheld)} of {len(slots)} is a "
                                      "tensor no op holds (a parameter or buffer returned as it is, or a tensor "
                                      "written through a view after the op that made it): read that tensor's .grad "
                                      "itself") from None
    if len(slots) == 1:
        return grad_of(trace, outputs[0])
    return tuple(grad_of(trace, i) if i >= 0 and trace._meta[gradient_holder(trace, i)].requires_grad else None
                 for i in slots)


def passes_grads(trace, indices) -> list:
    """The gradients of a layer's passes ``indices``.  A pass that can have no gradient (one run under
    torch.no_grad(), the warm-up iterations of a fixed-point solver) is None beside passes that can, as in a
    module call's tuple, so that one such pass does not hide the others' gradients; a layer none of whose
    passes can have one raises as its first op does, saying why."""
    if not any(trace._meta[i].requires_grad for i in indices):
        return [grad_of(trace, i) for i in indices]  # raises at the first, saying why
    return [grad_of(trace, i) if trace._meta[i].requires_grad else None for i in indices]


def param_grad(trace, address: str, place: int = -1, layout: tuple | None = None):
    """The parameter's own ``.grad`` (what autograd accumulated into it), found by address; ``place``: where it
    is likely to be in the model's parameter list (a ``Param`` record's index, since the records are made in
    that order), so that reading every parameter's gradient is not a search of the list per parameter.
    ``layout``: the parameter's ``(shape, dtype)`` as the forward read it; a ``.grad`` of another is refused."""
    if trace.loaded_from is not None:
        return _saved_param_grad(trace, address)
    params = trace._model_params
    if params is None:
        raise TraceCleanedUp(f"{address}: the trace no longer holds the model, so its parameters' .grad "
                             "cannot be read")
    if 0 <= place < len(params) and params[place][0] == address:
        grad = params[place][1].grad
    else:
        grad = next((p.grad for name, p in params if name == address), None)
    why = grad_of_another_layout(layout, grad)
    if why is not None:
        raise GradientUnavailable(f"{address}: its .grad is no gradient of the traced parameter ({why}); read "
                                  "it from the model itself")
    return grad


def grad_of_another_layout(layout: tuple | None, grad) -> str | None:
    """Why a parameter's ``.grad`` is not a gradient of the parameter the forward read, when its shape or dtype
    is not that parameter's (the model cast, ``model.half()``, or resized since, which casts or replaces the
    ``.grad`` too).  None when it is, when there is none, or when ``layout`` is None (no layout known)."""
    if grad is None or layout is None or (tuple(grad.shape), grad.dtype) == (tuple(layout[0]), layout[1]):
        return None
    shape, dtype = layout
    return (f"the parameter was cast or resized since the trace: the forward read a {dtype} tensor of shape "
            f"{tuple(shape)}, its .grad is now a {grad.dtype} one of shape {tuple(grad.shape)}")


def _saved_param_grad(trace, address: str):
    """A loaded trace: the parameter's ``.grad`` as it was when the trace was saved (None if it had none)."""
    saved = trace._param_grads
    if saved is None:
        why = trace._param_grads_missing or (
            "it was traced without grads= (parameters' gradients are saved with a trace taken with "
            "tl.trace(model, x, grads=True))")
        raise GradientUnavailable(f"{address}: the trace loaded from {trace.loaded_from} holds no parameter "
                                  f"gradients: {why}")
    if address in trace._unsaved_grads:
        raise GradientUnavailable(f"{address}: {trace._unsaved_grads[address]}")
    return saved.get(address)


def backward(trace, loss, gradient=None, retain_graph=None, create_graph=False, inputs=None) -> None:
    """``torch.autograd.backward`` through ``loss``; the trace's hooks receive every gradient."""
    if trace._gradcap is None or trace.loaded_from is not None or trace._cleaned:
        _refuse_backward(trace)
    if type(loss) is not torch.Tensor and not isinstance(loss, torch.Tensor):  # the common call: one exact type check
        _refuse_loss(loss)
    if retain_graph is not None or create_graph is not False:  # the common call passes neither
        _check_backward_flags(retain_graph, create_graph)
    backwards = trace._gradcap.backwards
    # Positional, as ``Tensor.backward`` passes them: this wrapper is a fixed cost of every traced backward.
    try:
        torch.autograd.backward(loss, gradient, retain_graph, create_graph, inputs=inputs)
    except RuntimeError as exc:
        if "modified by an inplace operation" in str(exc):  # autograd names only a shape and a version
            _note_changed_params(trace, exc)
            _note_written_sites(trace, exc)
            if not getattr(exc, "__notes__", None):  # no write of an intervention or an optimizer: the forward's own
                note_model_writes(trace, exc)
        elif "does not require grad" in str(exc):  # autograd names no cause
            _note_cut_sites(trace, exc)
        raise
    if trace._gradcap.backwards == backwards:
        _warn_unreached()


def _check_backward_flags(retain_graph, create_graph) -> None:
    """torch reads a flag that is no bool as an int ("'str' object cannot be interpreted as an integer"), and
    a string such as "no" would be true to Python."""
    from ..checks import check_flag

    if retain_graph is not None:
        check_flag(retain_graph, "retain_graph", "give True to keep the graph for another backward, False or None "
                   "(the default) to free it", who="log.backward")
    check_flag(create_graph, "create_graph", "give True to record the backward itself for higher-order gradients, "
               "False not to", who="log.backward")


def _refuse_loss(loss) -> None:
    """torch's own refusal of a loss that is no tensor is an AssertionError ("Expected output to be a
    torch.Tensor"); a sequence of tensors is what torch.autograd.backward also takes."""
    if isinstance(loss, (list, tuple)) and loss and all(isinstance(t, torch.Tensor) for t in loss):
        return
    raise TypeError(f"log.backward(loss): loss is the tensor to backpropagate from (log.backward(log.output.sum()), "
                    f"or a list of tensors), got {type(loss).__name__}")


def _note_changed_params(trace, exc: RuntimeError) -> None:
    """Autograd's refusal of a tensor written since the forward names only a shape and a version: when the
    trace's parameters were written since (an optimizer step before this backward), say which, and what to do."""
    from .params import changed_since_trace

    changed = changed_since_trace(trace)
    if changed:
        shown = first_few(changed, 4)
        add_note(exc, f"torchlens: parameters changed since this trace's forward (an optimizer step?): {shown}; "
                     "autograd needs the values the forward read, so run log.backward(loss) before "
                     "optimizer.step(), or trace again after it")


def _note_written_sites(trace, exc: RuntimeError) -> None:
    """An intervention at an in-place op writes its new value into the tensor that op returned (the model holds
    it): where the op's backward needs the value it made (``relu_`` keeps its result), autograd refuses the
    backward, naming a write the model never made.  Say which sites wrote, and where to intervene instead."""
    written = [op for op in (trace.ops[i] for i in sorted(trace._interventions)) if op.is_inplace and op.requires_grad]
    if written:
        before = ", ".join(dict.fromkeys(p for op in written for p in op.parents[:1]))
        add_note(exc, f"torchlens: the intervention at {', '.join(op.label for op in written)}, an in-place op, wrote "
                     "its new value into the tensor that op returned, which its backward may need as it was made; "
                     "to edit that value with gradients, intervene at a module whose output it is (a module site's "
                     f"new value is a new tensor), or at the op before it ({before or 'its input'})")


_WRITTEN_SHAPE = re.compile(r"\[torch\.\w+ \[([0-9, ]*)\]\]")  # autograd's "[torch.FloatTensor [3, 4]]"


def note_model_writes(trace, exc: RuntimeError) -> None:
    """Autograd names only the shape and version of a value the forward overwrote after saving it; the trace knows
    the forward's own in-place writes (``h.mul_(3)`` after ``sigmoid``, whose backward needs its output): name
    those of that shape, and the op whose output each wrote.  Any other error is left as it is."""
    if "modified by an inplace operation" not in str(exc):
        return
    found = _WRITTEN_SHAPE.search(str(exc))
    shape = tuple(int(n) for n in found.group(1).split(",") if n.strip()) if found else None
    written = [op for op in trace.ops if op.is_inplace and op.requires_grad and (shape is None or op.shape == shape)]
    if written:
        shown = first_few([f"{op.label} (writing {op.parents[0]})" if op.parents else op.label for op in written], 4)
        add_note(exc, f"torchlens: the forward wrote in place at {shown}; the backward of an op that read the "
                     "value before the write may need it as it was: write into a new tensor instead (h = h * 3 in "
                     "place of h.mul_(3)), or clone the value the later op reads")


def _note_cut_sites(trace, exc: RuntimeError) -> None:
    """A loss that needs no gradient, where an intervention replaced a value computed with one by a constant
    (``tl.zero_ablate()``, a patch): the loss may reach the model only through such sites.  Say which."""
    cut = [op for op in (trace.ops[i] for i in sorted(trace._interventions))
           if not op.requires_grad and any(trace._by_label(p).requires_grad for p in op.parents)]
    if cut:
        add_note(exc, f"torchlens: the intervention at {', '.join(op.label for op in cut)} replaced a value that needs "
                     "a gradient with one that does not (a constant such as tl.zero_ablate()'s or a patch), so a "
                     "loss reached only through it has none; compute the new value from the value it replaces "
                     "(tl.scale(0.0) zeroes it and keeps the graph), or take the loss from another path")


def _warn_unreached() -> None:
    """A backward through ``trace.backward`` that delivered no gradient to the trace: its loss was computed from
    another forward (``model(x)`` run again, another trace's output), so every ``.grad`` stays as it was."""
    warn_user("log.backward(loss) reached no op of this trace whose gradient it keeps, so no op's .grad changed: "
              "compute the loss from this trace's output (log.output), not from another forward of the model; "
              "with grads=[...], from the ops it selects")


def _refuse_backward(trace) -> None:
    """Why ``trace.backward`` cannot run: no gradient capture, a loaded trace, or one cleaned up."""
    grad_capture_of(trace)
    if trace.loaded_from is not None:
        raise GradientUnavailable(f"this trace was loaded from {trace.loaded_from}: it holds no autograd graph to "
                                  "run a backward through; its saved gradients are in op.grad")
    if trace._cleaned:
        raise TraceCleanedUp("the trace was cleaned up: its gradient hooks were removed, so a backward would "
                             "fill nothing; trace again")


# ----- statistics ---------------------------------------------------------------------------------
def grad_stats(g) -> dict:
    """Norm (2-norm over all elements), min, max and the count of NaN/Inf entries of one gradient."""
    import torch

    with torch.no_grad():
        g = dense_values(g)
        if g.is_complex():
            g = magnitudes(g)
        values = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
        nonfinite = int(values.numel() - torch.isfinite(values).sum())
        # Contiguous: a reduction's rounding follows the memory order, and a saved trace reloads the gradient
        # contiguous, so the norm must not depend on the layout the backward happened to give.  (Copied only
        # now, once the finite test's temporaries are freed; min and max are exact in any order.)
        return {"grad_norm": _norm(values.contiguous(), nonfinite),
                "grad_min": float(values.min()) if values.numel() else None,
                "grad_max": float(values.max()) if values.numel() else None,
                "grad_nonfinite": nonfinite}


def _norm(values, nonfinite: int) -> float:
    """The 2-norm of ``values``.  torch sums the squares in the gradient's own dtype, where those of a finite,
    exploding gradient overflow (float32 entries above about 1.8e19 give Inf, with no entry non-finite): such
    a norm is taken again of the values scaled by the largest magnitude, and scaled back as a Python float."""
    norm = float(torch.linalg.vector_norm(values))
    if nonfinite or norm != math.inf:
        return norm
    largest = values.abs().max()
    return float(largest) * float(torch.linalg.vector_norm(values / largest))


def norm_of_norms(norms) -> float:
    """The 2-norm of gradients taken together, from the norm of each: the square root of the sum of their
    squares, which ``math.hypot`` takes without forming them (those of norms above about 1.3e154, which float64
    gradients reach, overflow a Python float).  A NaN among them makes it NaN, as the sum of squares would, where
    hypot gives Inf for an Inf beside it: a NaN gradient is the one to look at."""
    norms = list(norms)
    return math.nan if any(math.isnan(norm) for norm in norms) else math.hypot(*norms)


def grad_stats_column(trace) -> dict:
    """``{op index: stats}`` for every op holding a gradient (output nodes repeat their producer's)."""
    kept = trace._grad_stats
    if kept is not None:  # computed before cleanup() released the tensors
        return kept
    capture = trace._gradcap
    if capture is None or trace._cleaned:
        return {}
    # A meta or fake gradient (a backward on the meta device, or under FakeTensorMode) has a shape and no
    # values: no statistics.
    # A batched backward's gradient cannot be read at all (``unreadable``): no statistics either.
    stats = {i: grad_stats(g) for i, g in capture.grads.items() if not without_values(g) and not unreadable(g)}
    for i, kind in enumerate(trace._kind):
        if kind == Kind.OUTPUT and gradient_holder(trace, i) in stats:
            stats[i] = stats[gradient_holder(trace, i)]
    return stats


def release(trace) -> None:
    """For ``Trace.cleanup()``: keep the statistics, drop the tensors, remove every hook."""
    capture = trace._gradcap
    if capture is None:
        return
    trace._grad_stats = grad_stats_column(trace)
    capture.remove_hooks()
    capture.release_grads()


# ----- saved for backward -------------------------------------------------------------------------
def _packed(trace):
    log = trace._packlog
    if log is None:
        raise GradientUnavailable("this trace did not record what autograd saves for backward: trace with "
                                  "tl.trace(model, x, saved_for_backward=True)")
    if log.note_text is not None:
        raise GradientUnavailable(f"what autograd saved for backward is unknown for this trace: {log.note_text}")
    return log.packed


def op_saved_for_backward_bytes(trace, index: int) -> int:
    """Bytes of the distinct storages autograd packed for backward while running this op's call.

    A call that returned several tensors counts once, on its first output (0 on the others)."""
    packed = _packed(trace)
    if not is_first_output(trace, index):
        return 0
    return sum(packed.get(trace._call[index], {}).values())


def saved_for_backward_bytes(trace, op_indices=None) -> int:
    """Distinct storages packed by the calls of ``op_indices`` (all ops when None), each counted once."""
    packed = _packed(trace)
    if op_indices is None:
        calls = packed.keys()
    else:
        calls = {trace._call[i] for i in op_indices if trace._call[i] >= 0}
    storages: dict = {}
    for c in calls:
        storages.update(packed.get(c, {}))
    return sum(storages.values())


class SavedForBackward:
    """Per module call: bytes autograd keeps for backward (distinct storages), largest first."""

    def __init__(self, trace):
        self.total = saved_for_backward_bytes(trace)
        self.model_name = trace.model_name
        self.rows = sorted(
            ({"module_call": mc.label, "class_name": mc.module.class_name, "depth": mc.depth,
              "num_ops": mc._num_ops, "saved_for_backward_bytes": saved_for_backward_bytes(trace, mc._op_nodes)}
             for mc in trace.module_calls),
            key=lambda r: r["saved_for_backward_bytes"], reverse=True)

    def to_pandas(self):
        from .tables import require_pandas

        frame = require_pandas().DataFrame(self.rows, columns=["module_call", "class_name", "depth", "num_ops",
                                                               "saved_for_backward_bytes"])
        frame.attrs["total"] = self.total
        return frame

    def __str__(self) -> str:
        from .summary import aligned_lines, human_bytes

        table = [["module call", "class", "ops", "saved"]] + [
            [r["module_call"], r["class_name"], str(r["num_ops"]), human_bytes(r["saved_for_backward_bytes"])]
            for r in self.rows[:30]]
        lines = [f"saved for backward by {self.model_name}: {human_bytes(self.total)} in distinct storages "
                 "(a storage packed by several ops counts once)"]
        lines += ["  " + line for line in aligned_lines(table, right=(2, 3))]
        if len(self.rows) > 30:
            lines.append(f"  ... {len(self.rows) - 30} more module calls (see .rows or .to_pandas())")
        return "\n".join(lines)

    __repr__ = __str__
