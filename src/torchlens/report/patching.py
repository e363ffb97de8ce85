"""Patching experiments as tables: exact activation patching and its first-order estimate.

``activation_patching`` runs the corrupted input once per site with the clean run's value patched in
there (``tl.patch_from``) and reports the metric, normalised so that 0 is the corrupted baseline and 1
the clean one.  ``attribution_patching`` estimates the same numbers for every op and module call from
one forward on each input and one backward: ``(clean - corrupt activation) . d metric / d activation``
on the corrupted run.

Every run of an experiment starts from the model and inputs as the call found them (the generators,
buffers and modules' Python attributes are put back after each, ``capture.restore``), so the runs differ
only by their inputs and the patch, and the model ends as it was.
"""

from __future__ import annotations

import contextlib
import math
import numbers

import torch

from ..checks import check_flag, check_grad_possible, check_int, check_model, check_takes
from ..errors import InterventionError, TorchlensError, add_note, first_few, warn_user
from ..record.grads import note_model_writes
from ..record.modules import Module, is_unregistered, script_modules
from ..record.op import Layer, Op
from ..record.tables import require_pandas
from ..record.trace import Trace
from ..capture.inputs import parameters_named_by
from ..capture.restore import FirstCalls, ForwardState
from ..capture.session import trace
from ..intervene import patch_from
from ..intervene.sites import accepted_ops
from ..copies import clone_call
from ..progress import PROGRESS_ADVICE, bar
from ..tree import tensor_leaves, without_values


def activation_patching(model, clean, corrupt, metric, sites="modules", *, positions: int | None = None,
                        kwargs=None, deep: bool = False, progress: bool | None = None, root=None):
    """Patch each site from the clean into the corrupted run; one row per site.

    Args:
        model: the model; ``clean`` and ``corrupt`` are its arguments (a tensor or a tuple), taking the same
            path through the forward.
        metric: ``metric(output) -> float`` (a scalar tensor is fine), e.g. a logit difference.
        sites: ``"modules"`` (every module call), ``"layers"`` (every layer label: all passes at once),
            ``"ops"`` (every op label), or a list of sites as ``tl.trace(intervene=...)`` takes them.
        positions: patch one index at a time along this dimension of each site's value (``1``: the
            sequence positions of a ``(batch, seq, ...)`` value), adding a ``position`` column; draw the
            table with ``tl.viz.heatmap(df)``.
        root: for a callable that is not a module (``lambda x: m(x).logits``), the module it runs, as for
            ``tl.trace``: its modules are then module sites, and it is what each run puts back.
        progress: a bar over the patched runs: None (automatic) on an interactive terminal or in a notebook when
            tqdm is installed, True anywhere (needs tqdm), False never.
    Returns a pandas DataFrame with columns ``site``, ``metric``, ``normalized`` and ``error`` (why a site
    could not be patched, else empty); ``df.attrs`` holds the ``clean`` and ``corrupt`` baselines.
    """
    pd = require_pandas("a patching report")
    _check_call("activation_patching", clean, corrupt, metric)
    _check_positions(positions)
    _check_sites(sites)
    if progress is not None:
        check_flag(progress, "progress", PROGRESS_ADVICE, who="activation_patching")
    runs = _Runs(model, root, "activation_patching")
    clean_log = runs.trace(clean, kwargs, save="all", deep=deep)
    clean_value = _scalar(metric(clean_log.output))
    corrupt_value = _scalar(metric(runs.trace(corrupt, kwargs, save="none", deep=deep).output))
    _warn_no_span("activation_patching", clean_value, corrupt_value)
    names = _sites(clean_log, sites)
    # Why a site cannot be patched at all (reported in its rows); a name the trace lacks raises KeyError with
    # the closest names, before any patched run.
    unpatchable = _unpatchable_sites(clean_log, names, runs.names_no_model)
    patches = [(site, None) for site in names] if positions is None else \
        _position_patches(clean_log, names, positions, unpatchable)
    rows = []
    for site, position in _progress(patches, progress, "activation patching"):
        at = None if position is None else (slice(None),) * positions + (position,)
        try:
            if site in unpatchable:
                raise TorchlensError(unpatchable[site])
            patched = runs.trace(corrupt, kwargs, save="none", deep=deep, reference=clean_log,
                                 intervene={site: patch_from(clean_log, at=at)})
            value, error = _scalar(metric(patched.output)), ""
        except TorchlensError as exc:  # cannot be patched faithfully: say why
            value, error = math.nan, str(exc)
        row = {"site": site, "metric": value, "normalized": _normalized(value, clean_value, corrupt_value),
               "error": error}
        if positions is not None:
            row["position"] = position
        rows.append(row)
    columns = ["site"] + (["position"] if positions is not None else []) + ["metric", "normalized", "error"]
    frame = pd.DataFrame(rows, columns=columns)
    if positions is not None:  # integers, with <NA> in the row of a site that has no such dimension
        frame["position"] = frame["position"].astype("Int64")
    frame.attrs.update(clean=clean_value, corrupt=corrupt_value)
    return frame


