"""A trace inside the user's own instruments: their profiler, modes and function transforms.

What each instrument saw, and what is still installed afterwards, must be what it would be around an
untraced forward, or what docs/capture_honesty.md says it sees; a combination torchlens cannot serve is
refused with an error naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys

PROFILED_FIRST_TRACE = """
import importlib.machinery, sys
import torch
import torchlens as tl
from torch.profiler import ProfilerActivity, profile

model, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(2, 4, requires_grad=True)
with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
    before = set(sys.modules)
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    imported = set(sys.modules) - before
extension = lambda name: str(getattr(sys.modules[name], "__file__", "")).endswith(
    tuple(importlib.machinery.EXTENSION_SUFFIXES))
print(sorted(filter(extension, imported)))
print(len([event.name for event in prof.events()]) > 0)
"""


def test_the_first_trace_inside_a_users_stack_profiler_leaves_its_events_readable():
    # The first trace of a process imported torchlens-accel's compiled modules inside the block; torch's
    # Python tracer (with_stack=True) then held freed names, and prof.events() raised UnicodeDecodeError.
    env = dict(os.environ, TORCHLENS_ACCEL="1")
    run = subprocess.run([sys.executable, "-c", PROFILED_FIRST_TRACE], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:2] == ["[]", "True"], run.stdout
