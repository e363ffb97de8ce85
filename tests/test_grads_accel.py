"""Gradient capture on its three paths: torchlens-accel's C++ hooks (``_autograd``), its C hooks
(``_grads``) and pure Python.

Each model is traced once per path in one process (``accel.use``, and ``_autograd`` left out for the C
hooks) and driven through the same backwards: the traces must hold bit-identical gradients, in the same
arrival order, count the same backwards and note the same backward-node sequence numbers, and each must
match an untraced run that calls ``retain_grad()`` on the same tensors (``grad_oracle.Oracle``).  Every
path must remove every hook it adds, on ``cleanup()`` and when the trace is dropped, even inside a
reference cycle.

Skipped, saying so, when the compiled module is not built; ``TORCHLENS_REQUIRE_ACCEL=1`` makes that a
failure instead.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from accel_paths import compiled_or_skip, on_path
from torchlens.capture.grads import _Sink, _store
from grad_oracle import Oracle, _assert_bit_identical, _case, _loss, _op_grads, _reference
from test_grads import WithSentinel
from test_grads_autograd import PassThrough, Square
from zoo import zoo


NATIVE = compiled_or_skip("_grads")
CPP = compiled_or_skip("_autograd")
CPP_HOOK = type(CPP.Sink().hook(0))

# name -> (accel.use, compiled modules left out, the sink the path writes into); the C++ hooks first.
PATH_SETUP = {"cpp": (True, (), CPP.Sink), "c": (True, ("_autograd",), NATIVE.Sink), "python": (False, (), _Sink)}
PATH_NAMES = tuple(PATH_SETUP)
PATHS = [pytest.param(name, id=name) for name in PATH_NAMES]

# Each trace here sets its own path (_trace, _on): the Makefile's pure-Python pass would repeat it.
pytestmark = pytest.mark.picks_its_path


def _on(path: str):
    compiled, without, _ = PATH_SETUP[path]
    return on_path(compiled, without)


def _trace(path: str, model, args, kwargs=None, **options):
    with _on(path):
        log = tl.trace(model, args, kwargs, grads=True, **options)
    assert type(log._gradcap._sink) is PATH_SETUP[path][2]  # the path asked for is the path taken
    return log


def _record(log, model) -> dict:
    """What a path must reproduce exactly: gradients, order, backwards, sequence numbers, param grads."""
    capture = log._gradcap
    first = capture.first_sequence_number
    return {"grads": dict(capture.grads), "order": list(capture.order), "backwards": log.num_backwards,
            "sequence": {i: n - first for i, n in capture.sequence_numbers.items()},
            "params": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def _assert_same(a: dict, b: dict) -> None:
    assert a["grads"].keys() == b["grads"].keys() and a["grads"]
    for i, g in a["grads"].items():
        h = b["grads"][i]
        assert g.dtype == h.dtype and g.shape == h.shape and torch.equal(g, h), i
        assert not g.requires_grad and not h.requires_grad, i
    assert a["order"] == b["order"]
    assert a["backwards"] == b["backwards"]
    assert a["sequence"] == b["sequence"]
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def _every_path(build, drive) -> list:
    """Trace ``build()`` on each path, ``drive(log)`` its backwards; the records, in ``PATH_NAMES`` order."""
    records = []
    for path in PATH_NAMES:
        model, args, kwargs = build()
        torch.manual_seed(1)
        log = _trace(path, model, args, kwargs)
        drive(log)
        records.append(_record(log, model))
    for other in records[1:]:
        _assert_same(records[0], other)
    return records


# ----- real models, one backward, against retain_grad() ----------------------------------------------
ZOO = ["mlp", "recurrent", "shared_module", "loop_rnn", "branchy", "functional", "dict_io", "multi_output",
       "batchnorm_train", "transformer_fastpath"]
IN_PLACE = ["small_cnn", "batchnorm_eval"]  # in-place ReLU: the reference is a hook per version (test_grads.py)


@pytest.mark.parametrize("name", ZOO + IN_PLACE)
def test_zoo_gradients_identical_on_both_paths_and_to_retain_grad(name):
    oracle, _ = _reference(name, how="hook" if name in IN_PLACE else "retain_grad")
    for path in PATH_NAMES:
        model, args, kwargs = _case(name)
        torch.manual_seed(1)
        log = _trace(path, model, args, kwargs)
        log.backward(_loss(log.output))
        ops, got = _op_grads(log)
        _assert_bit_identical(ops, got, oracle.grads())
    _every_path(lambda: _case(name), lambda log: log.backward(_loss(log.output)))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    tokens = torch.randint(0, 99, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": tokens}


def test_gpt2_gradients_identical_on_both_paths_with_retain_graph_and_two_backwards():
    def drive(log):
        logits = log.output.logits
        log.backward(logits.pow(2).mean(), retain_graph=True)
        log.backward(logits[:, -1].sum())

    cpp, *_ = _every_path(_gpt2, drive)
    assert cpp["backwards"] == 2
    # Against retain_grad(): the same two backwards, accumulated as .grad accumulates.
    model, _, kwargs = _gpt2()
    oracle = Oracle()
    with oracle:
        logits = model(**kwargs).logits
    logits.pow(2).mean().backward(retain_graph=True)
    logits[:, -1].sum().backward()
    log = _trace("cpp", *_gpt2())
    drive(log)
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, oracle.grads())


class MultiOutputOps(nn.Module):
    """Ops with several outputs inside the forward: an LSTM (output, h, c), chunk and unbind."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        left, right = torch.chunk(out, 2, dim=-1)
        steps = right.unbind(1)
        return left.sum() + 2 * h.sum() + 3 * c.sum() + (steps[0] * steps[-1]).sum(), c


