"""Layers and passes: which ops are one layer run again, and which are distinct layers.

A layer is one place in the model's code, its passes the times it ran (docs/labels.md). These tests
trace shared modules, Python loops, helpers called from several lines, recursion and torch's own
Python code, and check the grouping against what the source says.
"""

from __future__ import annotations

import inspect
import operator
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import pytest

import torchlens as tl
from zoo import LoopRNN, SharedModule


def labels(log):
    return [op.label for op in log]


def test_shared_module_gives_one_layer_with_a_pass_per_call():
    model = SharedModule().eval()
    log = tl.trace(model, torch.randn(2, 8))
    assert labels(log) == ["input_1:1", "linear_1_1:1", "relu_1_2:1", "linear_1_1:2", "relu_1_2:2",
                           "linear_1_1:3", "output_1:1"]
    assert [c.label for c in log.module_calls] == ["fc:1", "act:1", "fc:2", "act:2", "fc:3"]
    assert log["fc:2"].label == "linear_1_1:2"
    fc = log["fc"]
    assert isinstance(fc, tl.Module) and fc.num_calls == 3 and fc.class_name == "Linear"
    layer = log["linear_1_1"]
    assert isinstance(layer, tl.Layer) and layer.num_passes == 3
    assert [op.pass_index for op in layer.ops] == [1, 2, 3]
    with pytest.raises(AttributeError, match="passes"):
        layer.activation


class _Diverging(nn.Module):
    """A module whose calls take different branches and loop a different number of times."""

    def forward(self, x, flag, steps):
        if flag:
            x = torch.relu(x)  # then-arm
        else:
            x = torch.relu(x)  # else-arm
        for _ in range(steps):
            x = torch.tanh(x)  # loop body
        return torch.sigmoid(x)  # return line


def test_a_shared_module_whose_calls_diverge_groups_by_line_not_by_position():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = _Diverging()

        def forward(self, x):
            return self.block(x, True, 2) + self.block(x, False, 1) + self.block(x, True, 0)

    source, first = inspect.getsourcelines(_Diverging.forward)
    line_of = {tag: first + i for i, text in enumerate(source) for tag in ("then-arm", "else-arm", "return line")
               if text.rstrip().endswith("# " + tag)}
    log = tl.trace(Net(), torch.randn(2, 3))
    by_line: dict = {}
    for op in log:
        if op.module_address == "block" and op.func_name != "tanh":
            by_line.setdefault(op.source.line, []).append(op)
    assert sorted(by_line) == sorted(line_of.values())
    # Each line of the shared module is one layer with a pass per call that ran it, in call order.
    for line, ops in by_line.items():
        assert len({op.layer_label for op in ops}) == 1, (line, [op.label for op in ops])
        assert [op.pass_index for op in ops] == list(range(1, len(ops) + 1))
        assert [op.module for op in ops] == sorted(op.module for op in ops)
    assert [op.module for op in by_line[line_of["return line"]]] == ["block:1", "block:2", "block:3"]
    # Lines never merge, whatever position their ops had within the call.
    layers = [by_line[line][0].layer_label for line in line_of.values()]
    assert len(set(layers)) == 3


def test_python_loop_groups_module_and_param_free_body():
    model = LoopRNN(steps=4).eval()
    log = tl.trace(model, torch.randn(2, 8))
    layer_labels = [layer.layer_label for layer in log.layers]
    assert layer_labels == ["input_1", "zeroslike_1_1", "linear_1_2", "add_1_3", "tanh_1_4", "mul_1_5",
                            "output_1"]
    assert [layer.num_passes for layer in log.layers] == [1, 1, 4, 4, 4, 4, 1]
    assert log["add_1_3:2"].parents == ["linear_1_2:2", "mul_1_5:1"]
    assert log.is_recurrent


