"""TorchScript on docs/capture_honesty.md, demonstrated: a scripted or jit-traced model is refused as the root;
scripted and jit-traced submodules, and those a traced callable calls from outside its model, are module
calls with no ops and a caveat naming them; a scripted function is no module, so the printed trace lists it
among the places a tensor no op made comes from.  Outputs are the untraced ones throughout."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from untouched import assert_clean_process


def test_a_torchscript_model_is_refused_naming_the_way_out():
    """A scripted or jit-traced model runs all its ops where capture cannot see them: a trace of it would
    hold none (a ScriptFunction gave such an empty trace; a ScriptModule crashed on its module table)."""
    x = torch.randn(2, 4)

    def double(t):
        return t * 2

    eager = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    for scripted in (torch.jit.trace(eager, x), torch.jit.script(eager), torch.jit.script(double)):
        with pytest.raises(TypeError, match=r"TorchScript .* trace the eager module or function it was made from"):
            tl.trace(scripted, x)


def test_a_torchscript_submodule_is_named_as_unseen():
    """TorchScript runs a scripted module's ops in its own interpreter: the trace records the call with no
    ops, says so in a caveat, and names where its output entered."""
    torch.manual_seed(0)
    model = nn.Sequential(torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh())), nn.ReLU())
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match=r"TorchScript modules \(0\) run their ops where capture cannot see them"):
        log = tl.trace(model, x)
    assert torch.equal(log.output, model(x))
    assert log.unattributed == 1 and [c.label for c in log.module_calls] == ["0:1", "1:1"]
    assert len(log.caveats) == 1 and "TorchScript" in log.caveats[0]
    assert "read by relu_1_1:1; returned by 0:1 (RecursiveScriptModule)" in str(log)
    plain = tl.trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), x)
    assert plain.caveats == () and "outside the trace" not in str(plain)


@torch.jit.script
def _scripted_double_relu(x):
    return torch.relu(x) * 2


class _CallsAScriptedFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(_scripted_double_relu(self.linear(x)))


def test_a_torchscript_function_called_by_the_forward_is_named_among_the_places_a_trace_cannot_see():
    """A scripted function is no module: nothing marks its call, so the printed trace says where a tensor no op
    made can come from, this among them, rather than leave the reader to guess."""
    torch.manual_seed(0)
    model, x = _CallsAScriptedFunction(), torch.randn(2, 4)
    log = tl.trace(model, x)
    assert torch.equal(log.output, model(x)) and log.unattributed == 1
    assert [op.label for op in log.ops if op.kind == "op"] == ["linear_1_1:1", "linear_1_1:2"]
    assert "read by linear_1_1:2; made where the trace cannot see: before the forward, on another thread" in str(log)
    assert "or inside a TorchScript or torch.compile'd function the forward called" in str(log)


def test_a_jit_traced_submodule_is_named_as_unseen_with_both_ways_it_was_made():
    torch.manual_seed(0)
    model = nn.Sequential(torch.jit.trace(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), torch.randn(2, 8)), nn.ReLU())
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match=r"TorchScript modules \(0\) run their ops where capture cannot see them"):
        log = tl.trace(model, x)
    assert torch.equal(log.output, model(x))
    assert log.caveats[0].endswith("trace the module as it was before torch.jit.script or torch.jit.trace to record "
                                   "its interior")
    assert "read by relu_1_1:1; returned by 0:1 (TopLevelTracedModule)" in str(log)


def test_a_torchscript_module_outside_the_model_or_beside_a_compiled_one_is_named_as_unseen():
    """A scripted module called by a traced callable (``root=``), or held next to a ``torch.compile``d
    submodule, is a module call with no ops, like one inside the model."""
    torch.manual_seed(0)
    scripted, root, x = torch.jit.script(nn.Linear(8, 8)), nn.Linear(8, 8), torch.randn(2, 8)
    with pytest.warns(UserWarning, match=r"TorchScript modules \(<unregistered RecursiveScriptModule #1>\)"):
        log = tl.trace(lambda t: root(scripted(t)) * 2, x, root=root)
    assert torch.equal(log.output, root(scripted(x)) * 2) and log.unattributed == 1
    assert [(c.label, len(c.ops)) for c in log.module_calls] == \
        [("<unregistered RecursiveScriptModule #1>:1", 0), ("self:1", 1)]

    model = nn.Sequential(torch.jit.script(nn.Linear(8, 8)), torch.compile(nn.Linear(8, 8), backend="eager"))
    with pytest.warns(UserWarning, match=r"TorchScript modules \(0\)"):
        log = tl.trace(model, x)
    assert torch.equal(log.output, model(x))
    assert [(c.label, c.module.class_name) for c in log.module_calls] == \
        [("0:1", "RecursiveScriptModule"), ("1:1", "Linear")]


class _WrapsAScriptedModule(nn.Module):
    """A Python module whose output its scripted child computes."""

    def __init__(self):
        super().__init__()
        self.inner = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))

    def forward(self, x):
        return self.inner(x)


def test_a_module_site_returning_what_a_scripted_child_made_is_refused_saying_no_op_made_it():
    """No op holds the value a scripted module returns, so no record could hold the edit: the refusal says where
    such a tensor comes from, not that the module passed an input through."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_WrapsAScriptedModule(), nn.Linear(4, 2)), torch.randn(3, 4)
    with pytest.raises(tl.InterventionError) as refused:
        tl.trace(model, x, intervene={"0": tl.scale(0.5)})
    message = str(refused.value)
    assert "module site '0': 0:1 returns at output (of shape (3, 4)) a tensor no op of the trace made" in message
    assert "inside a TorchScript or torch.compile'd function" in message and "passed through" not in message
    assert_clean_process()


