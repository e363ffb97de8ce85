"""Modules compiled in place (``module.compile()``): torch calls their ``_compiled_call_impl``, not
``_call_impl``, so a trace routes them (capture/compiled.py) and records them as it records a
``torch.compile(module)`` submodule."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.capture.compiled import EAGER_CAVEAT, InPlaceCompiledCall
from untouched import assert_clean_process


@pytest.fixture(autouse=True, scope="module")
def _collect_compile_garbage():
    yield
    gc.collect()


class Block(nn.Module):
    """Defined here, not in torch.nn: Dynamo compiles a user module's forward (torch.nn's own it skips)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x)) * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.block = Block()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.block(self.embed(x)).tanh())


def compiled_net(graphs=None):
    """The model with its block compiled in place; ``graphs`` collects each FX graph Dynamo compiles."""

    def backend(gm, example_inputs):
        if graphs is not None:
            graphs.append(gm)
        return gm.forward

    model = Net().eval()
    model.block.compile(backend=backend)
    return model, torch.randn(2, 4)


def test_a_module_compiled_in_place_runs_compiled_as_one_op_in_its_own_call():
    import torch._dynamo

    torch._dynamo.reset()
    graphs = []
    model, x = compiled_net(graphs)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # Dynamo warns when it meets torchlens's own code
        # torch's warning about the interpreter itself (CPython 3.13.0's slower guards) is not about torchlens
        warnings.filterwarnings("ignore", message="Guards may run slower on Python")
        log = tl.trace(model, x)  # the block's first call: Dynamo compiles it inside the trace
        expected = model(x)
    assert torch.equal(log.output, expected)
    assert len(graphs) == 1  # one graph, the block's: no graph break, no recompilation after the trace
    code = graphs[0].code
    assert "linear" in code and "gelu" in code and "torchlens" not in code
    assert [op.type for op in log.ops if op.kind == "op"] == ["linear", "compiled", "tanh", "linear"]
    assert log["compiled_1_2"].module == "block:1"
    assert [mc.label for mc in log.module_calls] == ["embed:1", "block:1", "head:1"]
    assert log.caveats == ()
    assert not isinstance(vars(model.block)["_compiled_call_impl"], InPlaceCompiledCall)
    assert "forward" not in vars(model.block)  # nothing of the routing is left on the module
    assert_clean_process()


def test_compiled_eager_traces_the_interior_of_a_module_compiled_in_place():
    model, x = compiled_net()
    with torch.no_grad(), pytest.warns(UserWarning, match="may differ from the compiled run"):
        log = tl.trace(model, x, compiled="eager")
    assert log.caveats == (EAGER_CAVEAT,)
    assert [op.type for op in log.ops if op.kind == "op"] == ["linear", "linear", "gelu", "mul", "tanh", "linear"]
    assert [mc.label for mc in log.module_calls] == ["embed:1", "block:1", "block.fc:1", "block.act:1", "head:1"]
    assert not isinstance(vars(model.block)["_compiled_call_impl"], InPlaceCompiledCall)
    assert_clean_process()


@pytest.mark.parametrize("option", ["save", "grads"])
@pytest.mark.parametrize("in_place", [True, False])
def test_selecting_a_module_inside_compiled_code_names_the_compiled_op_not_a_module_that_never_ran(option, in_place):
    """Under compiled="run" a module inside compiled code makes no module call: its whole interior is one
    compiled op, and the selection is told so, with the ways out (not that the module never ran)."""
    if in_place:
        model, x = compiled_net()
    else:
        model, x = Net().eval(), torch.randn(2, 4)
        model.block = torch.compile(model.block, backend="eager")
    with pytest.raises(tl.UnmatchedSelection, match=r"it ran inside 'block', a torch.compile'd module whose calls "
                                                    r"are each one compiled op, compiled_1_2:1: select 'block', or "
                                                    r"trace with compiled='eager'"):
        tl.trace(model, x, **{option: ["block.fc"]})
    with pytest.warns(UserWarning, match="may differ from the compiled run"):
        eager = tl.trace(model, x, save=["block.fc"], compiled="eager")
    assert eager["block.fc"].has_activation  # the way out it names
    assert_clean_process()


def test_hooks_on_a_module_compiled_in_place_are_refused_with_what_to_do():
    model, x = compiled_net()
    handle = model.block.register_forward_hook(lambda m, a, o: None)
    try:
        with pytest.raises(RuntimeError, match="compiled in place.*compiled='eager'"):
            tl.trace(model, x)
        assert not isinstance(vars(model.block)["_compiled_call_impl"], InPlaceCompiledCall)
        assert_clean_process()
        with pytest.warns(UserWarning, match="may differ from the compiled run"):
            log = tl.trace(model, x, compiled="eager")  # the way the message names
        assert [mc.label for mc in log.module_calls][:3] == ["embed:1", "block:1", "block.fc:1"]
    finally:
        handle.remove()


class _Slotted(nn.Linear):
    __slots__ = ("note",)  # one more reference beside its __dict__ once set


def test_modules_compiled_in_place_are_found_whatever_the_layout_of_their_references():
    from torchlens.capture.compiled import compiled_in_place

    plain, marked, slotted = nn.Linear(2, 2), nn.Linear(2, 2), _Slotted(2, 2)
    marked._compiled_call_impl = lambda *args, **kwargs: None  # the attribute module.compile() sets
    slotted.note = "set"
    assert compiled_in_place([plain, slotted]) == []
    assert compiled_in_place([plain, marked]) == [marked]
    slotted._compiled_call_impl = marked._compiled_call_impl
    assert compiled_in_place([slotted, plain]) == [slotted]


@pytest.mark.parametrize("how", ["wrapper", "in place"])
def test_a_module_inside_a_compiled_one_is_named_as_such_when_indexed(how):
    """log['block.fc'] of a module inside a compiled submodule said it never ran in this forward: it ran, inside
    the block's compiled op.  The error now says so, naming compiled='eager' and the address it records."""
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 4)
    if how == "wrapper":
        model.block = torch.compile(model.block, backend="eager")
    else:
        model.block.compile(backend="eager")
    log = tl.trace(model, x)
    keys = ["block.fc", "block.fc:1"] + (["block._orig_mod.fc"] if how == "wrapper" else [])
    for key in keys:
        with pytest.raises(KeyError, match=r"ran inside 'block', a torch.compile'd module whose calls are each one "
                                           r"compiled op, compiled_1_2:1: index 'block', or trace with "
                                           r"compiled='eager' to record it as block\.fc\)"):
            log[key]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the caveat that eager outputs may differ from the compiled run
        assert tl.trace(model, x, compiled="eager")["block.fc:1"].func_name == "linear"