class _BuiltinCallLoop(nn.Module):
    """A loop whose op is called by a builtin (``operator.mul``): its line runs the op from C code, so the
    op's site is the forward's own call instruction, which Python 3.11 moves once the call warms up."""

    def forward(self, x):
        h = x
        for _ in range(20):
            h = torch.tanh(operator.mul(h, x))
        return h


def test_a_loop_calling_through_a_builtin_is_one_layer_from_its_first_trace_on():
    model = _BuiltinCallLoop()  # its forward has never run: the trace sees the call site cold, then warm
    first, second = (tl.trace(model, torch.randn(2, 4)) for _ in range(2))
    muls = [op for op in first.ops if op.func_name == "mul"]
    assert len({op.layer_label for op in muls}) == 1
    assert [op.pass_index for op in muls] == list(range(1, 21))
    assert first.op_labels == second.op_labels


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_deep(x, depth):
    return x if depth == 0 else _rotate_deep(_rotate_half(x) * 2, depth - 1)


class _Helpers(nn.Module):
    """A helper called from two lines of one forward (rotary embeddings: ``rotate_half(q)``,
    ``rotate_half(k)``), from a loop, and by itself (a recursion)."""

    def forward(self, q, k):
        q = _rotate_half(q)
        k = _rotate_half(k)
        for _ in range(3):
            q = torch.sigmoid(_rotate_half(q))
        return q + _rotate_deep(k, 3)


def test_a_helper_called_from_two_lines_is_two_layers_and_from_a_loop_passes():
    log = tl.trace(_Helpers(), (torch.randn(2, 4), torch.randn(2, 4)))
    negs = [op for op in log if op.func_name == "neg"]
    assert len(negs) == 8
    from_q, from_k, *in_the_loop = negs[:5]
    in_the_recursion = negs[5:]
    assert from_q.layer_label != from_k.layer_label and from_q.num_passes == from_k.num_passes == 1
    assert len({op.layer_label for op in in_the_loop}) == 1 and [op.pass_index for op in in_the_loop] == [1, 2, 3]
    assert from_q.layer_label not in {op.layer_label for op in in_the_loop + in_the_recursion}
    assert len({op.layer_label for op in in_the_recursion}) == 1
    assert [op.pass_index for op in in_the_recursion] == [1, 2, 3]


def _down(x, depth):
    return x if depth == 0 else _across(torch.tanh(x), depth)


def _across(x, depth):
    return _down(x * 0.5, depth - 1)


def test_ops_deep_in_a_mutual_recursion_are_recorded():
    """The user lines that called an op are walked, not recursed over: a model whose own stack takes half
    of Python's recursion limit traces as it runs."""
    depth = (sys.getrecursionlimit() - len(inspect.stack())) // 4
    log = tl.trace(lambda x: _down(x, depth), torch.randn(3))
    tanh = [op for op in log if op.func_name == "tanh"]
    assert len(tanh) == depth
    assert torch.equal(log.output, _down(log["input_1:1"].activation, depth))


class _Clip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clamp(-1, 1) * 2

    @staticmethod
    def backward(ctx, grad):
        return grad


@torch.no_grad()
def _scaled(x):
    return torch.sigmoid(x) * 3


class _ThroughTorch(nn.Module):
    """Functions of the user's that torch's own code calls: an ``autograd.Function``, a checkpointed function
    and a ``torch.no_grad()``-decorated one, each from two lines and from a loop."""

    def forward(self, q, k):
        a = _Clip.apply(q)
        b = _Clip.apply(k)
        c = torch.utils.checkpoint.checkpoint(_rotate_half, a, use_reentrant=False)
        d = torch.utils.checkpoint.checkpoint(_rotate_half, b, use_reentrant=False)
        e, f = _scaled(c), _scaled(d)
        for _ in range(2):
            e = _Clip.apply(e)
        return e + f


