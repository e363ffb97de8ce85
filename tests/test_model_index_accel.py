"""The model-structure check on both paths: torchlens-accel's compiled ``Snapshot`` (``_index``) and the
pure-Python ``Structure`` (``record/model_index.py``).

Every change case is applied to a fresh model checked three ways at once (``Structure``, ``Snapshot``
with its dict-version shortcut and without it): all three must give the same answer, and the answer the
case expects, on the first check and on the ones after it.  The trace-level structure tests of
test_model_index_cache.py run once per path.  The compiled snapshot must hold exactly the references the
Python one holds (none to the root), leak none per check, and let a dropped model be freed.

Skipped, saying so, when the compiled module is not built; ``TORCHLENS_REQUIRE_ACCEL=1`` makes that a
failure instead.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from accel_paths import PATHS, compiled_or_skip, on_path
from torchlens.record import model_index
from torchlens.record.model_index import ModelIndex, Structure, index_of
from test_model_index_cache import Net, test_a_changed_structure_is_seen_by_the_next_trace as _trace_case


NATIVE = compiled_or_skip("_index")

# Each trace here sets its own path (on_path): the Makefile's pure-Python pass would repeat it.
pytestmark = pytest.mark.picks_its_path


def _checkers(model) -> dict:
    modules = list(ModelIndex(model).submodules.values())
    return {"python": Structure(model, modules), "compiled": NATIVE.Snapshot(model, modules),
            "compiled, every entry": NATIVE.Snapshot(model, modules, versions=False)}


def _answers(checkers: dict, model) -> dict:
    return {name: checker.unchanged(model) for name, checker in checkers.items()}


class Wide(nn.Module):
    """Submodules under an OrderedDict, a non-string key among the parameters, an alias."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.body._modules = OrderedDict(self.body._modules)
        self.norm = nn.BatchNorm1d(4)
        self.again = self.norm  # the same module under a second address


def _rotate(d: dict) -> None:
    first = next(iter(d))
    d[first] = d.pop(first)  # the same entries, the first now last


def _bump(d: dict) -> None:
    d["scratch"] = None  # a write that changes the dict's version and leaves its entries as they were
    del d["scratch"]


# name -> (change applied to a fresh Wide(), whether the structure is unchanged afterwards)
CASES = {
    "nothing": (lambda m: None, True),
    "eval()": (lambda m: m.eval(), True),
    "train(False) twice": (lambda m: (m.train(False), m.train(False)), True),
    "plain attribute": (lambda m: setattr(m.norm, "note", "not structure"), True),
    "parameter data assigned": (lambda m: setattr(m.body[0].weight, "data", torch.ones(4, 4)), True),
    "parameter updated in place": (lambda m: m.body[0].weight.data.add_(1), True),
    "same parameter assigned again": (lambda m: setattr(m.body[0], "weight", m.body[0].weight), True),
    "entry added and removed": (lambda m: _bump(m.norm._buffers), True),
    "entry added and removed, OrderedDict": (lambda m: _bump(m.body._modules), True),
    "__dict__ replaced by a copy": (lambda m: setattr(m.norm, "__dict__", dict(vars(m.norm))), True),
    "root __dict__ replaced by a copy": (lambda m: setattr(m, "__dict__", dict(vars(m))), True),
    "replace submodule": (lambda m: setattr(m, "norm", nn.BatchNorm1d(4)), False),
    "replace aliased submodule": (lambda m: setattr(m, "again", nn.BatchNorm1d(4)), False),
    "add submodule": (lambda m: setattr(m, "extra", nn.Tanh()), False),
    "delete submodule": (lambda m: delattr(m, "again"), False),
    "replace nested submodule": (lambda m: m.body.__setitem__(1, nn.Tanh()), False),
    "append to Sequential": (lambda m: m.body.append(nn.Tanh()), False),
    "move_to_end, OrderedDict": (lambda m: m.body._modules.move_to_end("0"), False),
    "reorder a dict": (lambda m: _rotate(m.norm._buffers), False),
    "replace parameter": (lambda m: setattr(m.body[0], "weight", nn.Parameter(torch.ones(4, 4))), False),
    "delete parameter": (lambda m: setattr(m.body[0], "bias", None), False),
    "register_parameter": (lambda m: m.norm.register_parameter("extra", nn.Parameter(torch.ones(1))), False),
    "replace buffer": (lambda m: setattr(m.norm, "running_mean", torch.zeros(4)), False),
    "add buffer": (lambda m: m.body[0].register_buffer("shift", torch.ones(4)), False),
    "delete buffer": (lambda m: delattr(m.norm, "num_batches_tracked"), False),
    "convert dtype": (lambda m: m.double(), False),
    "replace _parameters dict by a copy": (lambda m: setattr(m.body[0], "_parameters", dict(m.body[0]._parameters)),
                                           False),
    "replace _modules dict": (lambda m: setattr(m.body, "_modules", {"0": nn.Linear(4, 4)}), False),
    "replace root _buffers dict": (lambda m: setattr(m, "_buffers", {}), False),
    "__dict__ with a new _buffers": (lambda m: setattr(m.norm, "__dict__",
                                                       dict(vars(m.norm), _buffers=dict(m.norm._buffers))), False),
    "_buffers removed from __dict__": (lambda m: vars(m.norm).pop("_buffers"), False),
    "_modules made a custom mapping": (lambda m: setattr(m.body, "_modules", _Mapping(m.body._modules)), False),
    "__dict__ made a dict subclass": (lambda m: setattr(m.norm, "__dict__", _Mapping(vars(m.norm))), True),
    "same class assigned again": (lambda m: setattr(m.norm, "__class__", nn.BatchNorm1d), True),
    "another class assigned": (lambda m: setattr(m.norm, "__class__", _Norm), False),
    "another class assigned to the root": (lambda m: setattr(m, "__class__", _Wider), False),
}


