"""kernel_profile's backward of a forward that hands a submodule to a thread pool: autograd numbers each thread's
grad nodes from that thread's own counter, so the worker's nodes may carry the numbers of the model thread's."""

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn

import torchlens as tl

_sequence_number = torch._C._autograd._get_sequence_nr


class _ExpertOnAWorker(nn.Module):
    """A gate on the calling thread, an expert on a thread pool's worker (a mixture of experts by hand)."""

    def __init__(self, pool):
        super().__init__()
        self.pool = pool
        self.gate = nn.Linear(16, 16)
        self.expert = nn.Sequential(nn.Linear(16, 16), nn.Tanh())

    def forward(self, x):
        h = torch.sigmoid(self.gate(x)).cos()
        return (self.pool.submit(self.expert, h).result(timeout=30) * h).sum()


def _numbering_from(target: int) -> int:
    """Makes grad nodes on this thread until its next node is numbered ``target``."""
    t = torch.ones(1, requires_grad=True)
    while _sequence_number() < target:
        t = t * 1
    return _sequence_number()


def _backward_by_op(offset: int) -> tuple:
    """A profile run on a new thread, with its worker's next grad node numbered ``offset`` after the new thread's
    (both count from 0): each op's backward aten op count, and the host work the profile found on no op."""
    torch.manual_seed(0)
    with ThreadPoolExecutor(1) as pool, ThreadPoolExecutor(1) as model_thread:
        model, x = _ExpertOnAWorker(pool), torch.randn(8, 16)
        assert pool.submit(_numbering_from, offset).result(timeout=30) == offset
        kp = model_thread.submit(tl.report.kernel_profile, model, x, backward=True).result(timeout=120)
    assert kp.complete, kp.coverage.problems
    return {r["op"]: r["bwd_aten_ops"] for r in kp.ops}, kp.coverage.host_unattributed


def test_the_backward_of_a_node_made_on_another_thread_lands_on_no_op_even_when_its_number_is_an_ops():
    """With the worker's counter where the model thread's was, the expert's backward (its Linear's and Tanh's
    nodes) went to the gate's ops whose nodes carried the same numbers; with the counters far apart it went, as it
    should, to no op.  The node's thread is read from the profile: it is the work of no op of the trace."""
    aligned, unattributed = _backward_by_op(0)
    apart, _ = _backward_by_op(1000)
    assert aligned == apart and apart["linear_1_1:1"] > 0
    assert unattributed["backward_without_op"][0] > 0  # the expert's nodes: no op of the trace made them
