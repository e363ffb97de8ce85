"""The handler's shortcuts record exactly what its general paths record.

``F.linear(x, weight, bias)`` (the commonest call with parameters) and flat tuples of plain values
(``x[:t, :t]``, ``normalized_shape``) skip the general loop of ``capture/arguments.py``'s ``scan_arguments``;
whatever they skip, the skeleton, parents, parameters and versions must be those of the general scan,
and a trace through them the same as on the feature path, which never takes them.  Tensor properties
that torch's own modules read on every call are not ops, known before anything is scanned.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl
from torchlens.capture import arguments, mode
from torchlens.capture.state import CaptureState
from torchlens.record.columns import INPUT


def _general(st, args):
    """What the general scan gives for ``args`` without the shortcut: ``(skeleton, parents, params, versions)``."""
    skeleton, kw_skeleton, parents, params, versions = arguments.scan_arguments(st, args, mode._NO_KWARGS)
    assert kw_skeleton is mode._NO_KWARGS
    return skeleton, parents, params, versions


def _linear_cases():
    x, w, b = torch.randn(2, 4), nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3))
    return {"weight and bias": (x, w, b), "weight alone": (x, w), "bias None": (x, w, None)}


@pytest.mark.parametrize("bound", [True, False], ids=["input bound", "input unbound"])
@pytest.mark.parametrize("case", list(_linear_cases()))
def test_the_linear_scan_is_the_general_scan(case, bound):
    args = _linear_cases()[case]
    st, other = CaptureState(save_mode=0), CaptureState(save_mode=0)
    if bound:
        st.add_source(args[0], INPUT, "input.0")
        other.add_source(args[0], INPUT, "input.0")
    assert arguments.scan_linear(st, args) == _general(other, args)
    assert (st.unattributed, len(st.records)) == (other.unattributed, len(other.records))


def test_the_linear_scan_reads_inference_parameters_as_the_general_scan():
    with torch.inference_mode():
        w = nn.Parameter(torch.randn(3, 4))
    x = torch.randn(2, 4)
    st, other = CaptureState(save_mode=0), CaptureState(save_mode=0)
    assert arguments.scan_linear(st, (x, w)) == _general(other, (x, w))
    assert st.versionless and other.versionless


@pytest.mark.parametrize("value", [(slice(0, 2), slice(None)), (4,), (), (1, 2.0, None, Ellipsis, torch.float32)])
def test_a_flat_tuple_of_plain_values_is_held_as_the_container_walk_holds_it(value):
    x = torch.randn(4, 4)
    st = CaptureState(save_mode=0)
    skeleton, _, parents, params, versions = arguments.scan_arguments(st, (x, value), mode._NO_KWARGS)
    inner, found = arguments.scan_container(CaptureState(save_mode=0), value, 1, [], [])
    assert skeleton[1] is value and inner is value and found is None
    assert (len(parents), params, len(versions)) == (1, None, 1)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8, bias=False)
        self.register_buffer("mask", torch.tril(torch.ones(6, 6, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        h = self.fc(self.ln(x))
        scores = h @ h.transpose(-1, -2)
        scores = torch.where(self.mask[:6, :6], scores, -1e4)
        return self.head(F.softmax(scores, dim=-1) @ h) + F.linear(x, self.fc.weight)


def test_a_trace_through_the_shortcuts_is_the_feature_path_trace():
    from torchlens.capture import accel

    previous = accel.use(False)  # the pure-Python hot path, whatever is installed
    try:
        torch.manual_seed(0)
        model, x = _Block().eval(), torch.randn(6, 8)
        plain = tl.trace(model, x)
        featured = tl.trace(model, x, record_finite=True)  # every op on the feature path: no shortcut
    finally:
        accel.use(previous)
    summary = [(op.label, op.type, op.parents, tuple(op.shape), op.module) for op in plain.ops]
    assert summary == [(op.label, op.type, op.parents, tuple(op.shape), op.module) for op in featured.ops]
    assert sum(op.type == "linear" for op in plain.ops) == 3
    for a, b in zip(plain.ops, featured.ops):
        assert torch.equal(a.activation, b.activation), a.label


def test_properties_torch_modules_read_per_call_are_not_ops_on_either_path(monkeypatch):
    """``x.is_nested`` (read by every nn.TransformerEncoderLayer and MultiheadAttention call) is run
    unrecorded before any argument scan, not scanned, run and then found to produce no tensor."""
    from torchlens.capture import accel

    walked = []
    real = mode.output_leaves

    def counted(func, out, args, kwargs):
        if not isinstance(out, (torch.Tensor, tuple, list)):
            walked.append(func)
        return real(func, out, args, kwargs)

    monkeypatch.setattr(mode, "output_leaves", counted)
    monkeypatch.setattr(mode, "_templates", {})  # compiled handlers made with the counting helper
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(1, 4, 16)
    assert x.is_nested is False
    paths = [False] + ([True] if accel.available() else [])
    for compiled in paths:
        previous = accel.use(compiled)
        try:
            trace = tl.trace(layer, x)
        finally:
            accel.use(previous)
        assert torch.equal(trace.output, layer(x))
    assert walked == []
