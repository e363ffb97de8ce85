"""The compiled module-call recorder (torchlens-accel) records module calls as the Python recorder does:
call sites found by walking the frames, inputs and outputs bound to their producers, exceptions noted
where they left a call; and the common calls of transformers-style models never reach the Python one.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

import torchlens as tl

from torchlens.capture import call_impl

from accel_compare import _both_ways, _same_state, states  # noqa: F401 (states: a fixture)
from accel_paths import compiled_or_skip, on_path

compiled_or_skip("_capture")

# Each trace here sets its own path (_both_ways, on_path): the Makefile's pure-Python pass would repeat it.
pytestmark = pytest.mark.picks_its_path


class _Nested(nn.Module):
    """Module calls made from user code, by nn.Sequential, with keywords and several arguments."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
        self.pair = nn.Bilinear(4, 4, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append(type(call_impl.receiver()).__name__)
        h = self.seq(x)
        return self.pair(h, input2=x) + self.pair(x, h)


def test_module_calls_are_recorded_the_same_by_the_compiled_recorder(states):
    model, x = _Nested(), torch.randn(2, 4)
    _both_ways(states, lambda: tl.trace(model, x))
    assert model.seen == ["ModuleRecorder", "function", "ModuleRecorder"]
    assert len(states[-1][0].module_calls) == 8  # seq, its 3 children, the inner two, pair twice


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.fc, x, use_reentrant=False) + 1


def test_module_calls_from_torch_helpers_stay_in_c_and_record_the_same(states):
    """nn.TransformerEncoderLayer calls its attention, feed-forward and dropout modules from helpers of its
    forward (``_sa_block``, ``_ff_block``): the compiled recorder walks to the parent call's site itself,
    as the Python walk does, instead of handing those calls to the Python recorder."""
    from torchlens.capture import modules as modules_module

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)).eval()
    x = torch.randn(1, 5, 16)
    # Traced as the root, the layer's calls reach the trace driver with no user frame on the way.
    _both_ways(states, lambda: tl.trace(layer, x))
    assert states[-1][0].call_frames and set(states[-1][0].call_frames) == {(None, None)}
    _both_ways(states, lambda: tl.trace(model, x))
    # Called through torch code from a user forward: the user's line is the site.
    checkpointed = _Checkpointed().eval()
    _both_ways(states, lambda: tl.trace(checkpointed, x))
    (code, _), = states[-1][0].call_frames
    assert code is _Checkpointed.forward.__code__
    python_recorder = next(c for c in modules_module._python_recorder.__code__.co_consts
                           if getattr(c, "co_name", None) == "record_call")
    handed = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is python_recorder:
            handed.append(type(frame.f_locals.get("module")).__name__)

    with on_path(True):
        sys.setprofile(profile)
        try:
            trace = tl.trace(model, x)
        finally:
            sys.setprofile(None)
    assert handed == [], handed
    calls = states[-1][0].module_calls
    assert sum(type(c[0]) is nn.Dropout for c in calls) == 6  # two layers, each three dropouts, from helpers
    # Each call made inside a torch forward is sited where the enclosing call was made.
    assert len(set(states[-1][0].call_frames[1:])) == 1 and trace.output.shape == x.shape


class _Flat(nn.Module):
    """A module call with several positional arguments (tensors, None, numbers, a string) returning a flat
    tuple, as transformers layers make them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = _FlatInner()

    def forward(self, x):
        h, _ = self.inner(self.fc(x), None, 2, 0.5, True, "mean", self.fc.weight)
        return h


class _FlatInner(nn.Module):
    def forward(self, h, mask, k, scale, flag, how, weight):
        return (h * scale + weight.sum(), None)


def test_flat_argument_and_output_tuples_are_bound_in_c(states):
    from torchlens.capture import modules as modules_module

    model, x = _Flat(), torch.randn(2, 4)
    _both_ways(states, lambda: tl.trace(model, x))
    walker = next(c for c in modules_module._python_recorder.__code__.co_consts
                  if getattr(c, "co_name", None) == "bound_all")
    walked = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is walker:
            walked.append(frame.f_locals.get("value"))

    with on_path(True):
        sys.setprofile(profile)
        try:
            tl.trace(model, x)
        finally:
            sys.setprofile(None)
    assert walked == []
    pure = states[-3][0]  # _both_ways' pure-Python trace: its own flat loop, checked against the walker here
    for state in (states[-1][0], pure):
        fc = next(c for c in state.module_calls if type(c[0]) is nn.Linear)
        inner = next(c for c in state.module_calls if type(c[0]) is _FlatInner)
        # fc's output record, then the weight, made by no op; one output tensor, beside None.
        assert fc[5][0] >= 0 and inner[4] == (fc[5][0], -1)
        assert len(inner[5]) == 1 and inner[5][0] > fc[5][0]


def test_an_exception_leaving_module_calls_is_noted_the_same(states):
    class Inner(nn.Module):
        def forward(self, x):
            raise ValueError("inner fails")

    model, x = nn.Sequential(nn.Linear(2, 2), nn.Sequential(Inner())), torch.randn(1, 2)
    for enabled in (True, False):
        with on_path(enabled), pytest.raises(ValueError, match="inner fails"):
            tl.trace(lambda t: model(t), x, root=model)
    _same_state(states[-2][0], states[-1][0])
    assert states[-2][0].raised_in is not None
    assert type(call_impl.receiver()).__name__ == "function" and not call_impl.installed()  # nothing left in place


# ----- containers in, several tensors out: recorded by the compiled handler ------------------------