def _check_call(who: str, clean, corrupt, metric) -> None:
    """Both reports run the model on the inputs themselves: a trace passed instead would reach the model.  The
    metric is called first after the clean run: one that cannot be called, or cannot take the output alone, would
    fail only then, in Python's words."""
    example = "metric=lambda out: out[:, -1, 0] - out[:, -1, 1]"
    if not callable(metric):
        raise TypeError(f"{who}: metric= is a function of the model's output returning a scalar ({example}), "
                        f"got {type(metric).__name__}")
    check_takes(metric, 1, f"{who}: metric is called as metric(output), with the model's output",
                f"give a function of the output returning a scalar ({example})")
    if isinstance(clean, Trace) or isinstance(corrupt, Trace):
        raise TypeError(f"{who} takes the clean and corrupted inputs (a tensor or a tuple of arguments), not traces: "
                        "pass the inputs the traces were taken on; to patch one run from a saved trace, use "
                        "tl.trace(model, corrupt, intervene={site: tl.patch_from(loaded)})")


def _check_positions(dim) -> None:
    """``positions`` is the index of one dimension, counted from the front: each patch indexes the value with
    ``dim`` full slices before the position, so a negative ``dim`` would patch along dimension 0 (the batch)
    while the rows counted the positions of dimension ``dim``; and a site's values may differ in rank, so a
    dimension counted from the end would be a different one at each."""
    if dim is not None:
        check_int(dim, "positions", "give the index of the dimension to patch along, counted from the front (1: the "
                  "sequence of a (batch, seq, hidden) value), or None to patch whole values", at_least=0)


def attribution_patching(model, clean, corrupt, metric, *, kwargs=None, deep: bool = False, root=None):
    """First-order estimate of activation patching for every op and module call (``kind`` column).

    ``estimate`` is ``sum((clean - corrupt) * grad)`` with the gradient of ``metric(output)`` taken on the
    corrupted run, ``normalized`` divides it by ``clean - corrupt`` of the metric.  Ops whose value the
    gradient cannot reach (integer tensors, a value written in place later, a value the forward computes
    with no gradient), or whose value has another shape in each run, have NaN and a ``note``.

    Both runs are made with gradients on, so that they take the same path through the model (torch's fused
    inference kernels run only without them) and the clean baseline is computed as the corrupted run is.
    The forward is the model's own: values are attributed where autograd already follows them, never made
    to require a gradient they would not have (which could change what the forward does: an in-place write
    into such a value, an integer op on it).  ``root``: as for ``activation_patching``.
    """
    pd = require_pandas("a patching report")
    _check_call("attribution_patching", clean, corrupt, metric)
    check_grad_possible("attribution_patching")
    runs = _Runs(model, root, "attribution_patching")
    with torch.enable_grad():
        clean_log = runs.trace(clean, kwargs, save="all", deep=deep)
    clean_value = _scalar(metric(clean_log.output))
    live: dict = {}  # label -> (differentiable tensor, its version when captured)
    notes: dict = {}
    held: dict = {}  # id -> every tensor the corrupted run was given or an op of it returned so far

    def grab(t, op):
        """A probe: keep the value the gradient reaches, or say why it reaches none."""
        shared = _held_elsewhere(t, held)
        held[id(t)] = t
        if not t.is_floating_point():
            notes[op.label] = "not a floating-point value"
        elif op.is_inplace:
            notes[op.label] = "written in place: no gradient of its own value"
        elif not t.requires_grad:
            notes[op.label] = _no_gradient_note()
        elif shared:
            # The op returned a tensor the forward held already (``x.to()`` of x's dtype, eval-mode dropout,
            # ``contiguous()``, a parameter ``flatten`` hands back): autograd's gradient of that tensor sums
            # every reader of it, not only this op's readers, which patching this op reaches.  A view of it
            # for this op's readers alone computes the same values and has their gradient only.
            view = t.view_as(t)
            held[id(view)] = view
            live[op.label] = (view, view._version)
            return view
        else:
            live[op.label] = (t, t._version)
        return None

    try:
        with torch.enable_grad():
            corrupt_log = _corrupted_run(runs, corrupt, kwargs, deep, clean_log, grab, held)
            value = metric(corrupt_log.output)
            labels = [k for k, (t, v) in live.items() if t._version == v]
            _check_differentiable(value, bool(labels))
            for k, (t, v) in live.items():
                if t._version != v:
                    notes[k] = "written in place later in the forward: its gradient is not that of this value"
            grads = _gradients(value, [live[k][0] for k in labels], corrupt_log) if labels else ()
    except BaseException:
        runs.state.restore()
        raise
    runs.finish()  # after the backward, which may read the buffers the forward saved for it
    corrupt_value = _scalar(value)
    _warn_no_span("attribution_patching", clean_value, corrupt_value)
    estimate = _estimates(clean_log, live, labels, grads, notes)
    rows = _attribution_rows(clean_log, estimate, notes, clean_value, corrupt_value)
    frame = pd.DataFrame(rows, columns=["site", "kind", "estimate", "normalized", "note"])
    frame.attrs.update(clean=clean_value, corrupt=corrupt_value)
    return frame


