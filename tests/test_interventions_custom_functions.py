"""An edit inside the forward of a custom ``torch.autograd.Function`` whose backward will run is refused: the
Function's own backward gives its gradient, unaware of the edit, so a backward through the edited trace gave the
gradients of the unedited Function beside the edited values.  Where no backward will run (under no_grad, or no input
requiring grad), and for an edit at the module that calls the Function, the edit is the one a forward hook makes."""

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from zoo import Square  # ctx given to forward


class SquareWithSetup(torch.autograd.Function):  # forward without ctx, setup_context after it
    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class Squarer(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function.apply(x)


class Model(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.fc, self.square, self.head = nn.Linear(4, 4), Squarer(function), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.square(self.fc(x)))


_SITE = "mul_1_2:1"  # the x * x inside the Function's forward


@pytest.fixture(scope="module", params=[Square, SquareWithSetup], ids=["ctx", "setup_context"])
def model(request):
    torch.manual_seed(0)
    return Model(request.param), torch.randn(3, 4)


def _hooked(model, x) -> tuple:
    """The output and the parameters' gradients with the Function's output scaled by a forward hook."""
    handle = model.square.register_forward_hook(lambda module, args, output: output * 1.5)
    output = model(x)
    output.pow(2).sum().backward()
    handle.remove()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return output, grads


@pytest.mark.parametrize("grads", [False, True])
def test_an_edit_inside_a_functions_forward_is_refused_where_its_backward_will_run(model, grads):
    model, x = model
    assert tl.trace(model, x)[_SITE].module == "square:1"
    with pytest.raises(tl.InterventionError, match="inside the forward of the custom autograd.Function Square"):
        tl.trace(model, x, grads=grads, intervene={_SITE: tl.scale(1.5)})


def test_where_no_backward_will_run_the_edit_is_the_hooks(model):
    model, x = model
    expected, _ = _hooked(model, x)
    with torch.no_grad():
        log = tl.trace(model, x, intervene={_SITE: tl.scale(1.5)})
    assert torch.equal(log.output, expected)


def test_an_edit_of_the_calling_module_has_the_hooks_gradients(model):
    model, x = model
    expected, expected_grads = _hooked(model, x)
    log = tl.trace(model, x, grads=True, intervene={"square": tl.scale(1.5)})
    log.backward(log.output.pow(2).sum())
    assert torch.equal(log.output, expected)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected_grads))
    model.zero_grad(set_to_none=True)


def test_a_probe_or_a_copy_inside_the_forward_changes_nothing_and_is_allowed(model):
    model, x = model
    seen = []
    log = tl.trace(model, x, intervene={_SITE: lambda t, op: seen.append(op.label)})
    copied = tl.trace(model, x, intervene={_SITE: lambda t, op: t.clone()})
    assert seen == [_SITE] and torch.equal(log.output, model(x)) and torch.equal(copied.output, log.output)


def test_a_copy_of_a_value_holding_nan_is_a_copy_and_is_allowed(model):
    model, x = model
    x = x.clone()
    x[0, 0] = float("nan")  # the row's values through fc and the square: NaN, as in an untraced run
    copied = tl.trace(model, x, intervene={_SITE: lambda t, op: t.clone()})
    torch.testing.assert_close(copied.output, model(x), rtol=0, atol=0, equal_nan=True)
    assert copied.output.isnan().any()


class Outer(torch.autograd.Function):  # runs Square inside its forward, where no_grad leaves Square unrecorded
    @staticmethod
    def forward(ctx, x):
        return Square.apply(x + 1) * 2

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_an_edit_inside_an_unrecorded_function_inside_a_recorded_one_is_refused_naming_the_outer():
    x = torch.randn(3, requires_grad=True)
    outer = lambda x: Outer.apply(x * 1.0)  # noqa: E731
    assert tl.trace(outer, x)["mul_2_3:1"].func_name == "mul"  # Square's x * x
    with pytest.raises(tl.InterventionError, match="custom autograd.Function Outer"):
        tl.trace(outer, x, intervene={"mul_2_3:1": tl.scale(2.0)})