def test_multi_output_ops_get_each_output_gradient_on_both_paths():
    def build():
        torch.manual_seed(0)
        return MultiOutputOps(), (torch.randn(2, 3, 4),), {}

    records = _every_path(build, lambda log: log.backward(log.output[0]))
    model, args, _ = build()
    oracle = Oracle()
    with oracle:
        loss, _ = model(*args)
    loss.backward()
    model, args, _ = build()
    log = _trace("cpp", model, args)
    log.backward(log.output[0])
    ops, got = _op_grads(log)
    _assert_bit_identical(ops, got, oracle.grads())
    by_func = {}
    for op in ops:
        if op.multi_output_index is not None:
            by_func.setdefault(op.func_name, []).append(op)
    assert len(by_func["lstm"]) >= 3 and len(by_func["chunk"]) == 2 and len(by_func["unbind"]) == 3
    # The middle step is never used: autograd hands its hook no gradient, and it keeps none.
    assert [op.grad is None for op in by_func["unbind"]] == [False, True, False]
    assert torch.equal(log.outputs[1].grad, torch.full_like(log.output[1], 3.0))  # c, returned as well
    assert len(records[0]["order"]) == len(records[0]["grads"])


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_keeps_values_and_second_order_backward_counts_on_both_paths():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), (torch.randn(3, 4),), {}

    def drive(log):
        log.backward(log.output.pow(2).sum(), create_graph=True)
        # The parameters' .grad now carry a graph: a second-order backward through it reaches the forward.
        sum(p.grad.pow(2).sum() for _, p in log._model_params).backward()

    records = _every_path(build, drive)
    assert [r["backwards"] for r in records] == [2, 2, 2]


def test_autograd_grad_fills_gradients_on_both_paths():
    def build():
        model, (x,), _ = zoo()["mlp"]
        return model, (x.clone().requires_grad_(),), {}

    records = []
    for path in PATH_NAMES:
        model, (x,), _ = build()
        log = _trace(path, model, (x,))
        (gx,) = torch.autograd.grad(log.output.sum(), [x])
        assert torch.equal(log["input_1"].grad, gx)
        assert log.num_backwards == 1 and x.grad is None  # autograd.grad accumulates into nothing
        records.append(_record(log, model))
    for other in records[1:]:
        _assert_same(records[0], other)


