"""Code the compiler duplicates (a while loop's test, a finally block, a with block's exit) is one place in the
source: its ops are one layer, one pass per run, on both capture paths.  Two like expressions on one line are
still two places."""

import dis

import pytest
import torch

import torchlens as tl

from accel_paths import PATHS, on_path


def _labels(f, x, compiled) -> list:
    with on_path(compiled):
        log = tl.trace(f, x)
    return [op.label for op in log if op.kind == "op"]


def _counting_down(x):
    while (x.sum()
           > 0):
        x = x - 1
    return x


def _two_tests(x):
    b = x * 1
    while x.max() > 0 and b.sum() > 0:
        x = x - 1
    return x


def _one_line(x):
    while x.sum() > 0: x = x - 1  # noqa: E701 (the test, compiled again after the body, shares its line)
    return x


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("forward", [_counting_down, _one_line], ids=["condition over two lines", "one line"])
def test_a_while_loops_test_is_one_layer_with_a_pass_per_run(compiled, forward):
    labels = _labels(forward, torch.tensor([2.5]), compiled)
    assert labels == ["sum_1_1:1", "gt_1_2:1", "sub_1_3:1", "sum_1_1:2", "gt_1_2:2", "sub_1_3:2",
                      "sum_1_1:3", "gt_1_2:3", "sub_1_3:3", "sum_1_1:4", "gt_1_2:4"]


@pytest.mark.parametrize("compiled", PATHS)
def test_a_while_test_of_two_conditions_is_a_layer_per_condition(compiled):
    labels = _labels(_two_tests, torch.tensor([1.5]), compiled)
    assert labels == ["mul_1_1:1", "max_1_2:1", "gt_1_3:1", "sum_1_4:1", "gt_2_5:1", "sub_1_6:1",
                      "max_1_2:2", "gt_1_3:2", "sum_1_4:2", "gt_2_5:2", "sub_1_6:2", "max_1_2:3", "gt_1_3:3"]


def _finally_after_a_raise(x):
    for k in range(3):
        try:
            x = x + 1
            if k == 1:
                raise ValueError
        except ValueError:
            pass
        finally:
            x = x * 2  # run on the exception path at k == 1, on the normal path otherwise
    return x


class _Doubling:
    def __init__(self, t):
        self.t = t

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.t.mul_(2)
        return True  # swallows the exception


def _with_left_by_a_raise(x):
    y = x * 1
    for k in range(3):
        with _Doubling(y):
            y.add_(1)
            if k == 1:
                raise ValueError
    return y


def _two_items_left_by_a_raise(x):
    y, z = x * 1, x * 2
    for k in range(3):
        with _Doubling(y), _Doubling(z):
            y.add_(z)
            if k == 1:
                raise ValueError
    return y


def _three_items(x):
    y, z, w = x * 1, x * 2, x * 3
    for _ in range(2):
        with _Doubling(y), _Doubling(z), _Doubling(w):
            y.add_(z + w)
    return y


@pytest.mark.parametrize("compiled", PATHS)
def test_a_finally_block_run_on_both_paths_is_one_layer(compiled):
    labels = _labels(_finally_after_a_raise, torch.tensor([1.0]), compiled)
    assert labels == ["add_1_1:1", "mul_1_2:1", "add_1_1:2", "mul_1_2:2", "add_1_1:3", "mul_1_2:3"]


@pytest.mark.parametrize("compiled", PATHS)
def test_a_with_blocks_exit_left_by_an_exception_is_the_same_layer_as_its_normal_exit(compiled):
    labels = _labels(_with_left_by_a_raise, torch.tensor([1.0]), compiled)
    assert labels == ["mul_1_1:1", "add_1_2:1", "mul_2_3:1", "add_1_2:2", "mul_2_3:2", "add_1_2:3", "mul_2_3:3"]


@pytest.mark.parametrize("compiled", PATHS)
def test_each_item_of_a_with_statement_left_by_an_exception_is_the_same_layer_as_its_normal_exit(compiled):
    # z's exit runs first, then y's, on every path out (k == 1 leaves by the raise, swallowed by z's exit).
    labels = _labels(_two_items_left_by_a_raise, torch.tensor([1.0]), compiled)
    assert labels == ["mul_1_1:1", "mul_2_2:1", "add_1_3:1", "mul_3_4:1", "mul_4_5:1", "add_1_3:2", "mul_3_4:2",
                      "mul_4_5:2", "add_1_3:3", "mul_3_4:3", "mul_4_5:3"]


