"""Validation by replay: does the trace describe what the model really computed?

``tl.validate(model, x)`` runs the model untraced (on cloned inputs, RNG and state restored afterwards),
traces it, checks the traced outputs equal the untraced ones bit for bit, and replays every op from its
saved parents and recorded non-tensor arguments.  ``trace.validate()`` does the replay part on an
existing trace that saved its activations.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch

_RANDOM_FUNCS = frozenset([
    "dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d",
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli",
    "bernoulli_", "multinomial", "normal", "normal_", "uniform_", "exponential_", "geometric_",
    "cauchy_", "log_normal_", "random_", "poisson", "rrelu", "rrelu_", "native_dropout",
])


_UNINITIALIZED_FUNCS = frozenset(["empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"])


@dataclass
class ValidationResult:
    """What validation checked and found; ``passed`` is the one-word verdict."""

    outputs_match: bool | None = None
    replayed: int = 0
    mismatched: list = field(default_factory=list)  # (label, reason)
    not_replayed: list = field(default_factory=list)  # (label, reason)

    @property
    def passed(self) -> bool:
        return self.outputs_match is not False and not self.mismatched

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        lines = [f"validation {'passed' if self.passed else 'FAILED'}: {self.replayed} ops replayed exactly"]
        if self.outputs_match is not None:
            lines.append(f"  outputs equal an untraced run: {self.outputs_match}")
        for label, reason in self.mismatched:
            lines.append(f"  MISMATCH {label}: {reason}")
        if self.not_replayed:
            lines.append(f"  {len(self.not_replayed)} ops could not be replayed:")
            for label, reason in self.not_replayed[:20]:
                lines.append(f"    {label}: {reason}")
        return "\n".join(lines)


def tensors_equal(a, b) -> bool:
    """Bit-for-bit equality that treats NaNs in the same places as equal."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a == b
    if a.is_nested or b.is_nested:  # no single shape: compare component by component
        parts_a, parts_b = (a.unbind(), b.unbind()) if a.is_nested and b.is_nested else ((a,), ())
        return len(parts_a) == len(parts_b) and all(map(tensors_equal, parts_a, parts_b))
    if a.layout != torch.strided or b.layout != torch.strided:  # sparse COO / CSR / CSC / BSR / BSC
        return a.layout == b.layout and tensors_equal(a.to_dense(), b.to_dense())
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_meta or b.is_meta:  # no values: shape and dtype are all there is to compare
        return a.is_meta and b.is_meta
    if a.is_floating_point() or a.is_complex():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        return bool(torch.equal(nan_a, nan_b)) and bool(torch.equal(a[~nan_a], b[~nan_b]))
    return bool(torch.equal(a, b))


