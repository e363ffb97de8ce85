"""torchlens-accel's ``_reads`` (reads of torch state in C++) against the Python reads it replaces.

``CaptureState.check_saved_versions`` asks ``_reads.stale`` first and runs its own loop only where that
answers None.  Each case here builds the two dicts a trace keeps (``saved``: index -> tensor, and
``saved_versions``: index -> version when saved, or None) and checks that the compiled check gives the
Python loop's answer, or None where the Python loop must decide (subclasses, functorch wrappers, inference
tensors with a version, malformed entries).  ``any_autocast`` is checked against
``torch._C._is_any_autocast_enabled`` with autocast switched on for each device type torch accepts;
``versions`` and ``requires_grad`` (the parameters' reads as a trace begins and ends) against the
getters, and through a trace on either read.  The
end-to-end cases (a write that bypasses capture, beside an
inference tensor) are in tests/test_record.py, run on both paths by the Makefile.  Skipped, saying so,
when the module is not built; ``TORCHLENS_REQUIRE_ACCEL=1`` makes that a failure.
"""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
from accel_paths import compiled_or_skip, on_path
from torchlens.capture.state import CaptureState

_reads = compiled_or_skip("_reads")


def python_answer(saved: dict, versions: dict) -> list:
    state = CaptureState(save_mode=1)
    state.saved, state.saved_versions = dict(saved), dict(versions)
    return state._stale_in_python()


def test_unchanged_and_written_tensors_match_the_python_loop():
    tensors = [torch.randn(3) for _ in range(6)]
    saved = dict(enumerate(tensors))
    versions = {i: t._version for i, t in saved.items()}
    assert _reads.stale(saved, versions) == [] == python_answer(saved, versions)
    tensors[4].add_(1)
    tensors[1].mul_(2)
    assert _reads.stale(saved, versions) == [1, 4] == python_answer(saved, versions)


def test_a_detached_alias_shares_its_base_version():
    base = torch.randn(3, requires_grad=True)
    alias = (base * 2).detach()
    saved, versions = {0: alias}, {0: alias._version}
    alias.add_(1)
    assert _reads.stale(saved, versions) == [0] == python_answer(saved, versions)


def test_parameters_are_read_like_tensors():
    p = torch.nn.Parameter(torch.ones(2))
    saved, versions = {3: p}, {3: p._version}
    assert _reads.stale(saved, versions) == []
    with torch.no_grad():
        p.add_(1)
    assert _reads.stale(saved, versions) == [3] == python_answer(saved, versions)


def test_entries_without_a_version_are_skipped():
    with torch.inference_mode():
        frozen = torch.ones(2)
    written = torch.ones(2)
    saved, versions = {0: frozen, 1: written}, {0: None, 1: written._version}
    written.add_(1)
    assert _reads.stale(saved, versions) == [1] == python_answer(saved, versions)


class Tagged(torch.Tensor):
    pass


@pytest.mark.parametrize("saved, versions", [
    pytest.param({0: torch.ones(2).as_subclass(Tagged)}, {0: 0}, id="subclass"),
    pytest.param({0: torch.ones(2)}, {1: 0}, id="missing index"),
    pytest.param({0: torch.ones(2)}, {0: 0.0}, id="version not an int"),
])
def test_what_the_python_loop_must_decide_is_left_to_it(saved, versions):
    assert _reads.stale(saved, versions) is None


def test_an_inference_tensor_with_a_version_is_left_to_python():
    with torch.inference_mode():
        frozen = torch.ones(2)
    assert _reads.stale({0: frozen}, {0: 0}) is None


def test_a_tensor_a_functorch_transform_wrapped_is_left_to_python():
    inner = []
    torch.func.vmap(lambda row: inner.append(row) or row * 2)(torch.ones(3, 2))
    assert _reads.stale({0: torch.ones(2), 1: inner[0]}, {0: 0, 1: 0}) is None


def test_containers_other_than_dicts_are_left_to_python():
    assert _reads.stale({0: torch.ones(1)}, [0]) is None
    assert _reads.stale(type("Saved", (dict,), {})({0: torch.ones(1)}), {0: 0}) is None
    with pytest.raises(TypeError, match="two arguments"):
        _reads.stale({})