# ----- hooks removed, graph never kept ----------------------------------------------------------------
def _ours(hooks) -> list:
    """The keys of the hooks gradient capture put in a hook dict (any path's Python-called hooks)."""
    if hooks is None:
        return []
    return [k for k, v in hooks.items()
            if isinstance(v, (NATIVE.Hook, CPP_HOOK)) or getattr(v, "func", None) is _store]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("how", ["drop", "cycle", "cleanup"])
def test_hooks_removed_and_graph_not_kept(path, how):
    model = WithSentinel()
    log = _trace(path, model, (torch.randn(2, 4),), save="none")
    out, h = log.output
    if path == "cpp":  # a C++ hook, on the node: in no Python hook dict
        assert not _ours(h._backward_hooks) and log._gradcap.add_hook.placed() == len(log._gradcap.handles)
    else:
        assert len(_ours(h._backward_hooks)) == 1
    log.backward((out.sum() + h.sum()), retain_graph=True)
    kept = weakref.ref(log._gradcap.grads[log._gradcap.order[0]])  # held by the trace alone
    num_backwards = log.num_backwards
    out_ref = weakref.ref(out)
    if how == "cleanup":
        log.cleanup()
        assert path != "cpp" or log._gradcap.add_hook.placed() == 0
        out.sum().backward(retain_graph=True)  # reaches no hook of the trace
        assert log.num_backwards == num_backwards and not log._gradcap.grads
    else:
        if how == "cycle":
            log._self = log  # only the collector can free it, after clearing the garbage's weakrefs
        trace_ref = weakref.ref(log)
        del log
        gc.collect()
        assert trace_ref() is None  # the graph the user holds does not keep the trace alive
    assert kept() is None  # no hook left in the graph holds what the trace kept
    assert not _ours(h._backward_hooks)  # every hook went with it
    assert not _ours(out._backward_hooks)
    out.sum().backward()  # a later untraced backward is unaffected
    assert model.tokens[0]() is not None
    del out, h
    gc.collect()
    assert out_ref() is None and model.tokens[0]() is None  # nothing the trace made keeps the graph


@pytest.mark.parametrize("path", PATHS)
def test_cleanup_then_backward_adds_nothing(path):
    model, args, _ = zoo()["mlp"]
    log = _trace(path, model, args)
    out = log.output
    log.backward(out.sum(), retain_graph=True)
    norm = float(log["linear_1_1:1"].grad.norm())
    log.cleanup()
    out.sum().backward()
    assert log.num_backwards == 1
    assert log.to_pandas().set_index("label").loc["linear_1_1:1", "grad_norm"] == pytest.approx(norm)


class Tagged(torch.Tensor):
    """A tensor subclass: its hooks go through its own ``register_hook`` (the fallback of the C adder)."""


def test_tensor_subclass_input_goes_through_register_hook_on_both_paths():
    def build():
        model, (x,), _ = zoo()["mlp"]
        return model, (x.clone().as_subclass(Tagged).requires_grad_(),), {}

    records = []
    expected = {"cpp": CPP_HOOK, "c": NATIVE.Hook, "python": type(None)}
    for path in PATH_NAMES:
        model, (x,), _ = build()
        log = _trace(path, model, (x,))
        (hook,) = x._backward_hooks.values()  # added by Tagged's own register_hook
        assert type(hook) is expected[path] or (path == "python" and hook.func is _store)
        log.backward(log.output.sum())
        assert torch.equal(log["input_1"].grad, x.grad)
        records.append(_record(log, model))
        log.cleanup()
        assert len(x._backward_hooks) == 0
    for other in records[1:]:
        _assert_same(records[0], other)


