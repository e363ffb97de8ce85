"""The untraced reference for gradient tests: a minimal recording mode that keeps each torch call's
outputs and their gradients (``retain_grad()``, or a hook per output for tensors later modified in place).
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode

import torchlens as tl
from torchlens.capture.mode import _NOT_OPS
from zoo import zoo


class Oracle(TorchFunctionMode):
    """Untraced reference: keeps each torch call's output tensors in order and their gradients.

    ``how="retain_grad"`` calls ``retain_grad()``; ``how="hook"`` registers a hook per output, which is
    what PyTorch defines for a tensor modified in place afterwards (the gradient of that version)."""

    def __init__(self, how="retain_grad"):
        super().__init__()
        self.how = how
        self.outputs = []  # (tensor or None, requires_grad)
        self.hooked: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _NOT_OPS:
            return out
        if isinstance(out, torch.Tensor):
            leaves = [out]
        elif func is torch.Tensor.__setitem__:
            leaves = [args[0]]
        elif isinstance(out, (tuple, list)):
            leaves = _flat(out)
        else:
            return out
        for t in leaves:
            k = len(self.outputs)
            self.outputs.append((t, t.requires_grad))
            if t.requires_grad:
                self._retain(k, t)
        return out

    def _retain(self, k, t):
        if self.how == "retain_grad":
            t.retain_grad()
            return
        # The hooks reach the oracle weakly: held by the graph's nodes, which Python's collector cannot see, a
        # strong reference would close a cycle (oracle -> outputs -> grad_fn -> hook -> oracle) that keeps
        # every output and parameter of the model alive for the rest of the test process.
        keep = weakref.WeakMethod(self._keep)
        # Held across the call: registering on a view written in place (Longformer's masked
        # chunks) regenerates its grad_fn, which torch frees too early unless it is referenced.
        node = t.grad_fn
        if node is not None and t._backward_hooks is not None:
            # torch keeps a tensor's hook dict across the in-place ops that only change its shape
            # (BigBird's ``unsqueeze_``), registered on the node before them: a hook on the current
            # node receives this version's gradient.
            node.register_prehook(lambda grads, k=k, n=t.output_nr: keep()(k, grads[n]))
            return
        t.register_hook(lambda g, k=k: keep()(k, g))

    def __exit__(self, *exc):
        # A custom autograd Function's output is made under no_grad inside its forward and given the
        # Function's backward node when it returns: it requires grad from then on.  So does a leaf the
        # forward sets to require grad (``h.requires_grad = True``: wav2vec2's feature encoder in training).
        for k, (t, requires_grad) in enumerate(self.outputs):
            if requires_grad or not t.requires_grad:
                continue
            if t.grad_fn is None or isinstance(t.grad_fn, torch.autograd.function.BackwardCFunction):
                self.outputs[k] = (t, True)
                self._retain(k, t)
        return super().__exit__(*exc)

    def _keep(self, k, g):
        if g is None:  # (a node's hook sees every output's gradient: this backward did not reach this one)
            return
        self.hooked[k] = g.clone() if k not in self.hooked else self.hooked[k] + g

    def grads(self):
        if self.how == "retain_grad":
            return [t.grad if rg else None for t, rg in self.outputs]
        return [self.hooked.get(k) for k in range(len(self.outputs))]


def _flat(out):
    """Every tensor inside nested tuples, lists and dicts, in order."""
    found = []
    for item in (out.values() if isinstance(out, dict) else out):
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list, dict)):
            found.extend(_flat(item))
    return found


def _loss(output):
    """A loss reaching every floating output, weighted so that gradients differ per element."""
    leaves = [t for t in _flat([output]) if t.is_floating_point() and t.requires_grad]
    g = torch.Generator().manual_seed(7)
    return sum((t * torch.randn(t.shape, generator=g)).sum() for t in leaves)


# Models without parameters: their inputs require grad, so that there is a backward at all.
_INPUT_GRAD = {"functional", "multi_output"}


def _case(name):
    model, args, kwargs = zoo()[name]
    if name in _INPUT_GRAD:
        args = tuple(a.clone().requires_grad_() for a in args)
    return model, args, kwargs


def _reference(name, how="retain_grad", case=_case):
    model, args, kwargs = case(name)
    oracle = Oracle(how)
    torch.manual_seed(1)
    with oracle:
        out = model(*args, **kwargs)
    _loss(out).backward()
    return oracle, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _traced(name, case=_case, **options):
    model, args, kwargs = case(name)
    torch.manual_seed(1)
    log = tl.trace(model, args, kwargs, grads=True, **options)
    log.backward(_loss(log.output))
    return log, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _op_grads(log):
    ops = [op for op in log if op.kind == "op"]
    return ops, [op.grad if op.requires_grad else None for op in ops]


def _assert_bit_identical(ops, got, expected):
    assert len(got) == len(expected), (len(got), len(expected))
    assert any(e is not None for e in expected), "the reference run produced no gradient to compare"
    for op, g, e in zip(ops, got, expected):
        if e is None:
            assert g is None, op.label
        else:
            assert g is not None, op.label
            assert g.dtype == e.dtype and g.shape == e.shape == op.shape, op.label
            assert torch.equal(g, e), op.label


# Models without in-place writes: retain_grad() on every output is the reference.