def test_a_function_torch_calls_for_two_lines_is_two_layers_and_for_a_loop_passes():
    log = tl.trace(_ThroughTorch(), (torch.randn(2, 4), torch.randn(2, 4)))
    for func, lines, in_the_loop in (("clamp", 2, 2), ("neg", 2, 0), ("sigmoid", 2, 0)):
        ops = [op for op in log if op.func_name == func]
        assert len(ops) == lines + in_the_loop
        assert len({op.layer_label for op in ops[:lines]}) == lines, func
        assert all(op.num_passes == 1 for op in ops[:lines]), func
        assert [op.pass_index for op in ops[lines:]] == list(range(1, in_the_loop + 1)), func


def _log_density(mu):
    return torch.distributions.Normal(mu, torch.ones_like(mu)).log_prob(mu * 0.5)


class _Densities(nn.Module):
    """A helper whose ops run in torch's own Python code (``torch.distributions``), from two lines and a loop."""

    def forward(self, a, b):
        x, y = _log_density(a), _log_density(b)
        for _ in range(2):
            x = _log_density(x)
        return x + y


def test_torch_code_a_helper_runs_for_two_lines_is_two_layers_and_for_a_loop_passes():
    log = tl.trace(_Densities(), (torch.randn(3), torch.randn(3)))
    for func in ("log", "div", "neg"):
        ops = [op for op in log if op.func_name == func]
        assert len(ops) == 4 and "distributions" in ops[0].call.site[0].co_filename, func
        from_a, from_b, *in_the_loop = ops
        assert from_a.layer_label != from_b.layer_label and from_a.num_passes == from_b.num_passes == 1, func
        assert [op.pass_index for op in in_the_loop] == [1, 2] and in_the_loop[0].layer_label != from_a.layer_label