def _estimates(clean_log, live: dict, labels: list, grads, notes: dict) -> dict:
    """label -> ``sum((clean - corrupt) * grad)`` for each op whose gradient was taken.  An op whose two values
    differ in shape gets no estimate and a note in ``notes``; one whose estimate is not finite keeps it, with a
    note."""
    estimate = {}
    for k, g in zip(labels, grads):
        clean_act, corrupt_act = clean_log[k].activation, live[k][0].detach()
        if clean_act.shape != corrupt_act.shape:
            notes[k] = (f"the clean run's value has shape {tuple(clean_act.shape)} but the corrupted run's "
                        f"{tuple(corrupt_act.shape)}: no difference to attribute")
            continue
        estimate[k] = 0.0 if g is None else float((_change(clean_act, corrupt_act) * g).sum())
        if not math.isfinite(estimate[k]):
            notes[k] = "the value or its gradient is not finite: no first-order estimate"
    return estimate


def _attribution_rows(clean_log, estimate: dict, notes: dict, clean_value: float, corrupt_value: float) -> list:
    """One row per op, then one per module call, whose estimate sums those of its outputs (NaN with a note
    where that sum would not be the call's)."""
    rows = []
    for op in clean_log.ops:
        if op.kind != "op":
            continue
        e = estimate.get(op.label, math.nan)
        rows.append({"site": op.label, "kind": "op", "estimate": e,
                     "normalized": _normalized(e, clean_value, corrupt_value, baseline=0.0),
                     "note": notes.get(op.label, "")})
    for mc in clean_log.module_calls:
        outs, read_inside = _outputs_not_read_inside(clean_log, mc)
        passed = _outputs_not_made_inside(clean_log, mc)
        e = sum(estimate.get(k, math.nan) for k in outs) if outs and not passed else math.nan
        rows.append({"site": mc.label, "kind": "module call", "estimate": e,
                     "normalized": _normalized(e, clean_value, corrupt_value, baseline=0.0),
                     "note": _call_note(clean_log, mc, outs, read_inside, passed, notes)})
    return rows


def _call_note(clean_log, mc, outs: list, read_inside: list, passed: list, notes: dict) -> str:
    """Why a module call's estimate is missing or leaves outputs out: its outputs' notes, once each (the outputs
    of one call often share a reason: rotary embeddings' cos and sin), then the call's own reasons."""
    said = list(dict.fromkeys(notes[k] for k in outs if k in notes))
    if not mc.output_ops:
        said.append(_no_output_op(clean_log, mc))
    if passed:
        said.append(f"returns a tensor it did not compute ({', '.join(passed)}, passed through from its input), "
                    "whose gradient sums every reader of it, not only the call's callers: no estimate of patching "
                    "the call, which activation_patching refuses too; attribute the op labels of its outputs")
    if read_inside:
        said.append(f"leaves out the outputs the call itself read ({', '.join(read_inside)}): their effect "
                    "reaches the metric through its other outputs, which would count it twice")
    return "; ".join(said)


