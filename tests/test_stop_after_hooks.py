"""``stop_after=`` and the module hooks registered with ``always_call=True``.

A stop ends the forward with a BaseException, which torch's ``_call_impl`` lets through without the
always-called forward hooks it runs for a call an exception leaves; the trace runs them itself, so that a
pre-hook and its always-called hook (a stack of one's own, torch's composable ``checkpoint``, FSDP2) stay
paired.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

import torchlens as tl
from accel_paths import PATHS, on_path


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.block, self.head = nn.Linear(4, 8), _Block(), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.block(self.emb(x)))


def _stops(model, x) -> list:
    """The ``stop_after=`` options to try: a module site, and the label of the op that module returns (a stop
    inside the op), each with a plain trace as the reference, so that the stopped run is the only forward."""
    plain = tl.trace(model, x)
    label = next(c for c in plain.module_calls if c.address == "block.fc1").output_ops[0]
    return [{"stop_after": site, "reference": plain} for site in ("block.fc1", label)]


@pytest.mark.parametrize("compiled", PATHS)
def test_a_stop_runs_the_always_called_hooks_of_the_calls_it_leaves(compiled, tmp_path):
    # They were skipped: the open calls' modules stayed on a stack kept by a global pre-hook and an always-called
    # global hook, as an exception in the forward never leaves them.
    model, x = _Model(), torch.randn(2, 4)
    stack, ended = [], []

    def enter(module, args):
        stack.append(module)

    def leave(module, args, output):
        ended.append((module, output is None))
        stack.pop()

    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave, always_call=True)]
    try:
        with on_path(compiled):
            for stop in _stops(model, x):
                stack.clear()
                ended.clear()
                tl.trace(model, x, **stop)
                assert stack == []
                # the stopped call's own hook ran once, as it returned (a module site's call did, an op's did not);
                # the calls around it as torch runs them for an exception, given no result
                returned = stop["stop_after"] == "block.fc1"
                fc1 = (model.block.fc1, not returned)
                assert ended == [(model.emb, False), fc1, (model.block, True), (model, True)]
            stack.clear()
            tl.extract(model, [x], ["emb"], str(tmp_path / "early"), stop_after="block.fc1", progress=False)
            assert stack == []
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("compiled", PATHS)
def test_a_stop_inside_a_checkpointed_block_leaves_the_checkpoint_closed(compiled):
    # torch's composable checkpoint opens its saved-tensor hooks in a pre-hook and closes them in an always-called
    # hook: a stop inside the block left them pushed, and every later backward in the thread failed with
    # "Recomputed values for the following tensors have different metadata than during the forward pass".
    from torch.distributed._composable import checkpoint

    model, x = _Model(), torch.randn(2, 4)
    checkpoint(model.block)
    for stop in _stops(model, x):
        with on_path(compiled):
            tl.trace(model, x, **stop)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        model(x).sum().backward()
        reference = _Model()  # the same weights, never traced nor checkpointed
        reference(x).sum().backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
        model.zero_grad()


@pytest.mark.parametrize("compiled", PATHS)
def test_an_always_called_hook_raising_at_a_stop_is_said_and_the_stop_goes_on(compiled):
    model, x = _Model(), torch.randn(2, 4)

    def fails(module, args, output):
        raise ValueError("no output to log")

    handle = model.block.register_forward_hook(fails, always_call=True)
    try:
        with on_path(compiled), pytest.warns(UserWarning, match="silenced as the forward stopped at stop_after=: "
                                                                "no output to log"):
            log = tl.trace(model, x, stop_after="block.fc1")
    finally:
        handle.remove()
    assert log.stopped_after == "block.fc1:1" and log.output is None