@pytest.mark.parametrize("compiled", PATHS)
def test_each_item_of_a_with_statement_is_a_layer_of_its_own(compiled):
    # Python 3.11 compiles each item's exception handler between the normal exits, ending in code of no line.
    labels = _labels(_three_items, torch.tensor([1.0]), compiled)
    assert labels == ["mul_1_1:1", "mul_2_2:1", "mul_3_3:1", "add_1_4:1", "add_2_5:1", "mul_4_6:1", "mul_5_7:1",
                      "mul_6_8:1", "add_1_4:2", "add_2_5:2", "mul_4_6:2", "mul_5_7:2", "mul_6_8:2"]


def test_the_handlers_of_a_with_statements_items_pair_with_their_exits_however_they_are_laid_out():
    """The items of one with statement share a span on Python 3.11 and 3.12: 3.11 compiles each item's exception
    handler after its normal exit, 3.12 all handlers after the last exit.  Both layouts pair the k-th handler
    with the k-th exit (the innermost item's first), here on this version's code and on it laid out as 3.12 does."""
    from torchlens.labels.passes import _exception_exits

    instructions = list(dis.get_instructions(_two_items_left_by_a_raise.__code__))
    handlers = [i for i in instructions if i.opname == "WITH_EXCEPT_START"]
    exits = [i.offset for i in instructions if i.opname == "CALL" and i.arg == 2]
    assert len(handlers) == len(exits) == 2
    handlers_last = [i for i in instructions if i.opname != "WITH_EXCEPT_START"] + handlers
    for layout in (instructions, handlers_last):
        assert _exception_exits(layout, {}) == {handler.offset: exit for handler, exit in zip(handlers, exits)}


def _kept(xs):
    return [t.exp() for t in xs if t.sum() > 0]


def _over_a_generator(x):
    for t in (x + 1 for _ in range(3)):
        if t.sum() > 0:
            x = x * t
    return x


def _two_relus(x):
    return x.relu() + x.relu()


@pytest.mark.parametrize("compiled", PATHS)
def test_loops_over_comprehensions_and_generators_with_conditions_are_a_layer_per_place(compiled):
    xs = [torch.tensor([1.0]), torch.tensor([-1.0]), torch.tensor([2.0])]
    assert _labels(_kept, xs, compiled) == ["sum_1_1:1", "gt_1_2:1", "exp_1_3:1", "sum_1_1:2", "gt_1_2:2",
                                            "sum_1_1:3", "gt_1_2:3", "exp_1_3:2"]
    labels = _labels(_over_a_generator, torch.tensor([1.0]), compiled)
    assert labels == ["add_1_1:1", "sum_1_2:1", "gt_1_3:1", "mul_1_4:1", "add_1_1:2", "sum_1_2:2", "gt_1_3:2",
                      "mul_1_4:2", "add_1_1:3", "sum_1_2:3", "gt_1_3:3", "mul_1_4:3"]


@pytest.mark.parametrize("compiled", PATHS)
def test_two_like_expressions_on_one_line_are_two_layers(compiled):
    assert _labels(_two_relus, torch.tensor([1.0]), compiled) == ["relu_1_1:1", "relu_2_2:1", "add_1_3:1"]


def test_an_offset_inside_an_instructions_inline_cache_is_read_as_the_instructions():
    """A frame suspended in a warm instruction that runs a generator inline (Python 3.12's ``FOR_ITER_GEN``)
    names an offset inside the instruction's inline cache, where the cold one names its own: both are one
    place, so a loop over a generator stays one layer once the loop warms up (the test above, on 3.12)."""
    from torchlens.labels.passes import call_offset

    code = _over_a_generator.__code__
    instructions = list(dis.get_instructions(code))
    cached = [(a, b) for a, b in zip(instructions, instructions[1:]) if b.offset > a.offset + 2]
    assert cached  # (a load of a global, an attribute or a binary op has cache entries on every version run)
    for instruction, after in cached:
        for inside in range(instruction.offset + 2, after.offset, 2):
            assert call_offset(code, inside) == call_offset(code, instruction.offset)