def _no_gradient_note() -> str:
    """Why an op's value has no gradient, read as the op returns (its action runs in the forward's grad mode): with
    gradients off, inputs that require grad would not change that, so the note does not suggest them there."""
    if not torch.is_grad_enabled():
        return ("computed with gradients off (under torch.no_grad() in the forward, or in a reentrant "
                "torch.utils.checkpoint region, which runs its forward so): autograd gives it no gradient")
    return ("computed with no gradient (from no parameter or input that requires grad, or from a detached tensor); "
            "pass inputs that require grad to attribute the ops computed from them")


def _held_elsewhere(t: torch.Tensor, held: dict) -> bool:
    """Whether ``t`` may have readers other than the ops reading this op's output: it is an input of the run or
    an earlier op returned it, or it is a leaf (a parameter the op handed back as it is)."""
    return held.get(id(t)) is t or (t.is_leaf and t.requires_grad)


def _outputs_not_made_inside(log, call) -> list:
    """The output ops of a module call that no op of the call made (``nn.Identity``, a T5 block returning the
    position bias it was given): patching the call changes that tensor for its other readers too."""
    return [k for k in dict.fromkeys(call.output_ops) if call.label not in log[k].modules]


def _outputs_not_read_inside(log, call) -> tuple:
    """A module call's output ops split into those no op of the call read, and those it read before returning
    them (a key/value cache its attention read, attention weights its own matmul read): a change to one of the
    latter already reaches the metric through the others, so summing both estimates would count it twice."""
    outs = list(dict.fromkeys(call.output_ops))
    inside = [k for k in outs if any(call.label in log[child].modules for child in log[k].children)]
    return [k for k in outs if k not in inside], inside


def _corrupted_run(runs, corrupt, kwargs, deep, clean_log, grab, held):
    """The corrupted run of attribution patching, with ``grab`` at every op of the clean run (its inputs put in
    ``held``); a run that takes another path has no op to match each clean op with, which the error says in the
    experiment's terms."""
    try:
        return runs.start(corrupt, kwargs, held, save="none", deep=deep, reference=clean_log,
                          intervene={(lambda op: True): grab})
    except InterventionError as exc:
        raise InterventionError(f"attribution_patching: the corrupted input takes another path through the model "
                                f"than the clean one, so their ops cannot be paired ({exc})") from None


class _Runs:
    """The runs of one experiment, each from the same start: on copies of the inputs (a forward may write
    them in place or extend a key/value cache among them), with the model's generators, buffers and Python
    attributes put back after it.  A forward that writes a parameter in place would make each run start
    from another model: refused the first time, put back once known (``ForwardState``)."""

    def __init__(self, model, root, who: str):
        check_model(model, f"tl.report.{who}")
        self.model, self.root, self.who = model, root, who
        self.state = ForwardState.of(root if root is not None else model)
        # A callable that names no model (a lambda): its modules join the state as the runs first call them.
        self.names_no_model = self.state.owner is None
        self.first_calls = FirstCalls(self.state.add) if self.names_no_model else contextlib.nullcontext()

    def trace(self, args, kwargs, **options):
        """One run, and the model put back."""
        try:
            log = self.start(args, kwargs, **options)
        except BaseException:
            self.state.restore()
            raise
        self.finish()
        return log

    def start(self, args, kwargs, inputs: dict | None = None, **options):
        """One run, left as it ended until ``finish``: a backward through it may need the buffers it read
        (train-mode batch norm saves its running statistics for the backward).  ``inputs`` is given the copies
        the run starts from, by id (an op handing one back as it is makes no value of its own)."""
        args, kwargs = clone_call(args, kwargs)
        if inputs is not None:
            inputs.update((id(t), t) for _, t in tensor_leaves((args, kwargs), attrs=True))
        try:
            with self.first_calls:
                return trace(self.model, args, kwargs, root=self.root, **options)
        except Exception as exc:
            _note_keyword_inputs(exc, self.who, self.model, args)
            raise

    def finish(self) -> None:
        """Put the model back as the experiment found it; or, when the run wrote parameters that cannot be put
        back, refuse, leaving the model as that forward left it (the generators aside): its attributes and buffers
        then agree with the written parameters (a lazy module put back beside its made weights would be neither
        lazy nor whole, and fail its next call)."""
        written = self.state.written_params()
        if not written:
            self.state.restore()
            return
        self.state.rng.restore()
        cause, lazy = self.state.written_cause(written)
        again = "they are made now (run one forward, model(x), before an experiment on a model with lazy modules)" \
            if lazy else "those parameters are now known, and every run puts them back"
        raise TorchlensError(f"{cause}, so each run of the experiment would start from another model (it is left as "
                             f"that forward left it); run the experiment again: {again}")


