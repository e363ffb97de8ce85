"""The tensor walker (``torchlens.tree``): which tensors it finds inside a value, and on which paths.

Every part of the package asks it (capture, module calls, outputs, validation, extraction), so its
answer is checked here case by case, and against a plain restatement of its rules on many values.
"""

from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict, namedtuple
from collections.abc import Mapping

import pytest
import torch

from torchlens.tree import MAX_DEPTH, structures_equal, tensor_leaves

Pair = namedtuple("Pair", "left right")


@dataclasses.dataclass
class Point:
    x: torch.Tensor
    label: str = "p"


class ChildPoint(Point):  # a subclass of a dataclass, not decorated itself: still a dataclass
    pass


class Output(OrderedDict):  # how transformers' ModelOutput is built: an OrderedDict subclass
    pass


class FrozenMap(Mapping):  # a Mapping that is not a dict
    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


class Holder:  # a plain object: walked only with attrs=True
    def __init__(self, t):
        self.t = t


class Sub(torch.Tensor):
    pass


def _reference(obj, path=(), depth=0, seen=None):
    """The walker's rules, restated plainly: tensors are leaves; tuples, lists, mappings and dataclass
    instances are walked in their own order; nothing deeper than MAX_DEPTH containers; no cycles."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if depth >= MAX_DEPTH or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return []
    if isinstance(obj, (tuple, list)):
        items = list(enumerate(obj))
    elif isinstance(obj, Mapping):
        items = list(obj.items())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    else:
        return []
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    found = [leaf for key, child in items for leaf in _reference(child, path + (key,), depth + 1, seen)]
    seen.discard(id(obj))
    return found


def _same(found, expected):
    assert [p for p, _ in found] == [p for p, _ in expected]
    assert all(a is b for (_, a), (_, b) in zip(found, expected))


def test_paths_in_depth_first_order():
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    value = (a, [b, (1, "x", None, c)], {"k": d, "n": 3})
    found = tensor_leaves(value)
    assert [p for p, _ in found] == [(0,), (1, 0), (1, 1, 3), (2, "k")]
    assert [t for _, t in found] == [a, b, c, d] and all(x is y for (_, x), y in zip(found, [a, b, c, d]))
    assert tensor_leaves(a, ("input",)) == [(("input",), a)]


def test_each_kind_of_container_and_leaf():
    t, p, s = torch.ones(2), torch.nn.Parameter(torch.ones(2)), torch.ones(2).as_subclass(Sub)
    cases = [
        (Pair(t, [p]), [(0,), (1, 0)]),
        (Point(t), [("x",)]),
        (ChildPoint(s), [("x",)]),
        (Output(logits=t, cache=None, hidden=(p, s)), [("logits",), ("hidden", 0), ("hidden", 1)]),
        (FrozenMap({"a": t, "b": [s]}), [("a",), ("b", 0)]),
        (Holder(t), []),  # a plain object is not walked by default
        ([True, 1.5, b"x", "t", None, 3], []),
        ((torch.float32, torch.device("cpu"), torch.strided, torch.contiguous_format), []),
        (Point, []),  # a dataclass type is not an instance
    ]
    for value, paths in cases:
        found = tensor_leaves(value)
        assert [path for path, _ in found] == paths, value
        _same(found, _reference(value))
    assert [path for path, _ in tensor_leaves(Holder(t), attrs=True)] == [("t",)]
    layer = Holder(t)  # as a key/value cache layer keeps its tensors: beside their dtype and device
    layer.dtype, layer.device, layer.inner = t.dtype, t.device, Holder(p)
    assert [path for path, _ in tensor_leaves(layer, attrs=True)] == [("t",), ("inner", "t")]


def test_depth_limit_and_cycles():
    t = torch.ones(1)
    deep = t
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert len(tensor_leaves(deep)) == 1  # a tensor MAX_DEPTH containers down is found
    assert tensor_leaves([deep]) == []  # one container deeper is not walked
    loop: list = [t]
    loop.append(loop)
    assert [path for path, _ in tensor_leaves(loop)] == [(0,)]
    shared = [t]
    assert [path for path, _ in tensor_leaves((shared, shared))] == [(0, 0), (1, 0)]  # not a cycle


def test_agrees_with_the_rules_on_random_values():
    rng = random.Random(0)
    tensors = [torch.full((1,), float(i)) for i in range(5)] + [torch.nn.Parameter(torch.ones(1)),
                                                                  torch.ones(1).as_subclass(Sub)]
    leaves = [1, 2.5, True, None, "s", b"b", torch.float32, torch.device("cpu"), slice(1, 2)]

    def value(depth):
        kind = rng.randrange(9) if depth < 5 else rng.randrange(2)
        if kind == 0:
            return rng.choice(tensors)
        if kind == 1:
            return rng.choice(leaves)
        items = [value(depth + 1) for _ in range(rng.randrange(4))]
        return [tuple(items), list(items), dict(enumerate(items)), Output(enumerate(items)),
                FrozenMap(enumerate(items)), Pair(*(items + [None, None])[:2]),
                Point(items[0] if items else None)][kind - 2]

    for _ in range(300):
        v = value(0)
        _same(tensor_leaves(v), _reference(v))


def test_structures_equal_walks_the_same_containers():
    t = torch.arange(3.0)
    assert structures_equal(Output(a=t, b=[t]), Output(a=t.clone(), b=[t.clone()])) == (True, "")
    same, why = structures_equal(Output(a=t), Output(a=t + 1))
    assert not same and "output.a" in why
    same, why = structures_equal(Point(t), Point(t, "q"))
    assert not same and "output.label" in why


def test_clone_inputs_copies_objects_holding_tensors_and_warns_when_it_cannot():
    import threading

    from torchlens.copies import clone_call, clone_inputs

    t = torch.ones(2)
    holder = Holder(t)
    copied = clone_inputs((holder, t))
    assert copied[0] is not holder and copied[0].t is copied[1]  # aliasing kept across the copy
    assert copied[1] is not t and torch.equal(copied[1], t)
    args, kwargs = clone_call((t,), {"mask": t, "state": holder})  # one memo for both
    assert args[0] is kwargs["mask"] is kwargs["state"].t and args[0] is not t
    locked = Holder(t)
    locked.lock = threading.Lock()  # cannot be deep-copied
    with pytest.warns(UserWarning, match="could not copy a Holder input"):
        assert clone_inputs(locked) is locked


def test_clone_call_keeps_overlapping_inputs_views_of_one_copy_of_what_they_span():
    """Inputs whose memory overlaps stay views of one copy (a write through one shows in the other), a copy
    of the span they cover only: features and targets sliced from one batch of a dataset tensor do not copy
    the dataset; an input that overlaps none is cloned alone."""
    from torchlens.copies import clone_call

    data = torch.randn(1000, 20)
    batch = data[100:132]
    features, targets, far = batch[:, :10], batch[:, 10:], data[500:510]
    (f, t, other), kwargs = clone_call((features, targets, far), {"again": batch})
    assert [torch.equal(a, b) for a, b in ((f, features), (t, targets), (other, far), (kwargs["again"], batch))] \
        == [True] * 4
    assert f.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() == \
        kwargs["again"].untyped_storage().data_ptr()
    assert f.untyped_storage().nbytes() == batch.numel() * 4 and other.untyped_storage().nbytes() == far.numel() * 4
    kwargs["again"][0, 0] = 7.0
    assert f[0, 0] == 7.0 and batch[0, 0] != 7.0  # the copies alias each other, never the caller's tensors


def test_structures_equal_tells_layouts_apart():
    """A sparse tensor and a dense one with its values are two results: one comparison (the outputs' in
    tl.validate, each replayed op's, measure_overhead's) says so, and names the layouts."""
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    same, why = structures_equal(dense.to_sparse(), dense)
    assert not same and "sparse_coo" in why and "strided" in why
    assert structures_equal(dense.to_sparse(), dense.clone().to_sparse()) == (True, "")
    assert structures_equal(dense.to_sparse_csr(), dense.clone().to_sparse_csr()) == (True, "")
    assert not structures_equal(dense.to_sparse_csr(), (dense + 1).to_sparse_csr())[0]


def test_tolerances_apply_to_floating_values_only():
    ids = torch.tensor([100_000, 7])
    assert not structures_equal(ids, ids + 1, exact=False, rtol=1e-5, atol=1e-6)[0]
    assert structures_equal(ids, ids.clone(), exact=False, rtol=1e-5)[0]
    assert structures_equal(torch.tensor([1e5]), torch.tensor([1e5 + 0.5]), exact=False, rtol=1e-5)[0]
    mask = torch.tensor([True, False])
    assert not structures_equal(mask, ~mask, exact=False, atol=1.0)[0]
