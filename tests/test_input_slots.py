"""The input slots of a traced call (``input.x``) are named as ``inspect.Signature.bind`` names them,
whether the driver's shortcut (``inputs.call_slots``) or ``bind`` itself names them."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.capture import inputs
from untouched import assert_clean_process


class _Plain(nn.Module):
    def forward(self, x, mask=None, scale=1.0):
        return x * scale if mask is None else x * mask * scale


class _KeywordOnly(nn.Module):
    def forward(self, x, *, mask, scale=1.0):
        return x * mask * scale


class _VarKeywords(nn.Module):
    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        out = input_ids.float()
        for value in kwargs.values():
            out = out + value
        return out if attention_mask is None else out * attention_mask


class _VarPositional(nn.Module):
    def forward(self, x, *rest, bias=None):
        return x + sum(rest) if bias is None else x + bias


class _PositionalOnly(nn.Module):
    def forward(self, x, /, y=None, **kwargs):
        return x if y is None else x + y


_MODELS = (_Plain, _KeywordOnly, _VarKeywords, _VarPositional, _PositionalOnly)
_NAMES = ("x", "mask", "scale", "input_ids", "attention_mask", "y", "bias", "extra")


def _calls():
    """Every split of up to three tensors between positional arguments and keywords of the names above."""
    t = [torch.full((2,), float(i + 1)) for i in range(3)]
    for n_args in range(4):
        for names in itertools.permutations(_NAMES, 3 - n_args if n_args < 3 else 0):
            yield tuple(t[:n_args]), {name: t[n_args + i] for i, name in enumerate(names)}
        for k in range(1, 3 - n_args + 1 if n_args < 3 else 1):
            for names in itertools.permutations(_NAMES, k):
                yield tuple(t[:n_args]), {name: t[n_args + i] for i, name in enumerate(names)}


def _bound(model, args, kwargs):
    try:
        arguments = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except TypeError:
        return None
    return [(f"input.{name}", value) for name, value in arguments.items()]


@pytest.mark.parametrize("cls", _MODELS, ids=lambda c: c.__name__)
def test_the_shortcut_names_every_call_as_bind_does(cls):
    model, taken = cls(), 0
    for args, kwargs in _calls():
        slots = inputs.call_slots(model, args, kwargs)
        if slots is None:
            continue  # bind decides
        slots, taken = list(slots), taken + 1
        expected = _bound(model, args, kwargs)
        assert expected is not None, (args, kwargs)
        assert [s for s, _ in slots] == [s for s, _ in expected], (args, kwargs)
        assert all(a is b for (_, a), (_, b) in zip(slots, expected))
    assert taken > 0


def test_a_transformers_style_call_takes_the_shortcut_and_traces_its_slots():
    model = _VarKeywords()
    ids, mask = torch.ones(2, dtype=torch.long), torch.full((2,), 2.0)
    kwargs = {"attention_mask": mask, "input_ids": ids}  # keywords out of the signature's order
    assert [s for s, _ in inputs.call_slots(model, (), kwargs)] == ["input.input_ids", "input.attention_mask"]
    log = tl.trace(model, (), kwargs)
    assert [op.io_path for op in log.ops if op.is_input] == ["input.input_ids", "input.attention_mask"]
    # A keyword only **kwargs takes is left to bind, which gathers it under the name of **kwargs.
    extra = torch.full((2,), 3.0)
    assert inputs.call_slots(model, (ids,), {"extra": extra}) is None
    log = tl.trace(model, (ids,), {"extra": extra})
    assert [op.io_path for op in log.ops if op.is_input] == ["input.input_ids", "input.kwargs.extra"]


def test_a_tensor_passed_under_two_names_is_one_input_that_both_names_find(tmp_path):
    """``labels=input_ids`` (how a causal LM is given its loss) passes one tensor twice: it is one input, named
    by its first slot, and the second slot finds it too, live and after save/load, instead of a KeyError that
    offers other inputs as if the labels had never been passed."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model, ids = transformers.GPT2LMHeadModel(config).eval(), torch.randint(0, 50, (2, 5))
    log = tl.trace(model, (), {"input_ids": ids, "labels": ids})
    assert [op.io_path for op in log.inputs] == ["input.input_ids"]
    loaded = tl.load(log.save(tmp_path / "run"))
    for trace in (log, loaded):
        assert trace["input.labels"] == trace["input.input_ids"] == trace["input_1:1"]
    with pytest.raises(KeyError, match="input.mask"):
        log["input.mask"]


def test_a_tensor_default_of_the_forward_is_an_input_of_the_trace():
    # ``def forward(self, ids, temperature=torch.tensor(0.7))`` called without it: the op reading the default had
    # a parent of unknown origin (log.unattributed), no input named it.
    pytest.importorskip("transformers")
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from real_models import small_gpt2_lm

    class Tempered(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = small_gpt2_lm()

        def forward(self, ids, temperature=torch.tensor(0.7), *, bias=torch.zeros(64)):
            return self.gpt2(ids).logits / temperature + bias

    model, ids = Tempered().eval(), torch.randint(0, 64, (1, 5))
    log = tl.trace(model, ids)
    assert [op.io_path for op in log.ops if op.is_input] == ["input.ids", "input.temperature", "input.bias"]
    assert not log.unattributed
    divide = next(op for op in log.ops if op.type == "div")
    assert divide.parents[1] == log["input.temperature"].label
    assert log["input.temperature"].activation is Tempered.forward.__defaults__[0]
    given = tl.trace(model, (ids, torch.tensor(2.0)), {"bias": torch.ones(64)})
    assert [op.io_path for op in given.ops if op.is_input] == ["input.ids", "input.temperature", "input.bias"]
    assert torch.equal(given["input.temperature"].activation, torch.tensor(2.0))
    assert tl.validate(model, ids).passed


class _ReadsHistory(nn.Module):
    """Reads every step of a history kept as (step, rest) pairs, the newest first."""

    def forward(self, history):
        total = 0
        while history is not None:
            step, history = history
            total = total + step
        return total


def _history(steps: int, requires_grad: bool) -> tuple:
    history = None
    for _ in range(steps):
        history = (torch.randn(3, requires_grad=requires_grad), history)
    return history


@pytest.mark.parametrize("grads", [False, True])
def test_an_argument_nesting_its_tensors_deeper_than_a_trace_looks_is_refused_naming_where(grads):
    # The steps below the 32 levels a walk of the arguments looks into were no inputs of the trace: the adds
    # reading them had a parent from nowhere (log.unattributed), with nothing said.
    shallow = tl.trace(_ReadsHistory(), (_history(8, grads),), grads=grads)
    assert sum(op.is_input for op in shallow.ops) == 8 and not shallow.unattributed
    deep = _history(40, grads)
    says = r"the argument input\.history(\.1){32} holds tensors more than 32 levels deep.*pass them less deeply"
    with pytest.raises(TypeError, match=says):
        tl.trace(_ReadsHistory(), (deep,), grads=grads)
    assert_clean_process()
