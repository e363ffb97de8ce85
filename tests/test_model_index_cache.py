"""The per-model index cache: reused while the model is unchanged, never stale, never keeps a model alive."""

from __future__ import annotations

import functools
import gc
import os
import sys
import weakref

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.capture import accel
from torchlens.errors import UnmatchedSelection
from torchlens.record import model_index
from torchlens.record.model_index import index_of

sys.path.insert(0, os.path.dirname(__file__))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


def _trace(model, x):
    with torch.no_grad():
        return tl.trace(model.eval(), x)


def _module_addresses(log) -> list:
    return [m.address for m in log.modules]


def _buffer_addresses(log) -> set:
    return {b.address for b in log.buffers}


def test_an_unchanged_model_reuses_its_index_and_traces_the_same():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 4)
    first = index_of(model)
    assert index_of(model) is first
    a, b = _trace(model, x), _trace(model, x)
    assert index_of(model) is first
    assert [op.label for op in a.ops] == [op.label for op in b.ops]
    assert [op.params for op in a.ops] == [op.params for op in b.ops]
    assert _module_addresses(a) == _module_addresses(b)


@pytest.mark.parametrize("change", [
    "replace submodule", "add submodule", "rename submodule", "replace nested submodule", "replace parameter",
    "delete parameter", "replace buffer", "add buffer", "replace _parameters dict", "module via _modules dict",
    "convert dtype", "append to Sequential", "replace _modules dict", "register_parameter", "add_module",
    "replace __dict__",
])
def test_a_changed_structure_is_seen_by_the_next_trace(change):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 4)
    before = _trace(model, x)
    cached = index_of(model)
    if change == "replace submodule":
        model.head = nn.Linear(4, 2)
    elif change == "add submodule":
        model.extra = nn.Tanh()
        model.forward = lambda x: model.extra(Net.forward(model, x))
    elif change == "rename submodule":
        head = model.head
        del model.head
        model.final = head
        model.forward = lambda x: model.final(model.norm(model.body(x)))
    elif change == "replace nested submodule":
        model.body[0] = nn.Linear(4, 4)
    elif change == "replace parameter":
        model.head.weight = nn.Parameter(torch.ones(2, 4))
    elif change == "delete parameter":
        model.head.bias = None
    elif change == "replace buffer":
        model.norm.running_mean = torch.zeros(4)
    elif change == "add buffer":
        model.head.register_buffer("shift", torch.ones(2))
        model.forward = lambda x: Net.forward(model, x) + model.head.shift
    elif change == "replace _parameters dict":
        model.head._parameters = dict(model.head._parameters, weight=nn.Parameter(torch.ones(2, 4)))
    elif change == "module via _modules dict":
        model.body._modules["0"] = nn.Linear(4, 4)
    elif change == "convert dtype":  # _apply: new buffer tensors, parameters converted in place
        model.double()
        x = x.double()
    elif change == "append to Sequential":
        model.body.append(nn.Tanh())
    elif change == "replace _modules dict":
        model.body._modules = {"0": nn.Linear(4, 4), "1": nn.ReLU()}
    elif change == "register_parameter":
        model.head.register_parameter("bias", nn.Parameter(torch.zeros(2)))
    elif change == "add_module":
        model.add_module("extra", nn.Tanh())
        model.forward = lambda x: model.extra(Net.forward(model, x))
    elif change == "replace __dict__":  # the same attributes, but a new buffer
        model.norm.__dict__ = dict(vars(model.norm), _buffers=dict(model.norm._buffers,
                                                                  running_mean=torch.zeros(4)))
    after = _trace(model, x)
    fresh = model_index.ModelIndex(model)
    index = index_of(model)
    assert index is not cached
    assert index.module_addresses == fresh.module_addresses
    assert index.param_addresses == fresh.param_addresses
    assert {k: v[1] for k, v in index.buffers.items()} == {k: v[1] for k, v in fresh.buffers.items()}
    # The trace itself names what now runs: no "<unregistered ...>" modules or parameters.
    assert not any(a.startswith("<unregistered") for a in _module_addresses(after))
    assert not any(p.startswith("<unregistered") for op in after.ops for p in op.params)
    if change == "rename submodule":
        assert "final" in _module_addresses(after) and "head" not in _module_addresses(after)
    if change == "add submodule":
        assert "extra" in _module_addresses(after) and "extra" not in _module_addresses(before)
    if change in ("append to Sequential", "replace _modules dict"):
        assert {"body.0", "body.1"} <= set(_module_addresses(after))
        assert ("body.2" in _module_addresses(after)) == (change == "append to Sequential")
    if change in ("replace buffer", "add buffer", "convert dtype", "replace __dict__"):
        expected = {"norm.running_mean", "norm.running_var"} | ({"head.shift"} if change == "add buffer" else set())
        assert _buffer_addresses(after) == expected
        assert after.unattributed == 0
    if change == "delete parameter":
        assert ("head.bias" in {p for op in before.ops for p in op.params}
                and "head.bias" not in {p for op in after.ops for p in op.params})


