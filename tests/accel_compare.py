"""Tracing one run twice, on the compiled hot path and on the pure-Python path, and comparing what each
recorded: the raw capture state (every field of every call but its two clock readings, every tensor record,
the producers' bindings, what was saved and at which version, module calls, writes, failures) and the
finished trace (every column of ``trace.ops`` but durations, activations bit for bit).  Shared by the
compiled-path tests (``test_accel.py``, ``test_accel_module_calls.py``).
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn as nn

import torchlens as tl
import torchlens.capture.mode as mode_module
import torchlens.capture.session as session_module
from torchlens.record.columns import MODULE_CALL_T0_NS, MODULE_CALL_T1_NS

from accel_paths import on_path


@pytest.fixture
def states(monkeypatch):
    """The capture states of the traces run in a test, in order, and how each mode handled calls."""
    kept = []
    real_init = mode_module.CaptureMode.__init__

    def init(self, state, *args, **kwargs):
        real_init(self, state, *args, **kwargs)
        kept.append((state, type(self.__dict__.get(mode_module._HANDLER_KEY)).__name__))

    monkeypatch.setattr(mode_module.CaptureMode, "__init__", init)
    # What a failed capture recorded is compared too; the driver lets go of it once the exception is annotated.
    monkeypatch.setattr(session_module, "release_failed", lambda *released: None)
    return kept




def _same(a, b, where="") -> None:
    """Equal in type and value at every depth; tensors bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{where}: {len(a)} != {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), f"{where}: tensors differ"
    elif isinstance(a, nn.Module):  # each run builds its own model
        assert repr(a) == repr(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _bits(t):
    """A tensor's bytes (NaNs and signed zeros compared exactly)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8) if t.is_floating_point() else t


def _untimed(module_call):
    return [v for i, v in enumerate(module_call) if i not in (MODULE_CALL_T0_NS, MODULE_CALL_T1_NS)]


def _bindings(state):
    """``(bound strongly, record, version)`` of the producers' entries about live tensors (an entry about
    a dead tensor may have been replaced by one whose tensor reuses its id, as memory reuse decides)."""
    live = []
    for ref, index, version in state.producers.values():
        if type(ref) is not weakref.ref or ref() is not None:
            live.append((type(ref) is not weakref.ref, index, version))
    return sorted(live)


def _same_state(a, b) -> None:
    assert len(a.calls) == len(b.calls), "number of calls"
    for i, (x, y) in enumerate(zip(a.calls, b.calls)):
        assert len(x) == len(y) == 14
        _same(x[:8] + x[10:], y[:8] + y[10:], f"call {i}")
        assert x[9] >= x[8] and y[9] >= y[8]
    _same(a.records, b.records, "records")
    _same(_bindings(a), _bindings(b), "producers")
    assert list(a.saved) == list(b.saved), "saved records"
    for i in a.saved:
        x, y = a.saved[i], b.saved[i]
        assert x.dtype == y.dtype and x.shape == y.shape and x.requires_grad == y.requires_grad, i
        assert torch.equal(_bits(x), _bits(y)), f"saved {i}"
    _same(a.saved_versions, b.saved_versions, "saved versions")
    _same([_untimed(m) for m in a.module_calls], [_untimed(m) for m in b.module_calls], "module calls")
    _same(a.call_frames, b.call_frames, "call frames")
    _same(sorted(a.writers.values()), sorted(b.writers.values()), "writers")
    _same(sorted(a.alias_reads), sorted(b.alias_reads), "alias reads")
    _same(a.contexts, b.contexts, "contexts")
    _same(a.clobbered, b.clobbered, "clobbered")
    assert (a.unattributed, a.versionless, a.keyed_to) == (b.unattributed, b.versionless, b.keyed_to)
    assert sorted(a.param_writes) == sorted(b.param_writes)
    if a.raised_in is None:
        assert b.raised_in is None
    else:
        assert (type(a.raised_in[0]), str(a.raised_in[0]), a.raised_in[1]) == \
            (type(b.raised_in[0]), str(b.raised_in[0]), b.raised_in[1])
    if a.failure is None:
        assert b.failure is None
    else:
        (fa, ma, ea), (fb, mb, eb) = a.failure, b.failure
        assert (fa, ma, type(ea), str(ea)) == (fb, mb, type(eb), str(eb))


def _same_trace(a, b) -> None:
    x, y = a.to_pandas().drop(columns=["duration"]), b.to_pandas().drop(columns=["duration"])
    assert list(x.columns) == list(y.columns)
    for column in x.columns:
        assert repr(x[column].tolist()) == repr(y[column].tolist()), column  # NaN equal to NaN
    assert a.labels == b.labels and a.op_parents == b.op_parents
    assert [(str(op.source), op.modules) for op in a.ops] == [(str(op.source), op.modules) for op in b.ops]
    for p, q in zip(a.ops, b.ops):
        assert (p.activation is None) == (q.activation is None), p.label
        if p.activation is not None:
            assert p.activation.dtype == q.activation.dtype
            assert torch.equal(_bits(p.activation), _bits(q.activation)), p.label


def _both_ways(states, run, seed=0):
    """``run()`` traced with the compiled handler, on the pure-Python path, and with the compiled handler
    again, from the same RNG state: the first run may meet frames no trace has classified yet (the
    compiled handler hands those to the Python walk), the last meets only classified ones."""
    traces = []
    for enabled in (True, False, True):
        torch.manual_seed(seed)
        with on_path(enabled):
            traces.append(run())
    (cold_state, cold_kind), (pure_state, pure_kind), (compiled_state, compiled_kind) = states[-3:]
    assert pure_kind == "NoneType" and cold_kind == compiled_kind
    _same_state(cold_state, pure_state)
    _same_state(compiled_state, pure_state)
    if isinstance(traces[0], tl.Trace):
        _same_trace(traces[0], traces[1])
        _same_trace(traces[2], traces[1])
    return traces[1:], compiled_kind