def _note_keyword_inputs(exc: BaseException, who: str, model, args) -> None:
    """A tokenized batch given as ``clean`` or ``corrupt`` reached the forward as its one positional argument.
    tl.trace's note says to pass it as ``kwargs``, but here ``kwargs=`` is shared by both runs, so say how the
    keyword arguments of two inputs are given: the ones they share in ``kwargs=``, the others positionally,
    through a callable taking them so."""
    named = parameters_named_by(model, args if isinstance(args, tuple) else (args,))
    if not named:
        return
    first, rest = named[0], named[1:]
    lambda_args = ", ".join(named)
    call = ", ".join(f"{name}={name}" for name in named)
    add_note(exc, f"torchlens: {who} takes clean and corrupt as the positional arguments (a tensor or a tuple), and "
                  f"kwargs= as the keyword arguments both runs share: give clean[{first!r}] and corrupt[{first!r}]"
                  + (f", with kwargs={{{', '.join(f'{n!r}: ...' for n in rest)}}}" if rest else "")
                  + f"; when their other keyword arguments differ, patch a callable taking them positionally: "
                  f"{who}(lambda {lambda_args}: model({call}), (clean[...], ...), (corrupt[...], ...), metric, "
                  "root=model)")


def _change(clean: torch.Tensor, corrupt: torch.Tensor) -> torch.Tensor:
    """``clean - corrupt``, 0 where the two are equal: an attention mask's ``-inf`` is the same in both runs,
    which is no change, not the NaN of ``inf - inf``."""
    clean = clean.to(corrupt.dtype)
    return torch.where(clean == corrupt, torch.zeros((), dtype=corrupt.dtype, device=corrupt.device),
                       clean - corrupt)


def _unpatchable_sites(log, names, names_no_model: bool = False) -> dict:
    """``site -> why it cannot be patched`` for the sites of ``names`` no patched run could take: a module
    call that returns no tensor, and a module the forward made itself (T5's loss, ``nn.Tanh()(x)``), which
    is no module of the model, so no module site; when the traced callable names no model
    (``names_no_model``), none of its modules is.  A name ``log`` does not know raises ``KeyError``."""
    calls = {call.label: call for call in log.module_calls}
    reasons = {}
    for site in names:
        if not isinstance(site, str):
            continue
        call = calls.get(site)
        if call is not None and not call.output_ops:
            reasons[site] = _no_output_op(log, call)
            continue
        log[site]  # raises KeyError with the closest names
        address = site.rpartition(":")[0] if call is not None else site
        outputs = call.output_ops if call is not None else []
        instead = f"patch the op it returns instead (here {', '.join(outputs)})" if outputs else \
            "patch the op it returns instead"
        if address == "self":  # a callable's call of its root= (generate()'s steps): no module site names it
            reasons[site] = (f"{site} is a call of the root module itself, which no intervention site names; patch a "
                             f"module inside it, or {instead}")
        elif is_unregistered(address) and names_no_model:
            reasons[site] = (f"{site} is a module of no model (the traced callable names none), so it is no module "
                             f"site; pass root= the model it runs, or {instead}")
        elif is_unregistered(address):
            reasons[site] = (f"{site} is a module the forward made itself, not a module of the model, so it is no "
                             f"module site; {instead}")
    return reasons


def _no_output_op(log, call) -> str:
    """Why a module call lists no output op: a TorchScript module's output is made in TorchScript's interpreter,
    where no op of the trace holds it (it reaches its readers as a tensor of unknown origin); any other such call
    returns no tensor."""
    scripted = [outer for outer in script_modules(log)
                if call.address == outer or call.address.startswith(f"{outer}.")]
    if scripted:
        return (f"module call {call.label} runs in TorchScript's interpreter ({scripted[0]} is a torch.jit.script or "
                "torch.jit.trace module), where capture cannot see its ops: no op of the trace holds its output to "
                "patch; patch the ops that read it, or trace the module as it was before scripting")
    return f"module call {call.label} returns no tensor: there is nothing to patch"