@pytest.fixture
def python_structure():
    """The pure-Python ``Structure`` for the models indexed in the test (the compiled check, which reads
    each ``__dict__`` directly, has no referents layout: see test_model_index_accel.py)."""
    previous = accel.use(False)
    try:
        yield
    finally:
        accel.use(previous)


class _Slotted(nn.Linear):
    __slots__ = ("note",)  # its instances hold a slot beside their __dict__: another layout of references


def test_a_module_with_slots_is_checked_the_general_way_and_still_seen_changing(python_structure):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 4)
    model.head = _Slotted(4, 2)
    model.head.note = "a slot's value is one more reference"
    _trace(model, x)
    cached = index_of(model)
    assert not model_index._cache[id(model)][1].by_referents
    assert index_of(model) is cached  # unchanged: still served from the cache
    model.head.weight = nn.Parameter(torch.ones(2, 4))
    index = index_of(model)
    assert index is not cached and index.param_addresses == model_index.ModelIndex(model).param_addresses


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="CPython 3.13 keeps an object's attributes inline: a "
                    "module's references are those values, not its __dict__, so every module takes the general path")
def test_plain_modules_are_checked_by_their_references(python_structure):
    model = Net()
    model.head = _Slotted(4, 2)  # its slot unset: a plain layout of references
    cached = index_of(model)
    assert model_index._cache[id(model)][1].by_referents and index_of(model) is cached
    model.head.note = "set now"  # one more reference: the layout changed, the index is walked again
    assert index_of(model) is not cached


def test_the_cache_does_not_keep_a_model_alive():
    model = Net()
    _trace(model, torch.randn(3, 4))
    assert id(model) in model_index._cache
    alive, key = weakref.ref(model), id(model)
    del model
    gc.collect()
    assert alive() is None
    assert key not in model_index._cache


class _Probe(nn.Module):
    """An interpretability wrapper: keeps a transformer block's output through a hook of its own (``way``:
    a bound method, a closure, a ``partial``, a parent attribute, a gradient hook on a weight, or none)."""

    def __init__(self, way):
        super().__init__()
        import real_models  # transformers, imported here: the other tests of this file do without it

        self.lm, _, kwargs = real_models.gpt2()
        self.ids, self.kept = kwargs["input_ids"], []
        block = self.lm.transformer.h[0]
        if way == "bound method":
            block.register_forward_hook(self._keep)
        elif way == "closure":
            block.register_forward_hook(_keeping_into(self))
        elif way == "partial":
            block.register_forward_hook(functools.partial(_Probe._keep, self))
        elif way == "parent attribute":
            block.__dict__["probe"] = self  # a plain attribute, as object.__setattr__ leaves it
        elif way == "gradient hook":
            block.mlp.c_fc.weight.register_hook(lambda grad: self.kept.append(grad))

    def _keep(self, module, args, output):
        self.kept.append(output[0])

    def forward(self, ids):
        return self.lm(ids).logits