@pytest.mark.parametrize("option", ["save", "grads"])
def test_a_selection_of_a_module_returning_only_what_a_scripted_child_made_is_refused_rather_than_empty(option):
    """The module ran, but no op of the trace made what it returned: selecting it would keep nothing."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_WrapsAScriptedModule(), nn.Linear(4, 2)), torch.randn(3, 4)
    with pytest.raises(tl.UnmatchedSelection, match=rf"{option}= entry '0' matched nothing: 0:1 returned only "
                                                     "tensors no op of the trace made"):
        tl.trace(model, x, **{option: ["0"]})
    assert [op.label for op in tl.trace(model, x, **{option: ["1"]}).ops if op.has_activation] in (
        ["linear_1_1:1", "output_1:1"], ["input_1:1", "linear_1_1:1", "output_1:1"])  # a module an op made works
    assert_clean_process()


def test_the_gradient_of_a_call_returning_what_a_scripted_child_made_is_refused_rather_than_none():
    """After a backward, the call's .grad was None, which reads as "no backward reached it": the gradient went
    through, but no op of the trace holds the value the call returned, so no hook received it."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_WrapsAScriptedModule(), nn.Linear(4, 2)), torch.randn(3, 4)
    log = tl.trace(model, x, grads=True)
    log.backward(log.output.sum())
    assert log["1"].grad is not None
    for call in ("0:1", "0.inner:1"):
        with pytest.raises(tl.GradientUnavailable, match=rf"{call} returned no op's value .*: read the gradient "
                                                          "of an op inside the call or one reading its output"):
            log[call].grad


@torch.jit.ignore
def _on_the_inter_op_pool(a):  # unannotated: a tensor in, one out (the file's annotations are strings)
    return torch.tanh(a) * 2


@torch.jit.script
def _fork_python(a: torch.Tensor) -> torch.jit.Future[torch.Tensor]:
    return torch.jit.fork(_on_the_inter_op_pool, a)


@torch.jit.script
def _wait_for(future: torch.jit.Future[torch.Tensor]) -> torch.Tensor:
    return torch.jit.wait(future)


class _ForksPythonWhileItRunsAModule(nn.Module):
    """TorchScript's fork runs a Python function on torch's inter-op pool while the forward runs ``fc``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        future = _fork_python(x * 2)
        return _wait_for(future) + self.fc(x)


@pytest.mark.parametrize("option", [{}, {"saved_for_backward": True}])
def test_a_python_function_torchscript_forks_onto_another_thread_is_not_recorded_into_the_trace(option):
    """Torch hands the forked task its forker's torch state, capture mode and saved-tensor hooks included: the ops
    of that thread were recorded into the trace, under whichever module the tracing thread was in then (``fc`` or
    none, as the threads met), and what they kept for backward was counted in the trace's ops.  Another thread's
    work is left out, as any is, and what it returned enters as a tensor of unknown origin."""
    torch.manual_seed(0)
    model, x = _ForksPythonWhileItRunsAModule(), torch.randn(2, 4, requires_grad=True)
    log = tl.trace(model, x, **option)
    assert torch.equal(log.output, model(x))
    assert [op.type for op in log.ops if op.kind == "op"] == ["mul", "linear", "add"] and log.unattributed == 1
    assert log["add_1_3"].parents == ["linear_1_2:1"]
    if option:  # the linear keeps its input and weight, as in a trace of fc alone; tanh's output is no op's
        alone = tl.trace(model.fc, x, **option)
        assert log.saved_for_backward_bytes == alone.saved_for_backward_bytes > 0
    assert_clean_process()