@pytest.mark.parametrize("path", PATHS)
def test_compiled_autograd_gives_eager_gradients_or_refuses_naming_the_way_out(path):
    """Compiled autograd traces the backward's hooks: the Python and C hooks let it, and the gradients are
    the eager backward's; the C++ hooks cannot be traced, and the backward says so and what to do."""
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    enable = getattr(compiled_autograd, "_enable", None)
    if enable is None:
        pytest.skip("this torch has no torch._dynamo.compiled_autograd._enable")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    eager = _trace(path, model, (x,), save="none")
    eager.output.sum().backward()
    log = _trace(path, model, (x,), save="none")
    with enable(torch.compile(backend="eager")):
        if path == "cpp":
            with pytest.raises(NotImplementedError, match="torchlens.*compiled autograd.*TORCHLENS_ACCEL=0"):
                log.output.sum().backward()
            return
        log.output.sum().backward()
    labels = [label for label in log.labels if not label.startswith("input")]
    assert len(labels) == 4
    for label in labels:
        assert torch.equal(log[label].grad, eager[label].grad), label


@pytest.mark.parametrize("later", ["python hook", "retain_grad"])
def test_cpp_leaf_hook_cleared_by_torch_drops_the_gradient_and_says_so(later):
    """torch empties a leaf's hook list when a Python hook dict is first set on it: the record whose hook
    went is dropped at the next backward and named, never left holding a gradient short of that backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(3, 4, requires_grad=True)
    log = _trace("cpp", model, (x,))
    out = log.output
    log.backward(out.sum(), retain_graph=True)
    first = log["input_1"].grad.clone()
    assert torch.equal(first, x.grad)
    if later == "python hook":
        x.register_hook(lambda g: None)  # the tensor's first Python hook: torch resets its hook list
    else:
        x.retain_grad()  # a leaf: a no-op, which leaves the capture's hook in place
    assert torch.equal(log["input_1"].grad, first)  # no backward since: still whole
    log.backward(out.sum())
    if later == "python hook":
        with pytest.raises(tl.errors.GradientUnavailable, match="input_1.*removed"):
            log["input_1"].grad
        assert log["linear_1_1"].grad is not None  # the other records are unaffected
    else:
        assert torch.equal(log["input_1"].grad, 2 * first) and torch.equal(x.grad, 2 * first)


@pytest.mark.parametrize("path", PATHS)
def test_intervention_moves_the_hook_to_the_value_downstream_saw(path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    seen = model[0](x) * 2.0  # what tl.scale(2.0) hands downstream
    seen.retain_grad()
    model[2](model[1](seen)).pow(2).sum().backward()
    model.zero_grad()
    log = _trace(path, model, (x,), intervene={"0": tl.scale(2.0)})
    (op,) = [op for op in log if op.func_name == "linear" and op.module_address == "0"]
    out = log.output
    log.backward(out.pow(2).sum())
    assert torch.equal(op.grad, seen.grad)  # not the gradient of the op's own (replaced) output
    assert log.num_backwards == 1
    log.cleanup()
    assert not log._gradcap.handles and not _ours(out._backward_hooks)
    assert path != "cpp" or log._gradcap.add_hook.placed() == 0


@pytest.mark.parametrize("selection", [["relu", "head"], ["linear_2_3:1"]], ids=["types+module", "label"])
def test_selected_grads_identical_on_both_paths_and_unselected_hooks_removed(selection):
    records = []
    for path in PATH_NAMES:
        model, (x,), _ = zoo()["mlp"]
        with _on(path):
            log = tl.trace(model, x, grads=selection)
        assert type(log._gradcap._sink) is PATH_SETUP[path][2]
        out = log.output
        kept = set(log._gradcap.handles)  # hooks left after the selection: the selected records only
        assert kept == log._gradcap.selected and kept
        assert path != "cpp" or log._gradcap.add_hook.placed() == len(kept)
        log.backward(out.sum())
        assert set(log._gradcap.grads) <= kept
        records.append(_record(log, model))
        del log
        gc.collect()
        assert not _ours(out._backward_hooks)
    for other in records[1:]:
        _assert_same(records[0], other)


class _UserHooks(nn.Module):
    """A model whose forward registers a hook of its own that changes an intermediate's gradient."""

    def __init__(self, seen: list):
        super().__init__()
        self.a, self.b, self.seen = nn.Linear(4, 4), nn.Linear(4, 1), seen

    def forward(self, x):
        h = self.a(x)
        h.register_hook(lambda g: (self.seen.append("h"), g * 3)[1])  # before capture's own hook on h
        return self.b(torch.tanh(h))


