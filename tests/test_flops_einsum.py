"""FLOPs of ``torch.einsum``: every equation form torch accepts (ellipses and their broadcasting, implicit outputs,
diagonals, several operands, operand lists, the sublist form), each counted as torch computes it and checked
against what the call dispatches: ``FlopCounterMode``'s count of its batched products for the matmul family,
and the sums and multiplies it runs for the other and elementwise families."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import torchlens as tl
from accel_paths import PATHS, on_path

R = torch.randn

# (id, equation, operand shapes)
EQUATIONS = [
    ("matmul", "ij,jk->ik", [(3, 4), (4, 5)]),
    ("implicit output", "ij,jk", [(3, 4), (4, 5)]),
    ("batched", "bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("broadcast batch", "bij,jk->bik", [(1, 3, 4), (4, 5)]),
    ("elementwise", "ij,ij->ij", [(3, 4), (3, 4)]),
    ("dot of matrices", "ij,ij->", [(3, 4), (3, 4)]),
    ("outer", "i,j->ij", [(3,), (4,)]),
    ("label summed alone", "ij,jk->i", [(3, 4), (4, 5)]),
    ("summed label broadcast", "ij,kj->ik", [(3, 1), (5, 4)]),
    ("size-1 summed label", "ij,jk->ik", [(3, 1), (1, 5)]),
    ("empty summed label", "ij,jk->ik", [(3, 0), (0, 5)]),
    ("diagonal", "ii->i", [(3, 3)]),
    ("trace, implicit", "ii", [(3, 3)]),
    ("sum", "ij->", [(3, 4)]),
    ("transpose", "ij->ji", [(3, 4)]),
    ("diagonal then product", "iij,jk->ik", [(3, 3, 4), (4, 5)]),
    ("attention scores", "...qhd,...khd->...hqk", [(2, 3, 5, 4, 8), (2, 3, 6, 4, 8)]),
    ("ellipsis broadcast", "...ij,...jk->...ik", [(2, 1, 3, 4), (5, 4, 6)]),
    ("ellipsis of one side only", "...ij,jk->...ik", [(2, 3, 3, 4), (4, 5)]),
    ("ellipsis summed", "...ij,...ij->ij", [(2, 3, 3, 4), (3, 3, 4)]),
    ("ellipsis, implicit", "...ij,...jk", [(2, 3, 4), (1, 4, 5)]),
    ("ellipsis, spaces", "... n d , ... n g -> ... g d", [(2, 4, 7, 8), (2, 4, 7, 3)]),
    ("three operands", "ij,jk,kl->il", [(3, 4), (4, 5), (5, 6)]),
    ("three vectors", "i,i,i->", [(3,), (3,), (3,)]),
    ("four operands", "ab,bc,cd,de->ae", [(2, 3), (3, 4), (4, 5), (5, 6)]),
    ("label kept for later", "bn,anm,bm->ba", [(2, 3), (4, 3, 5), (2, 5)]),
]


class _SumsAndMultiplies(TorchDispatchMode):
    """What a call dispatches besides its products, by torchlens's convention: a sum 1 per element it reads,
    a multiply 1 per element it writes."""

    def __init__(self):
        super().__init__()
        self.other = self.elementwise = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name == "sum":
            self.other += args[0].numel()
        elif name == "mul":
            self.elementwise += out.numel()
        return out


def dispatched(call, operands) -> dict:
    """``{family: FLOPs}`` of one untraced call, from what it dispatched."""
    with FlopCounterMode(display=False) as counter, _SumsAndMultiplies() as rest:
        call(*operands)
    counts = {"matmul": counter.get_total_flops(), "other": rest.other, "elementwise": rest.elementwise}
    return {family: n for family, n in counts.items() if n or family == "matmul"}


def traced(call, operands, compiled) -> dict:
    with on_path(compiled):
        log = tl.trace(call, tuple(operands))
    (op,) = [op for op in log.ops if op.func_name == "einsum"]
    return tl.report.flops.op_flops_by_family(op)


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("equation, shapes", [pytest.param(e, s, id=i) for i, e, s in EQUATIONS])
def test_einsum_counts_what_the_call_dispatches(equation, shapes, compiled):
    torch.manual_seed(0)
    operands = [R(*shape) for shape in shapes]
    call = lambda *ops: torch.einsum(equation, *ops)  # noqa: E731
    assert traced(call, operands, compiled) == dispatched(call, operands)


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("form", ["operand list", "sublist", "sublist with ellipsis"])
def test_einsum_spelled_with_lists_counts_what_it_dispatches(form, compiled):
    calls = {"operand list": lambda a, b: torch.einsum("...ij,...jk->...ik", [a, b]),
             "sublist": lambda a, b: torch.einsum(a, [0, 1, 2], b, [0, 2, 3], [0, 1, 3]),
             "sublist with ellipsis": lambda a, b: torch.einsum(a, [..., 1, 2], b, [..., 2, 3])}
    operands = [R(2, 3, 4), R(2, 4, 5)]
    counted = traced(calls[form], operands, compiled)
    assert counted == dispatched(calls[form], operands) and counted["matmul"] > 0


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("optimized", [False, True], ids=["left to right", "opt_einsum"])
def test_three_operands_are_counted_in_the_order_torch_contracts_them(optimized, compiled):
    # Left to right costs 2*40*2*40 + 2*40*40*3 here; opt_einsum's order, jk with kl first, a hundredth of that.
    if optimized:
        pytest.importorskip("opt_einsum")
    operands = [R(40, 2), R(2, 40), R(40, 3)]
    call = lambda *ops: torch.einsum("ij,jk,kl->il", *ops)  # noqa: E731
    with torch.backends.opt_einsum.flags(enabled=False):
        left_to_right = dispatched(call, operands)
    with torch.backends.opt_einsum.flags(enabled=optimized):
        counted = traced(call, operands, compiled)
        assert counted == dispatched(call, operands)
    assert (counted["matmul"] < left_to_right["matmul"]) == optimized


class _WeightFirst(nn.Module):
    """An operand list whose first tensor is a parameter and second the input: a parameter is recorded apart
    from the parents, and the shapes were read parents first, so the labels met the wrong operands."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 5))

    def forward(self, x):
        return torch.einsum("jk,ij->ik", [self.weight, x])


@pytest.mark.parametrize("compiled", PATHS)
def test_an_operand_list_is_read_in_its_order_parameters_and_inputs_alike(compiled):
    model, x = _WeightFirst(), R(3, 4)
    assert traced(model, [x], compiled) == dispatched(model, [x])


class _Einsums(nn.Module):
    """A product over an ellipsis and a product torch computes as a multiply."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        scores = torch.einsum("...qd,...kd->...qk", x, x @ self.weight)
        return torch.einsum("...ij,...ij->...ij", scores, scores)


def test_flops_vs_dispatch_agrees_on_einsum_products_and_names_no_missed_product():
    result = tl.report.flops_vs_dispatch(_Einsums(), R(2, 3, 5, 8))
    families = {row["family"]: row for row in result.families}
    assert families["matmul"]["difference"] == 0 and families["matmul"]["native"] > 0
    assert families["elementwise"]["torchlens"] > 0 == families["elementwise"]["native"]
    assert result.torchlens_total.complete
    # the multiply is elementwise work, which FlopCounterMode never counts: not a product it missed
    assert not any("counted 0 inside these" in note for note in result.notes), result.notes
