"""Gradients and interventions on the real-model corpus, each against an untraced reference.

Every entry of tests/real_models.py, in eval and in train mode (dropout active, the same seed for both
runs):

- ``tl.trace(grads=True)`` and ``log.backward`` give every op the gradient an untraced recording mode
  gets with a hook per output (``grad_oracle.Oracle``), bit for bit, and the same parameter gradients;
- an action at every op returning an equal copy (views kept, since a copy of a view is no longer an alias
  and has other strides) leaves the output bit-identical;
- zeroing one op's output, by its label, gives the output an untraced mode gets by replacing the same
  op's output with zeros (``ZeroAt``, counting ops as the trace does), at three positions of the forward; where
  the model cannot run on the zero (ProphetNet's relative-position buckets, a Student-t head's degrees of
  freedom), the trace raises the error the untraced forward raises.

The ``transformers`` entries skip when ``transformers`` is not installed.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import torchlens as tl
from grad_oracle import Oracle, _assert_bit_identical, _flat, _loss, _op_grads
from real_models import CORPUS, TRANSFORMERS, seed
from torchlens.capture.mode import _NOT_OPS
from torchlens.tree import structures_equal

CASES = [pytest.param(name, mode, id=f"{name}-{mode}") for name in CORPUS for mode in ("eval", "train")]


def fresh(name, mode):
    """A new model of corpus entry ``name`` (its parameters' gradients are written), in ``mode``."""
    if name in TRANSFORMERS:
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, args, kwargs = CORPUS[name]()
    if hasattr(model, "config"):
        model.config.use_cache = False
    model.train(mode == "train")
    if name == "rwkv":  # its first forward in a mode rescales its weights in place: settle it, as later uses find it
        with torch.no_grad():
            model(*args, **kwargs)
    return model, args, kwargs


def param_grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name, mode", CASES)
def test_every_gradient_equals_the_untraced_one(name, mode):
    model, args, kwargs = fresh(name, mode)
    oracle = Oracle("hook")
    seed(1)
    with oracle:
        out = model(*args, **kwargs)
    _loss(out).backward()
    expected = param_grads(model)

    model, args, kwargs = fresh(name, mode)
    seed(1)
    log = tl.trace(model, args, kwargs, grads=True)
    log.backward(_loss(log.output))
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, oracle.grads())
    params = param_grads(model)
    assert params.keys() == expected.keys()
    assert all(torch.equal(params[n], expected[n]) for n in params)


class ZeroAt(TorchFunctionMode):
    """Untraced reference: replaces the output of the ``k``-th op (counted per output tensor, as a trace
    numbers its ops) with zeros. An op with several outputs at ``k`` raises ``LookupError``."""

    def __init__(self, k: int):
        super().__init__()
        self.k, self.seen = k, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _NOT_OPS:
            return out
        if isinstance(out, torch.Tensor):
            count = 1
        elif func is torch.Tensor.__setitem__:
            count = 1
        elif isinstance(out, (tuple, list)):
            count = len(_flat(out))
        else:
            return out
        if self.seen <= self.k < self.seen + count:
            if not isinstance(out, torch.Tensor):
                raise LookupError(f"op {self.k} is one output of several")
            out = torch.zeros_like(out)
        self.seen += count
        return out


def same_output(a, b) -> bool:
    return structures_equal(a, b)[0]


def _zero_at(model, args, kwargs, k: int, label: str, grad: bool) -> tuple:
    """The untraced output with op ``k`` zeroed, and the trace zeroing the op ``label``, with gradients on or off;
    either is the error the forward raised instead where the model cannot run on the zero (a length computed from
    it, a distribution's parameter)."""
    with torch.set_grad_enabled(grad):
        seed(1)
        with ZeroAt(k):
            expected = _result_or_error(lambda: model(*args, **kwargs))
        seed(1)
        return expected, _result_or_error(lambda: tl.trace(model, args, kwargs, intervene={label: tl.zero_ablate()}))


def _result_or_error(run):
    """What ``run()`` returns, or the error the model raised (torchlens's own errors, and ``ZeroAt``'s, pass)."""
    try:
        return run()
    except tl.TorchlensError:
        raise
    except (RuntimeError, ValueError) as error:
        return error


@pytest.mark.parametrize("name, mode", CASES)
def test_interventions_equal_the_untraced_edit(name, mode):
    model, args, kwargs = fresh(name, mode)
    seed(1)
    plain = tl.trace(model, args, kwargs)
    copies = {(lambda op: True): lambda t, op: None if t._base is not None else t.clone()}
    seed(1)
    copied = tl.trace(model, args, kwargs, intervene=copies, reference=plain)
    assert same_output(copied.output, plain.output)

    ops = [op for op in plain if op.kind == "op"]
    # Ops of float values that are not in-place writes (zeroing a mask or an index changes its dtype's
    # meaning, and a write's receiver is another tensor's value)
    plain_values = [k for k, op in enumerate(ops) if op.dtype.is_floating_point and not op.func_name.endswith("_")
                    and op.func_name != "__setitem__"]
    checked = 0
    for k in dict.fromkeys(plain_values[len(plain_values) * i // 4] for i in (1, 2, 3)):
        try:
            expected, zeroed = _zero_at(model, args, kwargs, k, ops[k].label, grad=True)
        except LookupError:  # an LSTM's output among its states: the label site covers it, ZeroAt does not
            continue
        except tl.InterventionError as error:  # in a custom autograd.Function (Bloom's GeLU), whose backward misses it
            assert "custom autograd.Function" in str(error)
            expected, zeroed = _zero_at(model, args, kwargs, k, ops[k].label, grad=False)
        checked += 1
        if isinstance(expected, Exception):  # the model failed on the zero: the trace must fail alike
            assert (type(zeroed), str(zeroed)) == (type(expected), str(expected)), ops[k].label
            continue
        assert [a.label for a in zeroed.interventions] == [ops[k].label]
        assert same_output(zeroed.output, expected), ops[k].label
    assert checked


def test_llama_reentrant_gradient_checkpointing_gives_each_layer_its_gradient():
    # Each decoder layer runs inside torch.utils.checkpoint(use_reentrant=True), whose Function gives the
    # layer's output its backward node when it returns: that output's gradient is what retain_grad() gives.
    pytest.importorskip("transformers")
    from real_models import llama

    def build():
        seed(0)
        model, args, kwargs = llama()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        return model.train(), args, kwargs

    model, args, kwargs = build()
    kept = {}

    def keep_layer_input(module, args, kwargs):  # the next layer's input is layer 0's returned tensor
        kept["h"] = kwargs.get("hidden_states", args[0] if args else None)
        kept["h"].retain_grad()

    model.model.layers[1].register_forward_pre_hook(keep_layer_input, with_kwargs=True)
    seed(1)
    model(*args, **kwargs).logits.sum().backward()
    expected_params = param_grads(model)

    model, args, kwargs = build()
    seed(1)
    log = tl.trace(model, args, kwargs, grads=True)
    log.backward(log.output["logits"].sum())
    assert torch.equal(log["model.layers.0"].grad, kept["h"].grad)
    params = param_grads(model)
    assert params.keys() == expected_params.keys()
    assert all(torch.equal(params[n], expected_params[n]) for n in params)