def test_the_users_own_hooks_still_run_and_change_what_they_change_on_every_path():
    seen: list = []
    torch.manual_seed(0)
    model, x = _UserHooks(seen), torch.randn(2, 4, requires_grad=True)
    x.register_hook(lambda g: seen.append("x"))  # on the input, before any trace
    model(x).sum().backward()  # untraced: the reference
    expected = (x.grad.clone(), model.a.weight.grad.clone(), list(seen))
    records = []
    for path in PATH_NAMES:
        seen.clear()
        model.zero_grad()
        x.grad = None
        log = _trace(path, model, (x,))
        log.backward(log.output.sum())
        assert seen == expected[2] == ["h", "x"]  # each ran once
        assert torch.equal(x.grad, expected[0]) and torch.equal(model.a.weight.grad, expected[1])
        # capture's hook on h runs after the user's, as retain_grad()'s would: it holds what that hook returned
        (linear,) = [op for op in log.ops if op.func_name == "linear" and op.module_address == "a"]
        assert torch.allclose(model.a.bias.grad, linear.grad.sum(0))
        records.append(_record(log, model))
    for other in records[1:]:
        _assert_same(records[0], other)


class _FunctionOutputs(nn.Module):
    """Outputs whose backward node a custom Function sets when it returns, one with a hook of the user's."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)
        self.b.register_full_backward_hook(lambda module, grad_in, grad_out: None)
        self.kept = {}

    def forward(self, x):
        squared = Square.apply(self.a(x))
        passed = PassThrough.apply(squared)
        passed.register_hook(lambda g: g * 10)
        self.kept = {"squared": squared, "passed": passed}
        return self.b(passed.tanh())


@pytest.mark.parametrize("path", PATHS)
def test_function_outputs_get_the_gradient_retain_grad_gives_on_every_path(path):
    torch.manual_seed(0)
    model, x = _FunctionOutputs(), torch.randn(3, 4)
    out = model(x)
    for t in model.kept.values():
        t.retain_grad()
    out.retain_grad()
    out.sum().backward()
    expected = {k: t.grad for k, t in model.kept.items()}
    expected_out, expected_params = out.grad, [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    log = _trace(path, model, (x,))
    log.backward(log.output.sum())
    assert torch.equal(log["mul_1_2:1"].grad, expected["squared"])
    assert torch.equal(log["viewas_1_3:1"].grad, expected["passed"])  # after the user's hook, as retain_grad
    assert torch.equal(log["b"].grad, expected_out)  # the full backward hook's Function output
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected_params))



class _ViewsOfLeaves(nn.Module):
    """Ops whose backward hands a view of the trace's gradient to a leaf's ``.grad``: a parameter's view, a
    transpose of a view of one, a ``cat`` of parameters (its backward slices), and the input's transpose."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.gamma = nn.Parameter(torch.ones(4))
        self.w = nn.Parameter(torch.randn(4, 6))
        self.u, self.v = nn.Parameter(torch.randn(2)), nn.Parameter(torch.randn(2))

    def forward(self, x):
        h = self.conv(x) * self.gamma.view(1, -1, 1, 1)  # (2, 4, 6, 6)
        h = h.mean(dim=2) @ self.w.view(4, 6).t()  # (2, 4, 4)
        return h.sum(dim=1) * torch.cat([self.u, self.v]) + x.mean(dim=(2, 3)).T.sum()


