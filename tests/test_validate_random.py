"""Validation and randomness: ops that drew random numbers are found by what they did and reported as not
replayed, never as mismatched, and every generator (torch's, NumPy's, Python's, a model's own) ends as after
one untraced forward."""

from __future__ import annotations

import copy
import os
import sys
import threading

import numpy
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402
from trusted import assert_trusted, random_labels  # noqa: E402


# ----- randomness by behaviour -------------------------------------------------------------------------
class Gumbel(nn.Module):
    def forward(self, x):
        return F.gumbel_softmax(x, tau=0.5) * 2


class SdpaDropout(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.3) + 1


class Binomial(nn.Module):
    def forward(self, p):
        return torch.binomial(torch.full_like(p, 10.0), p) - 1


class DirichletSample(nn.Module):
    def forward(self, concentration):
        return torch.distributions.Dirichlet(concentration).sample() * 3


RANDOM_CASES = {
    "transformer-layer-train": (lambda: nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).train(),
                                lambda: torch.randn(2, 5, 16)),
    "gumbel-softmax": (Gumbel, lambda: torch.randn(3, 6)),
    "sdpa-dropout": (SdpaDropout, lambda: torch.randn(1, 2, 5, 8)),
    "binomial": (Binomial, lambda: torch.rand(6)),
    "dirichlet-sample": (DirichletSample, lambda: torch.rand(4) + 0.5),
}


@pytest.mark.parametrize("name", sorted(RANDOM_CASES))
def test_random_ops_are_reported_not_replayed_never_mismatched(name):
    make, data = RANDOM_CASES[name]
    torch.manual_seed(0)
    model, x = make(), data()
    result = tl.validate(model, x)
    assert_trusted(result)
    assert random_labels(result), result.not_replayed
    assert result.replayed >= 1  # the deterministic ops around them still replay


def test_validate_leaves_the_rng_as_one_untraced_forward_does():
    make, data = RANDOM_CASES["transformer-layer-train"]
    torch.manual_seed(0)
    model, x = make(), data()
    untraced = copy.deepcopy(model)
    torch.manual_seed(5)
    untraced(x)
    expected = torch.get_rng_state()
    torch.manual_seed(5)
    tl.validate(model, x)
    assert torch.equal(torch.get_rng_state(), expected)
    torch.manual_seed(5)
    tl.trace(model, x).validate()
    assert torch.equal(torch.get_rng_state(), expected)  # replay drew numbers, and put them back


class EvalishDropout(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.5, training=False) + F.dropout(x, 0.0, training=True)


def test_deterministic_dropout_is_replayed():
    result = tl.validate(EvalishDropout(), torch.randn(3, 3))
    assert_trusted(result)
    assert not result.not_replayed and result.replayed == 3


class DrawsFromAGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = torch.Generator().manual_seed(3)

    def forward(self, x):
        return x + torch.randn(x.shape, generator=self.g)


def test_replay_never_advances_a_generator_passed_to_an_op():
    model = DrawsFromAGenerator()
    log = tl.trace(model, torch.zeros(4))
    state = model.g.get_state()
    result = log.validate()
    assert torch.equal(model.g.get_state(), state)
    assert random_labels(result) == {"randn_1_1:1"} and not result.mismatched


