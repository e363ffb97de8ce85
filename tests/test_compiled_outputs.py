"""What a torch.compile'd submodule returns, recorded as the outputs of its ``compiled`` op: a compiled call
returns whatever the submodule's forward returns, a dict or a dataclass as well as tensors and tuples."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from untouched import assert_clean_process


@pytest.fixture(autouse=True, scope="module")
def _collect_compile_garbage():
    yield
    gc.collect()


@dataclasses.dataclass
class Pair:
    h: torch.Tensor
    g: torch.Tensor


class Block(nn.Module):
    def __init__(self, returns):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.returns = returns

    def forward(self, x, scale=1.0):
        h = self.a(x) * scale
        g = self.b(h).tanh()
        return {"h": h, "g": g, "n": 3} if self.returns == "dict" else Pair(h, g)


class Net(nn.Module):
    def __init__(self, returns, compiled=True):
        super().__init__()
        torch.manual_seed(0)
        self.block = Block(returns)
        if compiled:
            self.block = torch.compile(self.block, backend="eager")
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        out = self.block(x, scale=2.0)
        h, g = (out["h"], out["g"]) if isinstance(out, dict) else (out.h, out.g)
        return self.head(h + g)


@pytest.mark.parametrize("returns", ["dict", "dataclass"])
def test_the_tensors_a_compiled_submodule_returns_in_a_dict_or_dataclass_are_its_compiled_ops_outputs(returns):
    model, x = Net(returns), torch.randn(3, 4)
    log = tl.trace(model, x)
    assert torch.equal(log.output, Net(returns)(x))
    assert [op.label for op in log.ops if op.kind == "op"] == ["compiled_1_1:1", "compiled_2_2:1", "add_1_3:1",
                                                                "linear_1_4:1"]
    assert log.unattributed == 0  # not tensors of unknown origin
    assert log["add_1_3"].parents == ["compiled_1_1:1", "compiled_2_2:1"]
    block_call = next(call for call in log.module_calls if call.label == "block:1")
    assert block_call.output_ops == ["compiled_1_1:1", "compiled_2_2:1"]
    result = log.validate()
    assert result.passed and result.replayed == 3, str(result)  # the compiled call replayed, both outputs compared
    assert_clean_process()


def test_a_module_site_on_a_compiled_submodule_returning_a_dict_edits_its_outputs_as_a_hook_would():
    x = torch.randn(3, 4)
    expected_model = Net("dict", compiled=False)
    expected_model.block.register_forward_hook(lambda module, args, out: {**out, "h": out["h"] * 0.5})
    expected = expected_model(x)
    log = tl.trace(Net("dict"), x, intervene={"block": lambda t, op: t * 0.5 if op.output_index == 0 else None})
    assert torch.equal(log.output, expected)
    label_site = tl.trace(Net("dict"), x, intervene={"compiled_1_1:1": tl.scale(0.5)}, grads=True)
    assert torch.equal(label_site.output, expected)
    assert_clean_process()


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return h, {"t": h.tanh(), "s": [h.sigmoid(), 2]}


class HoldsNested(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = torch.compile(Nested(), backend="eager")

    def forward(self, x):
        h, d = self.block(x)
        return h + d["t"] + d["s"][0]


def test_a_dict_inside_a_tuple_a_compiled_submodule_returns_is_looked_into_on_both_capture_paths():
    x = torch.randn(2, 4)
    log = tl.trace(HoldsNested(), x)
    assert [(op.label, op.multi_output_index) for op in log.ops if op.type == "compiled"] == [
        ("compiled_1_1:1", 0), ("compiled_2_2:1", (1, "t")), ("compiled_3_3:1", (1, "s", 0))]
    assert log.unattributed == 0 and torch.equal(log.output, HoldsNested()(x))
    assert log.validate().passed
    assert_clean_process()