@pytest.mark.parametrize("path", PATHS)
def test_in_place_changes_to_a_leafs_grad_leave_the_traced_gradients_as_they_were(path):
    """autograd stores a view of a gradient the trace keeps as a leaf's ``.grad`` without copying it: the trace
    copies such a gradient when the backward ends, so ``clip_grad_norm_``, ``zero_grad(set_to_none=False)`` or
    ``x.grad.zero_()`` afterwards change the leaf's ``.grad``, never the record (as with ``retain_grad()``)."""
    torch.manual_seed(0)
    model, x = _ViewsOfLeaves(), torch.randn(2, 3, 8, 8, requires_grad=True)
    oracle = Oracle()
    with oracle:
        out = model(x)
    _loss(out).backward()
    expected = oracle.grads()
    model.zero_grad(set_to_none=True)
    x.grad = None
    log = _trace(path, model, (x,))
    ops = [op for op in log if op.kind == "op"]
    assert {"view", "t", "cat"} <= {op.type for op in ops}
    for backward in (1, 2):  # the second accumulates into what the first kept
        log.backward(_loss(log.output), retain_graph=True)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        x.grad.zero_()
        model.zero_grad(set_to_none=False)
        _assert_bit_identical(ops, _op_grads(log)[1], [None if e is None else backward * e for e in expected])


class _FlattenedWeight(nn.Module):
    """A layer reading its weight through ``flatten(1)``, which returns a 2-D weight itself: the op's output
    is the parameter, a leaf."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.tanh(x @ self.weight.flatten(1).T)


def _flattened_weight():
    torch.manual_seed(0)
    model = _FlattenedWeight()
    return model, (torch.randn(3, 4, requires_grad=True),), {}


def _gpt2_embeddings():
    """GPT-2 run on input embeddings that require grad, as a saliency method runs it."""
    model, _, kwargs = _gpt2()
    embeds = model.transformer.wte(kwargs["input_ids"]).detach().requires_grad_()
    return model, (), {"inputs_embeds": embeds}


def _summed(output):
    return (output.logits if hasattr(output, "logits") else output).float().pow(2).mean()


@pytest.mark.parametrize("build", [_flattened_weight, _gpt2_embeddings], ids=["flattened-weight", "gpt2-embeds"])
@pytest.mark.parametrize("path", PATHS)
def test_a_later_forwards_backward_through_the_same_leaves_leaves_the_traced_gradients_alone(path, build):
    """An input that requires grad, and a parameter an op returns as it is, belong to every later graph too:
    the untraced backward of a saliency loop's next step, or of a training step, reaches the trace's hooks
    on them.  It adds nothing to the trace; a backward through the traced graph still adds to every op."""
    model, args, kwargs = build()
    log = _trace(path, model, args, kwargs)
    leaves = [op for op in log if op.requires_grad and op.grad_fn is None]
    assert leaves, "the model has no leaf op to test"
    log.backward(_summed(log.output), retain_graph=True)
    ops, first = _op_grads(log)
    ops, first = ops + leaves, first + [op.grad for op in leaves]
    grads = lambda: [op.grad if op.requires_grad else None for op in ops]  # noqa: E731
    for _ in range(2):  # later forwards on the same leaves, untraced
        _summed(model(*args, **kwargs)).backward()
    assert log.num_backwards == 1
    _assert_bit_identical(ops, grads(), first)
    log.backward(_summed(log.output))  # the traced graph again: every gradient accumulates
    assert log.num_backwards == 2
    _assert_bit_identical(ops, grads(), [None if g is None else g + g for g in first])


def test_an_in_place_shape_change_gets_its_own_gradient_on_every_path():
    # BigBird's block-sparse attention calls ``unsqueeze_`` on a matmul's output.  torch keeps the tensor's
    # hook dict, registered on the matmul's node, across that op: a hook added to it got the matmul's
    # gradient, of the shape before the op.  Each path now gives the op the gradient of its own output.
    pytest.importorskip("transformers")
    from real_models import bigbird

    def build():
        torch.manual_seed(0)
        model, args, kwargs = bigbird()
        return model.eval(), args, kwargs

    model, args, kwargs = build()
    oracle = Oracle("hook")
    torch.manual_seed(1)
    with oracle:
        out = model(*args, **kwargs)
    _loss(out).backward()
    for path in PATH_NAMES:
        log = _trace(path, *build())
        log.backward(_loss(log.output))
        ops, got = _op_grads(log)
        op = next(op for op in ops if op.func_name == "unsqueeze_" and op.requires_grad)
        assert op.grad.shape == op.shape, path
        _assert_bit_identical(ops, got, oracle.grads())