def test_a_callable_drawing_from_its_own_generator_is_not_compared_rather_than_failed():
    # The module is deep-copied for the untraced run, its generator with it: both runs draw the same numbers.
    assert tl.validate(DrawsFromAGenerator(), torch.zeros(4)).outputs_match is True
    # A lambda calling that module: the module's generator is put back between the runs, as the modules it calls are.
    model = DrawsFromAGenerator()
    assert tl.validate(lambda x: model(x), torch.zeros(4)).outputs_match is True
    # A lambda drawing from a generator it closes over: validation cannot put a generator it does not know back,
    # so the untraced and traced runs drew other numbers, and the outputs differ through no fault of the trace.
    closed_over = torch.Generator().manual_seed(3)
    result = tl.validate(lambda x: x + torch.randn(x.shape, generator=closed_over), torch.zeros(4))
    assert result.outputs_match is None and result.status != "failed"
    assert "randn_1_1:1 draws from a torch.Generator passed as generator=" in result.outputs_differ
    assert "outputs not compared: randn_1_1:1" in str(result)
    # A generator passed among the inputs is copied with them for the untraced run: compared, and moved once.
    passed, once = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    result = tl.validate(lambda x, g: x + torch.randn(x.shape, generator=g), (torch.zeros(4), passed))
    torch.randn(4, generator=once)
    assert result.outputs_match is True and torch.equal(passed.get_state(), once.get_state())
    # The global generator passed among the inputs is no copy's: it ends as one forward leaves it.
    draw = lambda x, g: x + torch.randn(x.shape, generator=g)  # noqa: E731
    torch.manual_seed(0)
    draw(torch.zeros(4), torch.default_generator)
    after_one = torch.get_rng_state()
    torch.manual_seed(0)
    assert tl.validate(draw, (torch.zeros(4), torch.default_generator)).outputs_match is True
    assert torch.equal(torch.get_rng_state(), after_one)
    # The global generator passed by name is one validation puts back: compared, and equal.
    lin = nn.Linear(4, 4)
    result = tl.validate(lambda x: lin(x) + torch.randn(x.shape, generator=torch.default_generator), torch.zeros(4))
    assert result.outputs_match is True