@pytest.mark.parametrize("without", [(), ("_reads",)], ids=["compiled check", "python check"])
def test_a_write_that_bypasses_capture_is_dropped_on_either_check(without):
    def f(x):
        y = x * 2
        with torch._C.DisableTorchFunction():
            y.add_(1)
        return y.sum()

    with on_path(True, without=without), pytest.warns(UserWarning, match="dropped saved activations.*mul_1_1:1"):
        log = tl.trace(f, torch.ones(2))
    assert set(log.dropped_activations) == {log["mul_1_1:1"].index}


_AUTOCAST_DEVICE_NAMES = ("cpu", "cuda", "xpu", "ipu", "hpu", "xla", "privateuseone", "mps", "mtia", "maia")


@pytest.mark.parametrize("device", _AUTOCAST_DEVICE_NAMES)
def test_any_autocast_answers_as_torch_for_each_device_type(device):
    assert _reads.any_autocast() is torch._C._is_any_autocast_enabled() is False
    try:
        previous = torch.is_autocast_enabled(device)
        torch.set_autocast_enabled(device, True)
    except (RuntimeError, ValueError):
        pytest.skip(f"torch has no autocast state for {device}")
    try:
        assert _reads.any_autocast() is torch._C._is_any_autocast_enabled()
    finally:
        torch.set_autocast_enabled(device, previous)
    assert _reads.any_autocast() is False


class AutocastInside(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.fc(x)
        return y.float() + 1


def test_an_op_run_under_autocast_inside_forward_is_noted_as_on_the_python_path():
    from torchlens.capture import mode

    with on_path(True):  # what a handler template takes when the compiled path is on
        assert mode._compiled_reads() == (_reads.any_autocast, _reads.fast_reads)
    model, x = AutocastInside(), torch.randn(2, 4)
    noted = {}
    for compiled in (True, False):
        with on_path(compiled):
            log = tl.trace(model, x)
        noted[compiled] = log._replay.contexts
        assert log["linear_1_1:1"].dtype == torch.bfloat16
        assert log.validate().passed
    assert noted[True] == noted[False] and len(noted[True]) == 1


def _mixed_outputs(x):
    nested = torch.nested.nested_tensor([x, x[:1]])  # its shape is not a torch.Size: the getters answer
    on_meta = torch.empty(2, 3, device="meta") + 1
    weight = torch.nn.Parameter(torch.ones(3))
    leaf = torch.ones(3, requires_grad=True)  # requires grad, no grad_fn
    return nested.sin(), on_meta, (x.to(torch.float16) * 2), (x * weight).sum(), x.t().contiguous(), leaf * 2


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_the_fast_tensor_reads_record_what_the_getters_record():
    """The compiled handler reads an output's fields through ``_reads.fast_reads`` (a nested tensor's
    through the getters); the pure-Python path reads torch's getters: the columns are the same."""
    x = torch.randn(2, 3)
    columns = {}
    for compiled in (True, False):
        with on_path(compiled):
            log = tl.trace(_mixed_outputs, x)
        columns[compiled] = [(op.label, op.shape, op.dtype, op.device, op.requires_grad, op.grad_fn) for op in log.ops]
    assert columns[True] == columns[False]
    assert {device.type for _, _, _, device, _, _ in columns[True]} == {"cpu", "meta"}
    assert {grad_fn for *_, grad_fn in columns[True]} >= {None, "MulBackward0", "SumBackward0"}


def test_the_context_read_answers_as_torch():
    """``fast_reads``'s grad-mode and autocast read, through a trace: an op run under no_grad or autocast
    inside the forward has its context noted on the compiled path exactly as on the Python path."""

    def f(x):
        with torch.no_grad():
            y = x * 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = torch.mm(y, y.t())
        return z.float() + x.sum()

    x = torch.randn(3, 3, requires_grad=True)
    noted = {}
    for compiled in (True, False):
        with on_path(compiled):
            noted[compiled] = tl.trace(f, x)._replay.contexts
    assert noted[True] == noted[False]
    # x * 2 under no_grad; y.t() and the mm under autocast
    assert sorted(noted[True].values(), key=repr) == [(False, {}), (True, {"cpu": torch.bfloat16}),
                                                      (True, {"cpu": torch.bfloat16})]


def test_versions_match_the_python_pass_and_leave_other_values_to_it():
    weights = [torch.nn.Parameter(torch.randn(2)) for _ in range(3)] + [torch.randn(2)]
    with torch.no_grad():
        weights[1].add_(1)
        weights[1].mul_(2)
    assert _reads.versions(weights) == [w._version for w in weights] == [0, 2, 0, 0]
    assert _reads.versions([]) == []
    with torch.inference_mode():
        frozen = torch.ones(1)
    subclass = type("Sub", (torch.Tensor,), {})(torch.ones(1))
    for undecided in ([weights[0], frozen], [subclass], [weights[0], 3], tuple(weights)):
        assert _reads.versions(undecided) is None


def test_requires_grad_flags_match_the_python_pass_and_leave_other_values_to_it():
    flags = [torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(2), requires_grad=False),
             torch.randn(2), torch.randn(2, requires_grad=True)]
    assert _reads.requires_grad(flags) == [t.requires_grad for t in flags] == [True, False, False, True]
    assert _reads.requires_grad([]) == []
    subclass = type("Sub", (torch.Tensor,), {})(torch.ones(1))
    for undecided in ([flags[0], subclass], [flags[0], 3], tuple(flags)):
        assert _reads.requires_grad(undecided) is None