def _position_patches(log, names, dim: int, unpatchable: dict) -> list:
    """``(site, position)`` for each index along ``dim`` of each site's value.  A module call with no output op
    (one returning no tensor, or a TorchScript module's), or a module with only such calls, has no value to index:
    one row, whose ``error`` is its reason in ``unpatchable`` or the patched run's refusal; so has a value with no
    dimension ``dim`` (an ``arange`` among ``sites="ops"``), whose reason is added there."""
    patches = []
    calls = {call.label: call for call in log.module_calls}
    for site in names:
        if isinstance(site, str) and site not in log:
            continue
        if isinstance(site, str) and not _changed_ops(log, site):  # a module whose calls returned no tensor
            patches.append((site, None))
            continue
        try:
            _refuse_outputs_of_other_shapes(log, site, dim, calls)
            patches += [(site, p) for p in range(_extent(log, site, dim))]
        except ValueError as exc:
            unpatchable[site] = str(exc)
            patches.append((site, None))
    return patches


def _refuse_outputs_of_other_shapes(log, site, dim: int, calls: dict) -> None:
    """A module call returning values of other shapes (an LSTM's output and its final states) has no one
    position: index ``p`` along ``dim`` is a sequence position of one value and a batch row of another, and
    patching both would be no patch of position ``p``.  Refused (a ``ValueError``, said in the site's row)."""
    if not isinstance(site, str):
        return
    call = calls.get(site) or calls.get(f"{site}:1")  # a module call, or a module's first call
    if call is None or len(call.output_ops) < 2:
        return
    shapes = list(dict.fromkeys(tuple(log[label].shape or ()) for label in call.output_ops))
    if len(shapes) > 1:
        raise ValueError(f"positions={dim}: {call.label} returns values of shapes {', '.join(map(str, shapes))}, so "
                         f"an index along dimension {dim} is another place in each; patch by position at the op of the "
                         f"output you mean ({', '.join(call.output_ops)})")


def _extent(log, site, dim: int) -> int:
    """Size of dimension ``dim`` of the values at ``site``: the longest pass's, for a layer, a module called several
    times or a predicate (each pass is patched along the same dimension), so that no position a later, longer pass
    has goes without a row; a position a shorter pass lacks is that row's error.  A first value with no such
    dimension has no positions."""
    values = _changed_ops(log, site)
    shape = values[0].shape
    if shape is None or len(shape) <= dim:
        raise ValueError(f"positions={dim}: the value at {site!r} has shape {shape}, with no dimension {dim}")
    _refuse_values_of_other_ranks(site, dim, values)
    return max(op.shape[dim] for op in values)


def _refuse_values_of_other_ranks(site, dim: int, values: list) -> None:
    """Values of another rank (a predicate accepting BERT's ``(batch, seq, d)`` projections and its ``(batch, d)``
    pooler) have another meaning at dimension ``dim``: index ``p`` is a sequence position of one and a channel of the
    other, and patching both would be no patch of position ``p``.  Refused, as a call's outputs of other shapes are."""
    first = values[0]
    other = [op for op in values if len(op.shape or ()) != len(first.shape)]
    if other:
        where = repr(site) if isinstance(site, str) else "the predicate site"
        raise ValueError(f"positions={dim}: the values at {where} differ in rank ({first.label} has shape "
                         f"{tuple(first.shape)}, {other[0].label} {tuple(other[0].shape or ())}), so an index along "
                         f"dimension {dim} is another place in each; patch by position at a site whose values have "
                         f"one rank (of another rank here: {first_few(op.label for op in other)})")


def _changed_ops(log, site) -> list:
    """The ops whose values ``site`` changes, in order: the op itself, a layer's passes, a module's calls' outputs,
    or every op a predicate accepts.  A module call with no output op (returning no tensor, or a TorchScript
    module's) is looked up as its call record, which has no value: it adds none."""
    if not isinstance(site, str):
        return accepted_ops(log, site)
    found = log[site]
    if isinstance(found, Layer):
        return found.ops
    if isinstance(found, Module):
        return [op for op in (log[label] for label in found.call_labels) if isinstance(op, Op)]
    return [found] if isinstance(found, Op) else []