class Reseeds(nn.Module):
    """Reseeds torch's generator from the operating system before its dropout, as Reformer's reversible layers
    do in training mode (``torch.seed()``), so that no two runs draw the same numbers."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        torch.seed()
        return F.dropout(self.linear(x), 0.5, training=True)


def test_a_forward_reseeding_from_the_system_is_not_compared_rather_than_failed():
    # No traced run can match an untraced one: "outputs equal an untraced run: False", FAILED, on a faithful trace.
    torch.manual_seed(0)
    result = tl.validate(Reseeds(), torch.randn(4, 16))
    assert result.outputs_match is None and result.passed and not result.mismatched, result
    assert "two untraced runs from the same generator states gave different outputs" in result.outputs_differ
    assert random_labels(result) == {"dropout_1_2:1"}
    # A deterministic forward that differs is still a failure: the second untraced run agrees with the first.
    calls = []
    result = tl.validate(lambda x: x * 2 if calls.append(1) or len(calls) % 2 else x * 3, torch.ones(3))
    assert result.outputs_match is False and not result.passed and len(calls) == 3, result


class HostRandomMask(nn.Module):
    """Masks time steps chosen by NumPy's and Python's global generators in training mode, as transformers'
    wav2vec2 family does for SpecAugment (``_compute_mask_indices`` draws from ``numpy.random``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        import random

        keep = torch.ones(x.shape[0], 1)
        if self.training:
            keep[numpy.random.randint(0, x.shape[0])] = 0.0
            keep[random.randrange(x.shape[0])] = 0.0
        return self.fc(x * keep)


@pytest.mark.parametrize("seed", range(4))
def test_host_generators_are_restored_around_every_extra_run(seed):
    """The untraced reference of tl.validate and the label pass of an intervention draw from NumPy and
    Python too: the traced forward must draw what one untraced forward draws, and leave the generators
    where that forward leaves them."""
    import random

    model, x = HostRandomMask().train(), torch.randn(16, 4)

    def seeded():
        numpy.random.seed(seed), random.seed(seed), torch.manual_seed(seed)

    seeded()
    expected = model(x)
    after = numpy.random.get_state()[1].copy(), random.getstate()
    seeded()
    result = tl.validate(model, x)
    assert result.passed and result.outputs_match, result
    assert numpy.array_equal(numpy.random.get_state()[1], after[0]) and random.getstate() == after[1]
    seeded()
    log = tl.trace(model, x, intervene={"mul_1_4:1": tl.scale(1.0)})  # a label site: a reference pass first
    assert torch.equal(log.output, expected)
    assert numpy.array_equal(numpy.random.get_state()[1], after[0]) and random.getstate() == after[1]


class KeepsStateItCannotCopy(nn.Module):
    """A lock (no deep copy), a running sum in a list and a generator of its own: validation runs the model
    itself and must put all three back between its untraced and traced runs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.lock = threading.Lock()
        self.sums = [torch.zeros(4)]
        self.g = torch.Generator().manual_seed(2)

    def forward(self, x):
        self.sums[0].add_(x.sum(0))
        return self.fc(x) + self.sums[0] + torch.randn(4, generator=self.g)


def test_a_model_that_cannot_be_copied_gets_its_held_tensors_and_generators_back_between_the_runs():
    # The running sum in a list kept the untraced run's addition, so the traced run added it again and the
    # outputs were reported as differing; the generator's draws were reported as not compared.
    model, x = KeepsStateItCannotCopy(), torch.randn(3, 4)
    result = tl.validate(model, x)
    assert result.outputs_match is True, result.outputs_differ
    assert torch.equal(model.sums[0], x.sum(0))  # as after one forward
    once = torch.Generator().manual_seed(2)
    torch.randn(4, generator=once)
    assert torch.equal(model.g.get_state(), once.get_state())


_drift_calls = [0]


@torch.library.custom_op("torchlens_tests::drift", mutates_args=())
def _drift(x: torch.Tensor) -> torch.Tensor:
    """A kernel whose result varies from run to run without touching a generator (as torch.linalg.lstsq's does on
    the CPU, reading workspace it does not set): each call adds how many calls came before."""
    _drift_calls[0] += 1
    return x + _drift_calls[0]


@_drift.register_fake
def _(x):
    return torch.empty_like(x)


def test_an_op_whose_kernel_varies_from_run_to_run_is_not_replayed_not_called_a_mismatch():
    # validate reported such an op (lstsq on the CPU) as a MISMATCH, a failure the trace had no part in; running the
    # call once more shows that it gives other values on the same arguments.
    class Drifting(nn.Module):
        def forward(self, x):
            return _drift(x * 2) + 1

    log = tl.trace(Drifting(), torch.randn(3))
    result = log.validate()
    assert result.passed and [label for label, _ in result.not_replayed] == ["drift_1_2:1"]
    assert result.not_replayed[0][1].startswith("nondeterministic: run twice on the same arguments")
    steady = tl.trace(lambda x: torch.sin(x * 2), torch.randn(3)).validate()  # a deterministic op still replays
    assert steady.passed and not steady.not_replayed


def test_outputs_left_uncompared_for_such_an_op_name_it_not_a_reseeding_forward():
    # Its traced and untraced outputs differed, as did two untraced runs: validate said the forward drew from a
    # source it cannot put back (torch.seed(), the clock), though the cause was the op its own replay had found.
    class Drifting(nn.Module):
        def forward(self, x):
            return _drift(x * 2) + 1

    result = tl.validate(Drifting(), torch.randn(3))
    assert result.outputs_match is None and [label for label, _ in result.not_replayed] == ["drift_1_2:1"]
    assert "since drift_1_2:1 gave other values run twice on the same arguments" in result.outputs_differ
    assert "torch.seed()" not in result.outputs_differ and "drift_1_2:1" in str(result)


class ReseedsAfterAllReduce(Reseeds):
    """``Reseeds`` after summing its input over the ranks (``dist.all_reduce``), as a tensor-parallel layer does."""

    def forward(self, x):
        summed = x.clone()
        torch.distributed.all_reduce(summed)
        return super().forward(summed)


def test_a_forward_issuing_collectives_is_not_run_a_third_time():
    # Its outputs differ from run to run, and validate ran a third, untraced forward to tell so on this rank alone:
    # under several ranks its all_reduce waited for ranks that ran no such forward, until the group's timeout.
    import torch.distributed as dist

    runs = []
    model = ReseedsAfterAllReduce()
    model.register_forward_pre_hook(lambda module, args: runs.append(1))  # shared with validate's copy
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = tl.validate(model, torch.randn(4, 16))
    finally:
        dist.destroy_process_group()
    assert len(runs) == 2 and result.outputs_match is False and not result.passed, result
    assert "not run a third time" in result.outputs_differ and "collectives" in result.outputs_differ
