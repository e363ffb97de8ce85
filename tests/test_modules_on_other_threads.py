"""Module calls a forward hands to another thread (a thread pool's worker running the experts of a mixture).

Capture records the tracing thread's calls and ops only (docs/capture_honesty.md): a trace whose model's modules ran
on another thread says so in ``log.caveats`` (and warns once), naming them, and a selection naming one of them says
that it ran on another thread only, not that it never ran.  Both capture paths note those calls the same way: the
compiled module recorder hands another thread's call to the Python one, which notes it.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from torchlens.capture.call_impl import Replacement  # noqa: E402
from untouched import assert_clean_process  # noqa: E402

_CAVEAT = "modules ran on another thread while the trace ran"
_ELSEWHERE = r"it ran on another thread only, where a trace records no call and no op: make its calls on the thread"


class _ExpertsOnAThreadPool(nn.Module):
    """A mixture of experts by hand: each expert (a Linear and a Tanh) runs on a thread pool's worker, the gate on
    the calling thread."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])

    def forward(self, x):
        weights = self.gate(x).softmax(-1)
        with ThreadPoolExecutor(2) as pool:
            outputs = [future.result(timeout=30) for future in [pool.submit(e, x) for e in self.experts]]
        return sum(weights[:, i:i + 1] * out for i, out in enumerate(outputs))


def _caveat(log) -> str:
    return next(caveat for caveat in log.caveats if caveat.startswith(_CAVEAT))


def test_experts_run_on_a_thread_pool_are_named_in_a_caveat():
    """The trace said nothing of the experts' calls, which it did not record, but for the printed trace's general
    note on tensors from outside the trace."""
    model, x = _ExpertsOnAThreadPool(), torch.randn(3, 4)
    with pytest.warns(UserWarning, match=_CAVEAT):
        log = tl.trace(model, x)
    assert torch.equal(log.output, model(x))
    assert [call.label for call in log.module_calls] == ["gate:1"]
    caveat = _caveat(log)
    assert caveat.startswith(f"{_CAVEAT} (experts.0, experts.0.0, experts.0.1 and 3 more): a trace records the calls "
                             "and ops of its own thread only, so their calls and ops are not recorded")
    assert caveat.endswith("make those calls on the thread that calls tl.trace to record them")
    assert "caveat: " + caveat in str(log)
    assert_clean_process()


def test_a_selection_naming_a_module_run_on_another_thread_says_so(tmp_path):
    """save=, grads= and tl.extract(layers=) said "that module exists but never ran in this forward"."""
    model, x = _ExpertsOnAThreadPool(), torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CAVEAT)
        with pytest.raises(tl.UnmatchedSelection, match=rf"save= matched nothing for it \({_ELSEWHERE}"):
            tl.trace(model, x, save=["experts.0"])
        with pytest.raises(tl.UnmatchedSelection, match=rf"grads= matched nothing for it \({_ELSEWHERE}"):
            tl.trace(model, x, grads=["experts.1.0"])
        with pytest.raises(KeyError, match=rf"layers= matched nothing for it \({_ELSEWHERE}"):
            tl.extract(model, [x], ["experts.0.1"], tmp_path / "x", progress=False)
    model.spare = nn.Linear(4, 4)  # a module no thread ran: as before
    with pytest.raises(tl.UnmatchedSelection, match=r"\(that module exists but never ran in this forward\)"), \
            pytest.warns(UserWarning, match=_CAVEAT):
        tl.trace(model, x, save=["spare"])
    assert_clean_process()


class _OnAWorker(nn.Module):
    """Runs the module it wraps on a worker thread, as a wrapper that offloads a block does."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(self.inner, *args, **kwargs).result(timeout=30)


def test_a_transformers_block_run_by_a_wrapper_on_a_worker_thread_is_named_in_a_caveat():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=16, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).eval()
    model.h[1].mlp = _OnAWorker(model.h[1].mlp)
    ids = torch.randint(0, 64, (2, 5))
    with pytest.warns(UserWarning, match=_CAVEAT):
        log = tl.trace(model, (), {"input_ids": ids})
    assert torch.equal(log.output.last_hidden_state, model(input_ids=ids).last_hidden_state)
    assert _caveat(log).startswith(f"{_CAVEAT} (h.1.mlp.inner, h.1.mlp.inner.c_fc, h.1.mlp.inner.c_proj and 2 more)")
    assert "h.1.mlp:1" in [call.label for call in log.module_calls]  # the wrapper's own call, on the tracing thread
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CAVEAT)
        with pytest.raises(tl.UnmatchedSelection, match=rf"save= matched nothing for it \({_ELSEWHERE}"):
            tl.trace(model, (), {"input_ids": ids}, save=["h.1.mlp.inner.c_fc"])
    assert_clean_process()


class _MeetsAnotherTrace(nn.Module):
    """Waits until two threads are inside its forward (so both traces are in place), calls ``fc``, and hands
    ``expert`` to a worker."""

    def __init__(self):
        super().__init__()
        self.fc, self.expert = nn.Linear(4, 4), nn.Linear(4, 4)
        self.both_inside = threading.Barrier(2)

    def forward(self, x):
        self.both_inside.wait(30)
        hidden = self.fc(x)
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(self.expert, hidden).result(timeout=30)


def test_a_call_of_another_trace_s_own_thread_is_not_named_by_this_trace():
    """Two threads tracing one model: each one's calls of ``fc`` are its own trace's, recorded there, and not named
    by the other trace as calls made on another thread; the worker's calls of ``expert`` are."""
    model, x, logs = _MeetsAnotherTrace(), torch.randn(2, 4), {}

    def run(name):
        logs[name] = tl.trace(model, x)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CAVEAT)
        threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    for log in logs.values():
        assert [call.label for call in log.module_calls] == ["fc:1"]
        assert _caveat(log).startswith(f"{_CAVEAT} (expert): ")
    assert_clean_process()


def test_a_call_made_by_a_thread_whose_trace_is_paused_is_not_noted_by_the_others():
    """A tracing thread whose recording is paused (a compiled region running) calls modules meanwhile through the
    dispatcher of the other traces: its calls are its own trace's, not calls of a thread that does not trace."""

    def make_recorder(impl, relays):
        return lambda module, *args, **kwargs: impl(module, *args, **kwargs)

    fc, x, seen = nn.Linear(2, 2), torch.randn(1, 2), {name: set() for name in "abc"}
    held = {"a": Replacement(make_recorder, elsewhere=seen["a"])}
    c_in_place, c_done = threading.Event(), threading.Event()

    def on_a_thread(work):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join(30)

    def trace_c():  # alive until the end: a thread ends, and another may be given its id
        held["c"] = Replacement(make_recorder, elsewhere=seen["c"])
        held["c"].acquire()
        c_in_place.set()
        c_done.wait(30)

    def paused_b():
        b = Replacement(make_recorder, elsewhere=seen["b"])
        b.acquire()
        try:
            b.pause()
            fc(x)
        finally:
            b.release_all()

    c = threading.Thread(target=trace_c)
    try:
        held["a"].acquire()
        c.start()
        assert c_in_place.wait(30)
        on_a_thread(paused_b)
        assert seen["a"] == seen["c"] == set()
        on_a_thread(lambda: fc(x))  # a thread that does not trace: noted by both traces
        assert seen["a"] == seen["c"] == {id(fc)}
    finally:
        c_done.set()
        c.join(30)
        for replacement in held.values():
            replacement.release_all()
    assert_clean_process()
