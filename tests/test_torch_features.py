"""PyTorch machinery a model's forward uses beyond plain ops: attention backend selection, custom
operators, higher-order ops.  Each traces faithfully and replays as it ran, or the trace says what it
could not capture."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import torchlens as tl  # noqa: E402


def test_attention_replays_with_the_backends_it_chose_from():
    # sdpa_kernel selects scaled_dot_product_attention's kernel; another backend computes other low bits.
    # Replay ran every attention call under the backends enabled at validation, and reported a mismatch
    # on a faithful trace.
    pytest.importorskip("transformers")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from real_models import small_gpt2_lm

    model = small_gpt2_lm()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))

    class MathAttention(torch.nn.Module):  # the model's own forward opens the block
        def __init__(self):
            super().__init__()
            self.lm = model

        def forward(self, ids):
            with sdpa_kernel([SDPBackend.MATH]):
                return self.lm(ids).logits

    result = tl.validate(MathAttention(), ids)
    assert any(op.type == "scaleddotproductattention" for op in tl.trace(MathAttention(), ids).ops)
    assert result.passed and not result.not_replayed, str(result)
    with sdpa_kernel([SDPBackend.MATH]):  # a block around the trace, closed before validating
        log = tl.trace(model, ids)
    result = log.validate()
    assert result.passed and not result.not_replayed, str(result)


# ----- custom operators --------------------------------------------------------------------------
@torch.library.custom_op("torchlens_features::write_rows", mutates_args=("cache",))
def write_rows(cache: torch.Tensor, rows: torch.Tensor) -> None:
    """A key/value cache update written as a custom op: it fills the cache in place and returns nothing."""
    cache[: rows.shape[0]].copy_(rows)


@torch.library.custom_op("torchlens_features::write_rows_scaled", mutates_args=("cache",))
def write_rows_scaled(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The same update, returning a tensor of its own besides: what it wrote is no output of it."""
    cache[: rows.shape[0]].copy_(rows)
    return rows * 3


# The same two named as torch names its in-place functions: what they write is read from their schemas
# all the same, not guessed from the name (which says the first argument is written and returned).
@torch.library.custom_op("torchlens_features::write_rows_", mutates_args=("cache",))
def write_rows_(cache: torch.Tensor, rows: torch.Tensor) -> None:
    cache[: rows.shape[0]].copy_(rows)


@torch.library.custom_op("torchlens_features::write_rows_scaled_", mutates_args=("cache",))
def write_rows_scaled_(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    cache[: rows.shape[0]].copy_(rows)
    return rows * 3


WRITERS = {"plain name": (write_rows, write_rows_scaled), "in-place name": (write_rows_, write_rows_scaled_)}


class CachedAttention(torch.nn.Module):
    """Keys written into a cache by a custom op, then attended over."""

    def __init__(self, returns: bool = False, naming: str = "plain name"):
        super().__init__()
        torch.manual_seed(0)
        self.key = torch.nn.Linear(8, 8)
        self.query = torch.nn.Linear(8, 8)
        self.returns = returns
        self.write, self.write_and_return = WRITERS[naming]

    def forward(self, x):
        cache = torch.zeros(6, 8)
        keys = self.key(x)
        extra = self.write_and_return(cache, keys) if self.returns else self.write(cache, keys)
        scores = self.query(x) @ cache.t()
        return scores.softmax(-1) @ cache + (extra.sum() if self.returns else 0)


@pytest.mark.parametrize("naming", WRITERS)
def test_a_custom_op_that_writes_its_argument_is_recorded_with_what_it_wrote(naming):
    # A custom op declaring mutates_args and returning None was no op in the trace: the cache's readers
    # named torch.zeros as their parent (the keys did not lead to the output), and the zeros' saved value
    # was dropped as "mutated by a write capture could not see".  Named write_rows_, it was still no op.
    model, x = CachedAttention(naming=naming), torch.randn(4, 8)
    log = tl.trace(model, x)
    assert torch.equal(log.output, model(x))
    (write,) = [op for op in log.ops if op.type == "writerows"]
    assert write.parents == ["zeros_1_1:1", "linear_1_2:1"]
    assert write.children == ["t_1_5:1", "matmul_2_8:1"]  # the cache's readers
    assert log["zeros_1_1:1"].has_activation and not log["zeros_1_1:1"].activation.any()
    assert torch.equal(write.activation[:4], log["linear_1_2:1"].activation)
    result = log.validate()
    assert result.passed and not result.not_replayed, str(result)
    # Zeroing it by its label zeroes the cache the model goes on to read.
    ablated = tl.trace(model, x, intervene={write.label: tl.zero_ablate()})
    scores = model.query(x) @ torch.zeros(6, 8).t()
    assert torch.equal(ablated.output, scores.softmax(-1) @ torch.zeros(6, 8))


@pytest.mark.parametrize("naming", WRITERS)
def test_what_a_custom_op_writes_besides_its_result_is_not_passed_off_as_its_result(naming):
    # A custom op that writes an argument and returns a tensor: the written cache was bound to the op's
    # result, so its readers' parent showed (and replayed from) a value the cache never held (also, until
    # its schema was read, for one named write_rows_scaled_: validation failed on the readers).
    model, x = CachedAttention(returns=True, naming=naming), torch.randn(4, 8)
    log = tl.trace(model, x)
    assert torch.equal(log.output, model(x))
    (write,) = [op for op in log.ops if op.type == "writerowsscaled"]
    assert torch.equal(write.activation, 3 * log["linear_1_2:1"].activation)
    # The cache's readers name the op that wrote it, and replay does not vouch for the value they read,
    # which no op output holds.
    readers = [op for op in log.ops if write.label in op.parents and op.type != "sum"]
    assert [op.label for op in readers] == ["t_1_5:1", "matmul_2_8:1"]
    assert log["zeros_1_1:1"].has_activation and not log["zeros_1_1:1"].activation.any()
    result = log.validate()
    assert result.passed and {label for label, _ in result.not_replayed} == {op.label for op in readers}, str(result)


# ----- higher-order ops --------------------------------------------------------------------------
class Branching(torch.nn.Module):
    """A block whose nonlinearity torch.cond picks, and a map and a while_loop over its features."""

    def __init__(self, control: str):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)
        self.control = control

    def forward(self, x, keep=None):
        h = self.fc(x)
        if self.control == "cond":
            y = torch.cond(h.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (h,))
        elif self.control == "map":
            from torch._higher_order_ops.map import map as map_rows

            y = map_rows(lambda row: row.sin(), h)
        else:
            _, y = torch.while_loop(lambda i, t: i < 3, lambda i, t: (i + 1, t * 2), (torch.tensor(0), h))
        if keep is not None:
            y.retain_grad()
            keep["y"] = y
        return self.head(y * 2)