def outputs_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return tensors_equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(outputs_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(outputs_equal(a[k], b[k]) for k in a)
    return type(a) is type(b)


class RunState:
    """RNG state, parameters/buffers and training flags, restorable after a run."""

    def __init__(self, model):
        self.model = model
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.is_module = isinstance(model, torch.nn.Module)
        if self.is_module:
            self.state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
            self.training = {m: m.training for m in model.modules()}

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if self.is_module:
            with torch.no_grad():
                for k, v in self.model.state_dict(keep_vars=True).items():
                    v.copy_(self.state[k])
            for m, flag in self.training.items():
                m.training = flag


def clone_inputs(obj, memo=None):
    """Clone the tensors in a structure, keeping aliasing: a tensor passed twice stays one tensor
    (``nn.MultiheadAttention`` takes a different path when ``query is key``)."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.clone()
        return memo[id(obj)]
    if isinstance(obj, (tuple, list)):
        return type(obj)(clone_inputs(o, memo) for o in obj)
    if isinstance(obj, dict):
        return {k: clone_inputs(v, memo) for k, v in obj.items()}
    return copy.copy(obj)


def validate(model, args=(), kwargs=None, **trace_kwargs) -> ValidationResult:
    """Trace ``model`` and check the trace against an untraced run and against replay of every op."""
    from .capture.session import _as_args, _unwrap, trace

    model = _unwrap(model)
    call_args = _as_args(model, args)
    kwargs = dict(kwargs or {})
    before = RunState(model)
    memo: dict = {}
    expected = model(*clone_inputs(call_args, memo), **clone_inputs(kwargs, memo))
    before.restore()
    log = trace(model, call_args, kwargs, save="all", **trace_kwargs)
    result = validate_trace(log)
    result.outputs_match = outputs_equal(log.output, expected)
    return result


def validate_trace(log) -> ValidationResult:
    """Replay each op of ``log`` from its saved parents; report mismatches and what could not run."""
    result = ValidationResult()
    for op in log.ops:
        if op.kind != "op" or op.multi_output_index not in (None, 0, (0,)):
            continue
        with _autocast_as_traced(log):
            reason = _replay_problem(log, op)
        if reason is None:
            result.replayed += 1
        elif reason.startswith("mismatch"):
            result.mismatched.append((op.label, reason))
        else:
            result.not_replayed.append((op.label, reason))
    return result


def _autocast_as_traced(log):
    """Autocast on or off for replay exactly as it was around the traced forward (an autocast region
    opened inside the model itself is not recorded: its ops replay as mismatches, never silently)."""
    traced = getattr(log, "_autocast", {})
    stack = contextlib.ExitStack()
    for device_type in ("cpu", "cuda"):
        if device_type in traced:
            stack.enter_context(torch.autocast(device_type, dtype=traced[device_type]))
        elif torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def _replay_problem(log, op):
    call = log._calls[log._call[op.index]]
    func, skeleton, kw_skeleton, parents, params = call[0], call[1], call[2], call[3], call[4]
    if skeleton is None and kw_skeleton is None:
        return "the trace was cleaned up"
    if op.device.type == "meta":
        return "meta tensors hold no values to compare"
    if op.func_name in _UNINITIALIZED_FUNCS:
        return "uninitialized memory (torch.empty and kin): its contents are not defined"
    if op.func_name in _RANDOM_FUNCS:
        return "random op (consumes the RNG; replay would draw new numbers)"
    if not op.has_activation:
        dropped = log._dropped.get(op.index)
        return f"its saved output was dropped: {dropped}" if dropped else "its own output was not saved"
    args, kwargs = list(skeleton), dict(kw_skeleton)
    for position, parent in parents:
        if parent < 0:
            return "a tensor argument came from outside the trace"
        if parent not in log._activations:
            return f"parent {log._labels[parent]} was not saved"
        if (log._call[op.index], parent) in log._alias_reads:
            return (f"it read {log._labels[parent]}'s storage after a write through a view, a value "
                    "that no op output holds")
        _place(args, kwargs, position, _copy_with_layout(log._activations[parent]))
    for position, param in params:
        _place(args, kwargs, position, param.detach())
    try:
        with torch.no_grad():
            out = func(*args, **kwargs)
    except Exception as exc:  # replay cannot always rebuild a call (e.g. objects with hidden state)
        return f"replay raised {type(exc).__name__}: {exc}"
    if out is None or op.is_inplace:
        out = args[0] if out is None else out
    if isinstance(out, (tuple, list)):
        outs = [log._activations.get(i) for i in range(op.index, op.index + call[11])]
        got = [o for o in _flat(out)]
        if len(got) != len(outs):
            return "mismatch: a different number of outputs on replay"
        for g, want in zip(got, outs):
            if want is not None and not tensors_equal(g, want):
                return "mismatch: a replayed output differs from the saved one"
        return None
    if not tensors_equal(out, log._activations[op.index]):
        return "mismatch: the replayed output differs from the saved one"
    return None


def _copy_with_layout(t):
    """A private copy with ``t``'s strides: a reduction over a strided view (``z.real``) sums in a
    different order, and so to different bits, than over a contiguous copy."""
    if t.layout != torch.strided or t.is_nested or t.is_contiguous():  # in that order: CSR has no strides
        return t.clone()
    try:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
    except RuntimeError:  # overlapping strides (an expanded tensor) cannot be written
        return t.clone()


def _flat(out):
    for item in out:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (tuple, list)):
            yield from _flat(item)


def _place(args, kwargs, position, value) -> None:
    if isinstance(position, str):
        kwargs[position] = value
    elif isinstance(position, tuple):
        outer, inner = position
        container = list(args[outer])
        container[inner] = value
        args[outer] = container
    else:
        args[position] = value