def test_a_model_without_loops_or_reused_modules_is_not_recurrent():
    """Llama's attention rotates the queries and the keys with one helper, called from two lines."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    log = tl.trace(LlamaModel(config).eval(), torch.randint(0, 32, (1, 5)))
    assert not log.is_recurrent, [layer for layer in log.layers if layer.num_passes > 1]
    assert "feed-forward" in str(log)


def test_single_op_self_chain_is_not_recurrence():
    def chain(x):
        for _ in range(3):
            x = x + 1
        return x

    log = tl.trace(chain, torch.randn(3))
    assert labels(log) == ["input_1:1", "add_1_1:1", "add_2_2:1", "add_3_3:1", "output_1:1"]


def test_a_loop_line_run_with_other_arguments_is_a_layer_per_argument():
    # The non-tensor arguments are part of a loop line's key: x.pow(k) for three k is three layers, each
    # reading the input (no self-chain), while the same call three times is one layer of three passes.
    def powers(x, exponents):
        total = x
        for k in exponents:
            total = total + x.pow(k)
        return total

    varied = tl.trace(lambda x: powers(x, (1, 2, 3)), torch.randn(3))
    assert [op.label for op in varied if op.type == "pow"] == ["pow_1_1:1", "pow_2_3:1", "pow_3_5:1"]
    same = tl.trace(lambda x: powers(x, (2, 2, 2)), torch.randn(3))
    assert [op.label for op in same if op.type == "pow"] == ["pow_1_1:1", "pow_1_1:2", "pow_1_1:3"]


def test_growing_shapes_are_not_grouped_and_distinct_modules_never_merge():
    def grow(x):
        for _ in range(2):
            x = torch.tanh(torch.cat([x, x]))
        return x

    assert labels(tl.trace(grow, torch.randn(2))) == [
        "input_1:1", "cat_1_1:1", "tanh_1_2:1", "cat_2_3:1", "tanh_2_4:1", "output_1:1"]

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight, self.b.bias = self.a.weight, self.a.bias  # every parameter shared

        def forward(self, x):
            return self.b(self.a(x))

    assert labels(tl.trace(Tied(), torch.randn(1, 4))) == ["input_1:1", "linear_1_1:1", "linear_2_2:1",
                                                          "output_1:1"]


class _LoopFromAnAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.start = torch.zeros(2, 4)  # a plain attribute: made outside the trace
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = self.start
        for _ in range(3):
            h = torch.tanh(h @ self.weight + x)
        return h


def test_a_layer_answers_a_field_of_its_passes_only_when_they_agree_on_it():
    # log["matmul_1_1"].unattributed_args answered 1, the first pass's count, for passes 2 and 3 that read the
    # loop's own tanh; and .module_address was refused as "differs per pass" where every pass ran in one module.
    log = tl.trace(_LoopFromAnAttribute(), torch.randn(2, 4))
    layer = log["matmul_1_1"]
    assert [op.unattributed_args for op in layer.ops] == [1, 0, 0]
    with pytest.raises(AttributeError, match="'unattributed_args' differs between its passes"):
        layer.unattributed_args
    assert log["tanh_1_3"].unattributed_args == 0 and log["tanh_1_3"].module_address is None


def test_the_layers_table_shows_no_pass_s_shape_for_passes_that_differ():
    # log.layers.to_pandas() showed the first pass's shape, (2, 8), for a layer whose second pass made (1, 8).
    fc = nn.Linear(8, 8)
    log = tl.trace(lambda x: fc(x).sum() + fc(x[:1]).sum(), torch.randn(2, 8), root=fc)
    rows = log.layers.to_pandas().set_index("layer_label")
    assert rows.loc["linear_1_1", "shape"] is None and rows.loc["linear_1_1", "module"] == "self"
    assert rows.loc["getitem_1_3", "shape"] == (1, 8)


def test_a_layer_with_no_torch_call_has_no_time_rather_than_zero():
    # Layer.duration summed its passes' times with None read as 0.0: Llama's inputs, rotary buffer and output had a
    # duration of 0.0 in log.layers.to_pandas(), where log.to_pandas() has none for the same ops.
    pytest.importorskip("transformers")
    import real_models

    model, args, kwargs = real_models.build("llama")
    with real_models.in_mode(model, "eval"):
        log = tl.trace(model, args, kwargs)
    ops = log.to_pandas().groupby("layer_label")["duration"].sum(min_count=1)
    layers = log.layers.to_pandas().set_index("layer_label")["duration"]
    assert {log[label].first.kind for label in layers.index[layers.isna()]} == {"input", "buffer", "output"}
    assert layers.isna().equals(ops[layers.index].isna())
    assert layers.dropna().equals(ops[layers.dropna().index])


class _SplitTwice(nn.Module):
    """Splits its input twice per call: into as many parts as its width allows."""

    def forward(self, x):
        total = x.sum()
        for _ in range(2):
            total = total + x.split(2, dim=-1)[0].sum()
        return total


def test_a_shared_module_op_with_more_outputs_in_a_later_call_keeps_its_passes():
    # Each run of a site counts once per module call, at its first output: counted per output, the second
    # split of a call that made three parts would be a layer of its own instead of the first call's.
    block = _SplitTwice()
    log = tl.trace(lambda x: block(x[:, :4]) + block(x), torch.randn(2, 6), root=block)
    splits = [op for op in log if op.func_name == "split"]
    assert [op.multi_output_index for op in splits] == [0, 1, 0, 1, 0, 1, 2, 0, 1, 2]
    first, second = splits[:4], splits[4:]
    assert [op.layer_label for op in second[:2] + second[3:5]] == [op.layer_label for op in first]
    assert [op.pass_index for op in second] == [2, 2, 1, 2, 2, 1]


def test_a_loop_body_of_two_iterations_is_still_a_loop_body():
    # The first sub feeds the loop's test (mean) in the second iteration: what keeps a chain of two subs a
    # loop body rather than two single-op layers, with nothing else in the chain to tell.
    def step_down(x):
        while x.mean() > 0:
            x = x - 1
        return x

    log = tl.trace(step_down, torch.full((3,), 1.5))
    # The test's first run (compiled apart, before the loop) is a pass of the same layer as its later runs.
    assert [op.label for op in log][1:-1] == ["mean_1_1:1", "gt_1_2:1", "sub_1_3:1", "mean_1_1:2", "gt_1_2:2",
                                              "sub_1_3:2", "mean_1_1:3", "gt_1_2:3"]


def test_a_chain_fed_or_read_by_one_off_tensors_is_still_a_chain():
    # Only a repeated layer makes a chain part of a loop body: a one-off tensor it reads (y) or that reads
    # every member (the stack after the loop) leaves x = x * y a chain of separate layers.
    def scale(x, y):
        steps = []
        for _ in range(3):
            x = x * y
            steps.append(x)
        return torch.stack(steps)

    log = tl.trace(scale, (torch.randn(3), torch.randn(3)))
    assert [op.label for op in log if op.type == "mul"] == ["mul_1_1:1", "mul_2_2:1", "mul_3_3:1"]


def test_one_user_line_reaching_a_function_twice_inside_torch_is_two_layers():
    # Traced deep, F.triplet_margin_with_distance_loss measures both distances with pairwise_distance, from
    # two lines of torch's own code that one user line reached: two layers, not two passes of one.
    anchor, positive, negative = torch.randn(3, 2, 4).unbind(0)
    log = tl.trace(lambda a, p, n: F.triplet_margin_with_distance_loss(a, p, n), (anchor, positive, negative),
                   deep=True)
    assert [op.label for op in log if op.func_name == "pairwise_distance"] == [
        "pairwisedistance_1_1:1", "pairwisedistance_2_2:1"]


class _Recursive(nn.Module):
    def forward(self, x, depth=2):
        x = torch.relu(x - 1)
        return self(x, depth - 1) if depth else x


def test_a_root_that_calls_itself_groups_its_first_call_with_its_later_ones():
    # The root's first call is the trace itself, in no module call: its ops still pair with its later calls'.
    log = tl.trace(_Recursive(), torch.randn(3))
    assert labels(log)[1:-1] == ["sub_1_1:1", "relu_1_2:1", "sub_1_1:2", "relu_1_2:2", "sub_1_1:3", "relu_1_2:3"]
    assert [c.label for c in log.module_calls] == ["self:2", "self:3"]


def test_the_two_comparisons_of_a_chained_comparison_are_two_layers():
    # Both comparisons of a < b < c share one source span, but they are not copies of one instruction.
    def both_and(a, b, c, d):
        while (a < b < c).all() and d.sum() > 0:
            d = d - 1
        return d

    ones = torch.ones(1)
    log = tl.trace(both_and, (ones, ones * 2, ones * 3, ones))
    assert [op.label for op in log if op.kind == "op"] == ["lt_1_1:1", "lt_2_2:1", "all_1_3:1", "sum_1_4:1",
                                                           "gt_1_5:1", "sub_1_6:1", "lt_1_1:2", "lt_2_2:2",
                                                           "all_1_3:2", "sum_1_4:2", "gt_1_5:2"]


def test_a_layer_label_missing_from_layers_by_label_is_answered_with_the_closest_or_its_passes():
    """``layers_by_label`` is keyed by layer labels, which carry no pass number: a label with one names the
    layer and its passes, and a typo the closest labels, where a plain dict repeated the key alone."""
    log = tl.trace(LoopRNN(), torch.randn(2, 8))
    looped = next(layer for layer in log.layers if layer.num_passes > 1)
    label, passes = looped.layer_label, looped.num_passes
    with pytest.raises(KeyError, match=rf"layers_by_label\['{label}'\] is the layer, and its passes are "
                                       rf"log\['{label}:1'\] to log\['{label}:{passes}'\]"):
        log.layers_by_label[f"{label}:{passes + 1}"]
    typo = label[:-1] + str(int(label[-1]) + 7)
    with pytest.raises(KeyError, match=rf"no layer labelled '{typo}' in this trace; closest: .*{label}"):
        log.layers_by_label[typo]
    assert log.layers_by_label[label].num_passes == passes