@pytest.mark.parametrize("control", ["cond", "map", "while_loop"])
def test_a_higher_order_op_is_one_op_not_the_fake_tracing_of_its_bodies(control):
    # With gradients on, torch.cond builds its schema by tracing both branches on fake tensors: those calls,
    # the branch that never ran among them, were recorded as the model's ops, beside the one that ran.
    model, x = Branching(control), torch.randn(3, 4)
    keep: dict = {}
    expected = model(x, keep)
    expected.sum().backward()
    oracle = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    log = tl.trace(model, x, grads=True)
    assert torch.equal(log.output, expected)
    ops = [op for op in log.ops if op.kind == "op"]
    assert all(type(op.activation) is torch.Tensor and op.device.type == "cpu" for op in ops)
    whole = [op for op in ops if op.type in ("cond", "mapimpl", "whileloop")]
    assert whole and all(op.module_call is None and op.source.function == "Branching.forward" for op in whole)
    assert [call.label for call in log.module_calls] == ["fc:1", "head:1"]  # none of Dynamo's graphs
    result = log.validate()
    assert result.passed and not result.not_replayed, str(result)
    log.backward(log.output.sum())
    assert torch.equal(whole[-1].grad, keep["y"].grad)
    assert all(torch.equal(p.grad, oracle[name]) for name, p in model.named_parameters())
    ablated = tl.trace(model, x, intervene={whole[-1].label: tl.zero_ablate()})
    assert torch.equal(ablated.output, model.head(torch.zeros(3, 4)))


def test_the_higher_order_ops_recorded_whole_are_found_on_older_torch_too(monkeypatch):
    # Importing torchlens failed on torch 2.10, whose higher-order ops have no
    # _supports_training_input_mutation (none is exempt from building its schema), and on torch 2.6, which
    # has no _has_gen_schema (no op builds one before it runs).
    import torch._higher_order_ops.utils as hop_utils
    from torchlens.capture import fastpath

    assert fastpath._operators_whole() == fastpath.OPERATORS_WHOLE and fastpath.OPERATORS_WHOLE
    with_schema = {op for op in torch._ops._higher_order_ops.values() if hop_utils._has_gen_schema(op)}
    for op in with_schema:
        monkeypatch.delattr(op, "_supports_training_input_mutation", raising=False)
    assert fastpath._operators_whole() == with_schema
    monkeypatch.delattr(hop_utils, "_has_gen_schema")
    assert fastpath._operators_whole() == frozenset()


# ----- a backward inside the traced function -----------------------------------------------------
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_backward_in_the_traced_function_adds_no_module_calls(reentrant):
    # A training step traced whole: with gradient checkpointing, the backward runs each checkpointed layer
    # again, and those calls were recorded as second calls of the layers (transformer.h.0:2), calls the
    # forward never made, with no ops.
    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    model = small_gpt2_lm().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))

    def forward(ids):
        return model(ids).logits

    def step(ids):
        logits = forward(ids)
        logits.sum().backward()
        return logits

    expected = [call.label for call in tl.trace(forward, ids, root=model).module_calls]
    log = tl.trace(step, ids, root=model)
    model.zero_grad()
    assert [call.label for call in log.module_calls] == expected
    assert "transformer.h.0:1" in expected and "transformer.h.0:2" not in expected