def _sites(log, sites) -> list:
    if sites == "modules":
        return [mc.label for mc in log.module_calls]
    if sites == "layers":
        return list(dict.fromkeys(op.layer_label for op in log.ops if op.kind == "op"))
    if sites == "ops":
        return [op.label for op in log.ops if op.kind == "op"]
    return list(sites)


def _check_sites(sites) -> None:
    """``sites`` is read after the clean run: a word it does not know, or a value that lists nothing, is refused
    before it."""
    if isinstance(sites, str) and sites not in ("modules", "layers", "ops"):
        raise ValueError(f"sites={sites!r}: use 'modules', 'layers', 'ops' or a list of sites")
    if not isinstance(sites, str) and not hasattr(sites, "__iter__"):
        raise TypeError(f"sites= is 'modules', 'layers', 'ops' or a list of sites (['encoder.layers.0', "
                        f"'linear_1_1']), got {type(sites).__name__} {sites!r}")


def _warn_no_span(who: str, clean: float, corrupt: float) -> None:
    """``normalized`` divides by ``clean - corrupt``: with the two equal it is NaN in every row, which a table
    alone would not explain."""
    if clean == corrupt:
        warn_user(f"{who}: the metric is {clean!r} on both the clean and the corrupted input, so no change is there "
                  "to restore: normalized is NaN in every row; corrupt the input so that the metric changes")


def _normalized(value, clean, corrupt, baseline=None):
    span = clean - corrupt
    if span == 0 or math.isnan(value):
        return math.nan
    return (value - (corrupt if baseline is None else baseline)) / span


def _check_differentiable(value, needed: bool) -> None:
    """The corrupted run's metric, of which attribution takes the gradient: one number, and a tensor still joined
    to the graph when some value is to be attributed (else autograd's own "'float' object is not iterable" or
    "does not require grad")."""
    _scalar(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"attribution_patching: the metric returned a {type(value).__name__}, but attribution takes "
                        "its gradient: return the one-element tensor itself, without float() or .item()")
    if needed and not value.requires_grad:
        raise ValueError("attribution_patching: the metric's tensor has no gradient (made under torch.no_grad(), or "
                         ".detach()ed), but attribution takes its gradient: compute it from the output as it is")


def _gradients(value, tensors, trace) -> tuple:
    """d value / d each tensor, by ``torch.autograd.grad``.  A reentrant ``torch.utils.checkpoint`` region refuses
    it (its backward runs only inside a whole ``.backward()``) with a message naming ``.grad()``, which the caller
    never wrote: the refusal is said in the experiment's terms, with the two ways out.  Autograd's refusal of a
    value the forward overwrote gets the note naming the forward's writes (``trace``: the corrupted run's)."""
    try:
        return torch.autograd.grad(value, tensors, allow_unused=True)
    except RuntimeError as exc:
        note_model_writes(trace, exc)
        if "use_reentrant=True" not in str(exc):
            raise
        raise InterventionError(
            "attribution_patching takes the metric's gradient with torch.autograd.grad, which a reentrant "
            "torch.utils.checkpoint region of the model refuses (its backward runs only in a whole .backward()); "
            "checkpoint with use_reentrant=False (for a transformers model, model.gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False})), or turn gradient checkpointing off") from exc


def _scalar(value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"the metric must return one number, got a tensor of shape {tuple(value.shape)}")
        if without_values(value):
            raise TorchlensError(f"the metric returned a {'meta' if value.is_meta else 'fake (FakeTensorMode)'} "
                                 "tensor, which has no value: patching compares the metric's values, so run the "
                                 "model on a real device")
        return float(value.detach())
    if isinstance(value, numbers.Real):
        return float(value)
    # float() would read a string such as "0.5" as a number, and answer None with a message of its own.
    raise TypeError(f"the metric must return one number (a float or a one-element tensor), got "
                    f"{type(value).__name__} {value!r:.60}; return the value itself "
                    "(lambda out: out[0, 1] - out[0, 2])")


def _progress(items: list, progress, desc: str):
    """``items``, one by one, advancing a bar (``progress.bar``, automatic by default) as each is done."""
    shown = bar(progress, desc, total=len(items))
    try:
        for item in items:
            yield item
            shown.update()
    finally:
        shown.close()