@pytest.mark.parametrize("without", [(), ("_reads",)], ids=["compiled reads", "python reads"])
def test_a_parameter_written_unseen_is_noted_for_replay_on_either_read(without):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            y = self.lin(x)
            with torch.no_grad(), torch._C.DisableTorchFunction():
                self.lin.bias.add_(1)  # a write capture does not see: only the version moves
            return y

    model = Scaled()
    weight, bias = model.lin.weight, model.lin.bias
    before = weight._version, bias._version  # (initialising them in place moved both)
    with on_path(True, without=without):
        log = tl.trace(model, torch.ones(1, 2), save="none")
    replay = log._replay
    assert replay.param_versions.get(id(bias)) == bias._version == before[1] + 1
    assert replay.param_versions.get(id(weight)) == weight._version == before[0]
    assert id(bias) in replay.param_writes and id(weight) not in replay.param_writes
    assert replay.param_requires_grad.get(id(weight)) is True


@pytest.mark.parametrize("without", [(), ("_reads",)], ids=["compiled reads", "python reads"])
def test_frozen_parameters_are_recorded_as_frozen_on_either_read(without):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)
    with on_path(True, without=without):
        log = tl.trace(model, torch.ones(1, 2), save="none")
    flags = log._replay.param_requires_grad
    assert [flags.get(id(p)) for p in model.parameters()] == [False, False, True, True]


def test_same_layouts_matches_the_python_pass_and_leaves_other_values_to_it():
    from torchlens.record.layouts import param_layouts

    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    known = [(p.shape, p.dtype) for p in params]
    assert _reads.same_layouts(params, known) is True and param_layouts(params, known) is known
    params[1].data = torch.randn(5)  # new data, no version moved
    assert _reads.same_layouts(params, known) is False
    params[1].data = torch.randn(4, dtype=torch.float64)
    assert _reads.same_layouts(params, known) is False
    assert param_layouts(params, known) == [(params[0].shape, torch.float32), ((4,), torch.float64)]
    subclass = type("Sub", (torch.Tensor,), {})(torch.ones(1))
    for tensors, layouts in (([subclass], [((1,), torch.float32)]), (tuple(params), known),
                             (params, [(params[0].shape, "float32"), known[1]]), (params, [known[0], [(4,), 0]])):
        assert _reads.same_layouts(tensors, layouts) is None


@pytest.mark.parametrize("without", [(), ("_reads",)], ids=["compiled reads", "python reads"])
def test_traces_share_the_layouts_of_unchanged_parameters_on_either_read(without):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with on_path(True, without=without):
        first, second = (tl.trace(model, torch.ones(1, 2), save="none") for _ in range(2))
        model[1].weight.data = torch.zeros(3, 2)  # a resize in place: same Parameter, no version moved
        model[1].bias.data = torch.zeros(3)
        third = tl.trace(model, torch.ones(1, 2), save="none")
    assert first._replay.param_layouts._values is second._replay.param_layouts._values
    assert [p.shape for p in first.params] == [(2, 2), (2,), (2, 2), (2,)]
    assert [p.shape for p in third.params] == [(2, 2), (2,), (3, 2), (3,)]