def _keeping_into(probe):
    return lambda module, args, output: probe.kept.append(output[0])


@pytest.mark.parametrize("way", ["bound method", "closure", "partial", "parent attribute", "gradient hook",
                                 "hook added after a trace"])
def test_a_model_its_modules_refer_back_to_is_freed_once_dropped(way):
    """The cache holds every module of a model it indexed.  A module leading back to the model (a hook that is
    the model's bound method) made the model reachable from the cache for good: dropped, it was never freed,
    not even by a collection (which frees such a model, a cycle of its own, when it is not traced)."""
    model = _Probe("none" if way == "hook added after a trace" else way).eval()
    x = model.ids
    first = _trace(model, x)
    if way == "hook added after a trace":  # the structure the cache checks is unchanged by a hook
        model.lm.transformer.h[0].register_forward_hook(model._keep)
    gc.collect()  # the model is in use: only its next trace walks it again
    again = _trace(model, x)
    assert torch.equal(again.output, first.output) and _module_addresses(again) == _module_addresses(first)
    alive = weakref.ref(model)
    del model, first, again
    gc.collect()
    assert alive() is None


def test_a_parameter_made_an_inference_tensor_by_data_assignment_is_still_seen():
    model, x = Net(), torch.randn(3, 4)
    _trace(model, x)
    with torch.inference_mode():
        frozen = torch.ones(2, 4)
    model.head.weight.data = frozen  # same Parameter object, now an inference tensor
    # The cached index serves the same Parameter object: the trace reads its new value, not a stale one.
    log = _trace(model, x)
    expected = torch.nn.functional.linear(log["norm"].activation, frozen, model.head.bias)
    assert torch.equal(log.output, expected)


def test_a_save_selection_finds_modules_by_the_cached_index_as_the_model_changes():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 4)
    first = _trace_saving(model, x, ["head"])
    assert first.saved_activations and all(first.ops[i].module_address in ("head", None)
                                           for i in first.saved_activations)
    model.final = model.head  # an alias: the same module under a second address
    del model.head
    model.forward = lambda x: model.final(model.norm(model.body(x)))
    with pytest.raises(UnmatchedSelection):
        _trace_saving(model, x, ["head"])  # the index was walked again: no module is called "head" now
    assert _trace_saving(model, x, ["final"]).saved_activations


def _trace_saving(model, x, save):
    with torch.no_grad():
        return tl.trace(model.eval(), x, save=save)


def _let_go(model, change: str):
    """Make ``change`` to a traced GPT-2 and return what the model no longer holds (a block, a head, a weight,
    a buffer)."""
    if change == "block removed":
        dropped = model.transformer.h[1]
        del model.transformer.h[1]
    elif change == "head replaced":
        dropped, model.lm_head = model.lm_head, nn.Linear(32, 99, bias=False)
    elif change == "parameter replaced":
        mlp = model.transformer.h[0].mlp.c_fc
        dropped, mlp.weight = mlp.weight, nn.Parameter(mlp.weight.detach().clone())
    else:  # a buffer replaced
        dropped = torch.zeros(4)
        model.register_buffer("steps", dropped)
        _trace(model, model.ids)
        model.steps = torch.ones(4)
    return dropped


@pytest.mark.parametrize("change", ["block removed", "head replaced", "parameter replaced", "buffer replaced"])
def test_what_a_traced_model_lets_go_is_not_kept_by_its_cached_index(change):
    """The cached index holds the modules, parameters and buffers of the model as it was when walked: a block
    deleted, a head replaced or a weight swapped out stayed in memory for as long as the model lived, until a
    next trace walked it again.  An index whose model changed is let go before a full collection."""
    import real_models  # transformers, imported here: the other tests of this file do without it

    model, _, kwargs = real_models.gpt2()
    model.ids = kwargs["input_ids"]
    _trace(model, model.ids)
    dropped = weakref.ref(_let_go(model, change))
    gc.collect()
    assert dropped() is None
    assert torch.equal(_trace(model, model.ids).output.logits, model(model.ids).logits)
