"""The capture handler's inlined frame checks find the same call sites as ``FrameClassifier.locate``.

The handler answers the commonest frame shapes without walking: an op called from user code, an op
called straight from a torch module's ``forward`` (the module call's boundary is the next frame), and a
Python-level torch function (``F.relu``, ``F.softmax``) called from either.  Every other shape, and these
with the shortcuts switched off, goes through ``locate``; the records must not differ in any op's user
frame, instruction offset or site.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl
from torchlens.capture import mode


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.act = nn.ReLU()

    def forward(self, x):
        return F.softmax(self.act(self.norm(self.fc(x))), dim=-1) * 2


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.seq = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        # F.relu called from a torch method that is not a forward (TransformerEncoderLayer._ff_block)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x):
        x = self.inner(x)
        x = self.seq(x) + x  # torch code (Sequential) calling torch modules
        x = self.head.forward(x)  # no module call: the forward's caller is this line
        x = F.layer_norm(F.relu(x), (8,))  # Python-level torch functions called from user code
        x = x + self.attn(x[None], x[None], x[None], need_weights=False)[0][0]
        x = self.layer(x[None])[0]
        for _ in range(2):
            x = torch.tanh(self.head(torch.cat([x, x], dim=-1)[..., :8]))
        return x


def _sites(trace) -> list:
    return [(c.code, c.line, c.site) for c in trace.calls]


@pytest.mark.parametrize("root", [Model, lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))])
def test_inlined_frame_checks_agree_with_the_walk(root, monkeypatch):
    # The pure-Python handler's shortcuts (test_accel.py holds the compiled handler's to this path).
    monkeypatch.setattr("torchlens.capture.accel._enabled", False)
    torch.manual_seed(0)
    model, x = root().eval(), torch.randn(2, 8)
    tl.trace(model, x)  # the first sight of a frame classifies it, through the walk
    walks = []

    def counted(classifier, frame, *args):
        walks.append(frame)
        return locate(classifier, frame, *args)

    locate = mode.FrameClassifier.locate
    monkeypatch.setattr(mode.FrameClassifier, "locate", counted)
    fast = tl.trace(model, x)
    fast_walks = len(walks)
    monkeypatch.setattr(mode, "called_by_module_call", lambda frame: False)
    # The full walk from the frame that called the handler, for every op not called from user code.
    monkeypatch.setattr(mode, "dispatched_site", lambda frame, func, call_frames, module_call, locate:
                        locate(frame, func, call_frames, module_call))
    walks.clear()
    walked = tl.trace(model, x)
    assert fast_walks < len(walks)  # the shortcuts were taken
    assert fast.labels == walked.labels
    assert _sites(fast) == _sites(walked)


def test_ops_inside_torch_modules_report_the_line_that_called_the_module():
    torch.manual_seed(0)
    trace = tl.trace(Model().eval(), torch.randn(2, 8))
    calling_line = {op.source.line for op in trace.ops if op.kind == "op" and op.module == "inner.fc:1"}
    assert len(calling_line) == 1  # F.linear inside nn.Linear.forward: the line in Inner.forward
    (line,) = calling_line
    assert "self.fc(x)" in trace.ops[next(i for i, op in enumerate(trace.ops) if op.module == "inner.fc:1")].source.code
    assert line > 0


class BuildsLayers(nn.Module):
    """Builds its layers inside the forward: torch's ``nn.Linear.__init__`` calls ``torch.empty`` from one
    line of torch's own code, reached from two lines here, then from one line run twice."""

    def forward(self, x):
        first = nn.Linear(4, 4)
        second = nn.Linear(4, 4)
        x = second(first(x))
        for _ in range(2):
            x = nn.Linear(4, 4)(x)
        return x


def test_torch_code_reached_from_two_user_lines_is_two_layers_and_from_a_loop_two_passes():
    trace = tl.trace(BuildsLayers(), torch.randn(2, 4))
    empties = [op for op in trace.ops if op.func_name == "empty"]
    lines = [op.source.line for op in empties]
    assert len(empties) == 8 and len(set(lines)) == 3  # two per Linear: weight and bias
    by_line = {}
    for op in empties:
        by_line.setdefault(op.source.line, set()).add(op.layer_label)
    built_once, built_twice, in_the_loop = (by_line[line] for line in sorted(by_line))
    assert len(built_once) == len(built_twice) == 2 and not built_once & built_twice
    assert len(in_the_loop) == 2  # the loop's two Linears: passes of the same two layers
    assert sorted(op.pass_index for op in empties if op.layer_label in in_the_loop) == [1, 1, 2, 2]