class _Mapping(dict):
    pass


class _Norm(nn.BatchNorm1d):
    pass


class _Wider(Wide):
    pass


class _NoDict:
    __slots__ = ()


@pytest.mark.parametrize("case", list(CASES))
def test_every_change_is_seen_alike_on_both_paths(case):
    change, unchanged = CASES[case]
    torch.manual_seed(0)
    model = Wide()
    checkers = _checkers(model)
    assert set(_answers(checkers, model).values()) == {True}
    assert checkers["compiled"].versions == bool(NATIVE.HAVE_DICT_VERSIONS)
    assert not checkers["compiled, every entry"].versions
    change(model)
    for _ in range(3):  # the first check, and the ones after it (a shortcut remembered or not)
        answers = _answers(checkers, model)
        assert answers == dict.fromkeys(checkers, unchanged), answers


def test_an_equal_key_of_another_object_is_the_same_key():
    """Keys compare by equality on both paths: a key object replaced by an equal one, in its place."""
    model = Wide()
    checkers = _checkers(model)
    buffers = model.norm._buffers
    old = next(iter(buffers))
    new = "".join(list(old))
    assert new == old and new is not old
    values = list(buffers.items())
    buffers.clear()
    buffers.update((new if k == old else k, v) for k, v in values)
    assert next(iter(buffers)) is new
    assert _answers(checkers, model) == dict.fromkeys(checkers, True)


def test_a_custom_mapping_is_never_snapshotted_on_either_path():
    model = Wide()
    model.body._modules = _Mapping(model.body._modules)
    modules = list(ModelIndex(model).submodules.values())
    with pytest.raises(TypeError):
        Structure(model, modules)
    with pytest.raises(TypeError):
        NATIVE.Snapshot(model, modules)
    for make in (Structure, NATIVE.Snapshot):  # an object without a __dict__ among the modules
        with pytest.raises(TypeError):
            make(model, [*modules, _NoDict()])
    del model.body._modules
    for make in (Structure, NATIVE.Snapshot):
        with pytest.raises(KeyError):
            make(model, modules)
    for compiled in (True, False):
        with on_path(compiled):
            model = Wide()
            model.norm._buffers = _Mapping(model.norm._buffers)
            index_of(model)
            assert id(model) not in model_index._cache


@pytest.mark.parametrize("compiled", PATHS)
def test_the_cache_takes_the_path_in_use(compiled):
    with on_path(compiled):
        model = Net()
        first = index_of(model)
        assert isinstance(model_index._cache[id(model)][1], NATIVE.Snapshot if compiled else Structure)
        assert index_of(model) is first
        model.head = nn.Linear(4, 2)
        assert index_of(model) is not first


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("change", ["replace submodule", "rename submodule", "replace buffer", "convert dtype",
                                    "replace _modules dict", "replace __dict__", "delete parameter"])
def test_a_changed_structure_is_seen_by_the_next_trace_on_both_paths(compiled, change):
    with on_path(compiled):
        _trace_case(change)


def _referents_counts(objects) -> list:
    return [sys.getrefcount(o) for o in objects]


def _private_keys(model) -> None:
    """Give every key of the model's dicts a copy of its own.  Keys are interned strings the whole
    interpreter shares ("weight"), so any other thread's work could move their counts between two reads;
    a copy only this model holds is moved by nothing but the check under test.  Single characters are
    cached singletons that cannot be copied: ``_everything`` leaves them out."""
    for module in model.modules():
        for name in ("_modules", "_parameters", "_buffers"):
            d = vars(module)[name]
            for key in list(d):
                d["".join(list(key)) if isinstance(key, str) else key] = d.pop(key)  # order kept


def _everything(model) -> list:
    """Every object a snapshot may hold that only this model holds: modules, their dicts, keys and values,
    and the root."""
    _private_keys(model)
    found = [model, vars(model)]
    for module in model.modules():
        for name in ("_modules", "_parameters", "_buffers"):
            d = vars(module)[name]
            keys = [k for k in d if not (isinstance(k, str) and len(k) <= 1)]
            found += [d, *keys, *(v for v in d.values() if v is not None)]
        found.append(module)
    return found


def test_the_compiled_snapshot_holds_exactly_what_the_python_one_holds(no_collector):
    model = Wide()
    objects = _everything(model)
    modules = list(ModelIndex(model).submodules.values())
    before = _referents_counts(objects)
    python = Structure(model, list(modules))  # a list of its own, as index_of gives it
    held_by_python = [a - b for a, b in zip(_referents_counts(objects), before)]
    del python
    assert _referents_counts(objects) == before
    native = NATIVE.Snapshot(model, list(modules))
    held_by_native = [a - b for a, b in zip(_referents_counts(objects), before)]
    assert held_by_native[:2] == [0, 0]  # neither the root nor its __dict__
    # The same objects held (the Python path holds some twice: a non-empty dict in its snapshot and among
    # the dicts whose keys it reads), and nothing else.
    assert [n > 0 for n in held_by_native] == [n > 0 for n in held_by_python]
    assert all(0 <= n <= p for n, p in zip(held_by_native, held_by_python))
    del native
    assert _referents_counts(objects) == before


def test_checks_leak_no_reference(no_collector):
    model = Wide()
    objects = _everything(model)
    native = NATIVE.Snapshot(model, list(ModelIndex(model).submodules.values()))
    native.unchanged(model)
    before = _referents_counts(objects)
    for _ in range(200):
        assert native.unchanged(model)
    _bump(model.norm._buffers)  # the entries compared once, then the tag remembered
    for _ in range(200):
        assert native.unchanged(model)
    assert _referents_counts(objects) == before
    model.body._modules.move_to_end("0")  # changed: the checks return False, still leaking nothing
    before = _referents_counts(objects)
    for _ in range(200):
        assert not native.unchanged(model)
    assert _referents_counts(objects) == before
    del model.norm._buffers  # a module without the usual dicts: a KeyError inside, cleared
    before = _referents_counts(objects)
    for _ in range(200):
        assert not native.unchanged(model)
    assert _referents_counts(objects) == before


@pytest.mark.parametrize("compiled", PATHS)
def test_a_dropped_model_is_freed_with_its_index_cached(compiled):
    with on_path(compiled):
        model = Net()
        model.forward = lambda x: Net.forward(model, x)  # the root's __dict__ refers to the root
        with torch.no_grad():
            tl.trace(model.eval(), torch.randn(3, 4))
        key = id(model)
        assert key in model_index._cache
        alive = weakref.ref(model)
        parts = [weakref.ref(m) for m in model.modules()]
        del model
        gc.collect()
        assert alive() is None and not any(p() for p in parts)
        assert key not in model_index._cache


def test_a_snapshot_in_a_reference_cycle_is_collected():
    model = Wide()
    snapshot = NATIVE.Snapshot(model, list(ModelIndex(model).submodules.values()))
    model.norm.snapshot = snapshot  # snapshot -> norm -> norm.__dict__ -> snapshot
    alive, parts = weakref.ref(model), [weakref.ref(m) for m in model.modules()]
    del model, snapshot
    gc.collect()
    assert alive() is None and not any(p() for p in parts)
