"""Tracing a callable that is not a module: its module names come from the module behind it, and the extra runs
of validate and flops_vs_dispatch put back the modules it runs."""

from __future__ import annotations

import copy
import functools
import os
import threading

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from test_validate_trust import Stateful
from trusted import assert_trusted

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(20, 8)
        self.proj = nn.Linear(8, 8)

    def embed(self, ids):
        return self.proj(self.tokens(ids))

    def forward(self, ids):
        return self.embed(ids).sum(-1)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval(), torch.randint(0, 100, (1, 5))


def test_a_bound_method_names_modules_from_its_owner():
    model = Embedder()
    log = tl.trace(model.embed, torch.tensor([[1, 2, 3]]))
    assert [c.label for c in log.module_calls] == ["tokens:1", "proj:1"]
    assert log.model_name == "Embedder.embed"
    assert not any("unregistered" in m.address for m in log.modules)
    assert log["proj"].func_name == "linear"


def test_a_torch_function_traced_alone_is_named_as_it_is_called():
    # torch.relu's qualified name is _VariableFunctionsClass.relu, the class torch keeps its functions in.
    assert tl.trace(torch.relu, torch.randn(3)).model_name == "relu"
    assert str(tl.trace(torch.sigmoid, torch.randn(3))).splitlines()[0] == "Trace of sigmoid"


def test_generate_names_every_module_and_numbers_the_steps():
    model, ids = _gpt2()
    log = tl.trace(model.generate, (ids,), {"max_new_tokens": 2, "do_sample": False})
    assert not any("unregistered" in m.address for m in log.modules)
    roots = [c.label for c in log.module_calls if c.address == "self"]
    assert roots == ["self:1", "self:2"]  # one root call per generated token
    heads = [op for op in log.ops if op.module and op.module.startswith("lm_head:")]
    assert [(op.pass_index, op.modules[0]) for op in heads] == [(1, "self:1"), (2, "self:2")]
    assert heads[0].layer_label == heads[1].layer_label  # the same layer, one pass per step
    assert "lm_head:2" in [r["call"] for r in log.summary().rows]
    assert log.summary()[0]["class_name"] == "GPT2LMHeadModel"


def test_every_repeated_op_of_a_generate_step_has_that_steps_pass():
    model, ids = _gpt2()
    attention_calls = []  # the steps each attention layer ran in, seen by plain forward hooks
    for block in model.transformer.h:
        block.attn.register_forward_pre_hook(lambda m, a: attention_calls.append(m))
    log = tl.trace(model.generate, (ids,), {"max_new_tokens": 3, "do_sample": False})
    assert len(attention_calls) == 2 * 3
    for op in log.ops:
        if op.modules and op.modules[0].startswith("self:") and op.num_passes > 1:
            assert op.pass_index == int(op.modules[0][len("self:"):]), (op.label, op.modules[0])
    # The prefill step's attention (a longer query, an empty cache) is still the first pass of each site.
    attention = [op for op in log.ops if op.func_name == "scaled_dot_product_attention"]
    assert len(attention) == len(attention_calls)
    assert sorted({op.num_passes for op in attention}) == [3]


def test_a_module_the_first_generate_step_skips_is_numbered_from_the_step_that_first_runs_it():
    """Given ``inputs_embeds``, generate()'s first step looks up no token: the embedding's call 1 and its lookup's
    pass 1 are the second step's, which the root call each ran in names (tracing.md said the pass of every op
    the model ran is the decoding step)."""
    model, ids = _gpt2()
    embeds = model.transformer.wte(ids).detach()
    generate = {"inputs_embeds": embeds, "max_new_tokens": 3, "do_sample": False}
    log = tl.trace(model.generate, (), generate)
    assert torch.equal(log.output, model.generate(**generate))
    assert [log[f"lm_head:{step}"].modules[0] for step in (1, 2, 3)] == ["self:1", "self:2", "self:3"]
    lookups = [op for op in log.ops if op.module and op.module.startswith("transformer.wte:")]
    assert [(op.pass_index, op.modules[0]) for op in lookups] == [(1, "self:2"), (2, "self:3")]


def test_root_names_the_module_behind_a_lambda():
    model, ids = _gpt2()
    plain = tl.trace(lambda x: model(x).logits, ids)
    assert any("unregistered" in m.address for m in plain.modules)
    log = tl.trace(lambda x: model(x).logits, ids, root=model)
    labels = [c.label for c in log.module_calls]
    assert labels[:3] == ["self:1", "transformer:1", "transformer.wte:1"]
    assert log.model_name == "GPT2LMHeadModel"
    assert log.outputs[0].shape == (1, 5, 100)
    kept = tl.trace(lambda x: model(x).logits, ids, root=model, save=["lm_head"])
    assert kept["lm_head"].has_activation


def test_an_address_asked_of_a_callable_given_no_root_says_to_pass_root():
    # log["fc"] of `lambda x: model(x)` said only that no such name is in the trace, and save=["fc"] that "a
    # selection takes module addresses, not module classes", since "fc"... matched a class name by substring.
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 4))
    x = torch.randn(2, 4)
    plain = tl.trace(lambda t: model(t), x)
    no_root = r"\(the traced callable is no module and was given no root=, so its modules have no addresses, only " \
              r"names such as <unregistered Sequential #1>: pass root= the module it runs"
    with pytest.raises(KeyError, match=rf"no op, layer, module call or module named 'fc' in this trace {no_root}"):
        plain["fc"]
    with pytest.raises(tl.UnmatchedSelection, match=rf"save= matched nothing for it {no_root}") as refused:
        tl.trace(lambda t: model(t), x, save=["fc"])
    assert "module classes" not in str(refused.value)
    with pytest.raises(KeyError) as mistyped:  # a mistyped label is answered with the closest labels alone
        plain["linaer_1_1:1"]
    assert "closest: linear_1_1:1" in str(mistyped.value) and "root=" not in str(mistyped.value)
    assert tl.trace(lambda t: model(t), x, root=model)["fc"].label == "linear_1_1:1"
    # Given root=, a module the forward makes is unregistered too, but root= was given: no such note.
    made = tl.trace(lambda t: model(t) + nn.Linear(4, 4)(t), x, root=model)
    with pytest.raises(KeyError) as unknown:
        made["head"]
    assert "root=" not in str(unknown.value) and any("unregistered" in m.address for m in made.modules)


def test_a_partial_of_a_module_or_of_its_method_names_modules_from_that_module():
    """``functools.partial`` is how a fixed keyword (an attention mask, ``use_cache=False``) is bound to a
    model: the module behind it names the modules, as for the bound method itself."""
    model, ids = _gpt2()
    mask = torch.ones_like(ids)
    plain = tl.trace(model, (ids,), {"attention_mask": mask})
    for fn, calls in ((functools.partial(model, attention_mask=mask),
                       ["self:1"] + [c.label for c in plain.module_calls]),
                      (functools.partial(model.forward, attention_mask=mask), [c.label for c in plain.module_calls])):
        log = tl.trace(fn, ids)
        assert [c.label for c in log.module_calls] == calls
        assert torch.equal(log.output.logits, plain.output.logits)
        assert tl.validate(fn, ids).passed


def _forward_replaced_by_a_wrapper(model):
    """Replaces ``model.forward`` as accelerate's ``add_hook_to_module`` does: a partial of a function taking
    the module, marked by ``functools.update_wrapper`` as wrapping the bound forward it calls."""
    original = model.forward

    def hooked_forward(module, *args, **kwargs):
        return original(*args, **kwargs) * 2

    model.forward = functools.update_wrapper(functools.partial(hooked_forward, model), original)
    return model


def test_a_forward_replaced_by_a_wrapper_of_the_bound_forward_names_modules_from_its_module():
    torch.manual_seed(0)
    model, x = _forward_replaced_by_a_wrapper(nn.Sequential(nn.Linear(4, 4), nn.ReLU())), torch.randn(2, 4)
    log = tl.trace(model.forward, x)
    assert torch.equal(log.output, model[1](model[0](x)) * 2)
    assert [c.label for c in log.module_calls] == ["0:1", "1:1"]
    assert log["linear_1_1"].params == ("0.weight", "0.bias")
    assert_trusted(tl.validate(model.forward, x))


def test_the_tensors_a_partial_binds_are_inputs_named_by_the_forward():
    """A mask bound in the partial is read by the forward as much as one passed: it is an input, named by the
    forward's parameter, so the ops that read it have it as a parent (not a tensor of unknown origin) and
    replay; the passed ids are named by the forward's parameter too, not the partial's ``*args``."""
    model, ids = _gpt2()
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    plain = tl.trace(model, (ids,), {"attention_mask": mask})
    expected = [(op.io_path, op.shape) for op in plain.inputs]
    assert expected == [("input.input_ids", (1, 5)), ("input.attention_mask", (1, 5))]
    for fn in (functools.partial(model, attention_mask=mask), functools.partial(model.forward, attention_mask=mask),
               functools.partial(functools.partial(model.forward), attention_mask=mask)):
        log = tl.trace(fn, ids)
        assert [(op.io_path, op.shape) for op in log.inputs] == expected
        assert log.unattributed == 0
        assert log["input_2"].children == plain["input_2"].children
        result = tl.validate(fn, ids)
        assert_trusted(result)
        assert not result.not_replayed, result.not_replayed


def test_root_must_be_a_module_and_agree_with_a_module_model():
    model = Embedder()
    with pytest.raises(TypeError, match="root= must be an nn.Module"):
        tl.trace(lambda x: model(x), torch.tensor([[1]]), root="model")
    with pytest.raises(ValueError, match="already a module"):
        tl.trace(model, torch.tensor([[1]]), root=nn.Linear(1, 1))
    # Beside a module, root="model" was a ValueError calling the string another module: "root= is another (str)".
    with pytest.raises(TypeError, match="root= must be an nn.Module .*, not str"):
        tl.trace(model, torch.tensor([[1]]), root="model")


def test_a_root_the_callable_never_runs_is_refused_not_shown_as_its_trace():
    # tl.trace(lambda x: gpt2(x).logits, ids, root=other) gave "Trace of Linear" with every module unregistered.
    model, ids = _gpt2()
    with pytest.raises(ValueError, match=r"ran none of root=Linear and none of its submodules "
                                         r"\(it ran GPT2LMHeadModel, "
                                         r"GPT2Model, Embedding and \d+ more"):
        tl.trace(lambda x: model(x).logits, ids, root=nn.Linear(2, 2))
    # A root whose submodule alone runs, or whose parameter alone is read, is the model the callable runs.
    head = tl.trace(lambda x: model.lm_head(model.transformer(x).last_hidden_state), ids, root=model)
    assert head.module_calls[-1].label == "lm_head:1"
    weight = tl.trace(lambda x: nn.functional.linear(model.transformer(x).last_hidden_state, model.lm_head.weight), ids,
                      root=model.lm_head)
    assert weight.ops[-2].params == ("weight",)


# ----- the extra runs of validate and flops_vs_dispatch put back the modules a callable runs ---------------
@pytest.mark.parametrize("root", [False, True], ids=["no-root", "root"])
def test_a_callable_is_validated_with_the_modules_it_runs_put_back(root):
    """A lambda cannot be copied with its model: the reference run is made on the model itself, and the
    modules it runs (those of ``root=``, or each one met as it runs) are put back before the traced run."""
    torch.manual_seed(0)
    model, x = Stateful(), torch.randn(2, 3)
    model.bn = nn.BatchNorm1d(3).train()
    once = copy.deepcopy(model)
    once.bn(once(x))
    result = tl.validate(lambda t: model.bn(model(t)), x, **({"root": model} if root else {}))
    assert_trusted(result)
    assert result.outputs_match is True
    assert model.calls == once.calls == 1  # the output depends on the counter: one forward's worth
    assert all(torch.equal(v, once.state_dict()[k]) for k, v in model.state_dict().items())
    assert torch.equal(model.seen, once.seen)



def test_the_modules_another_thread_runs_meanwhile_are_not_put_back():
    """The modules of a lambda are noted as it calls them; a model another thread runs at the same time is
    not the lambda's, and its update must stay."""
    other, inside, done = Stateful(), threading.Event(), threading.Event()

    class WaitsForTheOtherThread(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            if not done.is_set():  # the reference run: let the other thread run its model now
                inside.set()
                done.wait(10)
            return self.fc(x)

    def run_other():
        inside.wait(10)
        other(torch.randn(2, 3))
        done.set()

    model, thread = WaitsForTheOtherThread(), threading.Thread(target=run_other)
    thread.start()
    result = tl.validate(lambda x: model(x), torch.randn(2, 3))
    thread.join()
    assert done.is_set() and result.passed
    assert other.calls == 1  # its forward happened, and stays

@pytest.mark.parametrize("how", ["lambda", "bound method"])
def test_flops_vs_dispatch_of_a_callable_compares_runs_from_the_same_model(how):
    """Its two runs each start from the model as the call found it, and it ends so, whatever callable runs
    it: a lambda or a bound method was refused as running two different programs (the counter moved)."""
    torch.manual_seed(0)
    model, x = Stateful(), torch.randn(2, 3)
    start = copy.deepcopy(model.state_dict())
    run = (lambda t: model(t)) if how == "lambda" else model.forward
    result = tl.report.flops_vs_dispatch(run, x)
    assert result.native_total == 2 * 2 * 3 * 3  # FlopCounterMode's count of the Linear's product
    assert model.calls == 0 and all(torch.equal(v, start[k]) for k, v in model.state_dict().items())


def test_a_module_site_on_a_callable_without_root_says_to_pass_root():
    """A lambda running ``generate()`` names no modules until ``root=`` says which module it runs: a module
    site is refused naming ``root=``, and with it the site edits the call of that decoding step, as a hook."""
    model, ids = _gpt2()
    generate = lambda x: model.generate(x, max_new_tokens=3, do_sample=False)  # noqa: E731
    with pytest.raises(KeyError, match="pass root= the module it runs") as caught:
        tl.trace(generate, ids, intervene={"lm_head:2": tl.scale(-1.0)})
    assert "'<lambda>'" in str(caught.value)
    calls = []

    def negate_the_second_call(module, args, output):
        calls.append(module)
        return -output if len(calls) == 2 else None

    handle = model.lm_head.register_forward_hook(negate_the_second_call)
    try:
        expected = generate(ids)
    finally:
        handle.remove()
    assert not torch.equal(expected, generate(ids))  # the edit changes the token decoded at step 2
    log = tl.trace(generate, ids, root=model, intervene={"lm_head:2": tl.scale(-1.0)})
    assert torch.equal(log.output, expected)
    assert [applied.label for applied in log.interventions] == [log["lm_head:2"].label]


class Countdown(nn.Module):
    """Calls itself ``n`` times before its Linear: a recursion through the module's own call."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x, n):
        return self.fc(x) if n == 0 else self(x + 1, n - 1)


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Countdown()

    def forward(self, x, n):
        return self.inner(x, n)


def test_a_root_calling_itself_records_those_calls_as_a_child_calling_itself_does():
    x = torch.randn(2, 4)
    nested = tl.trace(Holder(), (x, 2))
    assert [c.label for c in nested.module_calls] == ["inner:1", "inner:2", "inner:3", "inner.fc:1"]
    model = Countdown()
    log = tl.trace(model, (x, 2))
    # Call 1 of the root is the trace itself (no module call); the calls it makes of itself are calls 2 and 3.
    assert [c.label for c in log.module_calls] == ["self:2", "self:3", "fc:1"]
    assert [c.parent.label if c.parent else None for c in log.module_calls] == [None, "self:2", "self:3"]
    assert log["linear_1_2:1"].modules == ("self:2", "self:3", "fc:1")
    assert [op.modules for op in log.ops if op.func_name == "add"] == [(), ("self:2",)]
    # and the op its calls repeat is one layer with a pass per call, as in the nested model
    assert [op.label for op in log.ops] == [op.label for op in nested.ops] == \
        ["input_1:1", "add_1_1:1", "add_1_1:2", "linear_1_2:1", "output_1:1"]
    assert torch.equal(log.output, model(x, 2)) and tl.validate(model, (x, 2)).passed
    assert [c.label for c in tl.trace(model, (x, 0)).module_calls] == ["fc:1"]  # no recursion: as before


@pytest.mark.parametrize("how", ["recursion", "callable"])
def test_a_call_of_the_root_itself_as_an_intervention_site_is_refused_saying_what_to_do(how):
    model, x = Countdown(), torch.randn(2, 4)
    if how == "recursion":
        fn, args, site, kwargs = model, (x, 2), "self:2", {}
    else:
        fn, args, site, kwargs = (lambda t: model(t, 1)), (x,), "self:1", {"root": model}
    assert site in [c.label for c in tl.trace(fn, args, **kwargs).module_calls]  # a module call of the trace
    with pytest.raises(KeyError, match=f"'{site}' is a call of the root module itself .* intervene on the op "
                                       "labels inside them or on the root's submodules"):
        tl.trace(fn, args, intervene={site: tl.zero_ablate()}, **kwargs)


def test_a_function_traced_without_a_model_gives_tables_with_their_columns_and_no_rows():
    """Its module calls, modules, parameters and buffers are empty, and their tables had no columns at all, so code
    reading ``frame["address"]`` over several traces failed on this one with a KeyError."""
    log = tl.trace(lambda x: x.sin() * 2, torch.randn(3))
    model_log = tl.trace(nn.Sequential(nn.BatchNorm1d(3)).eval(), torch.randn(2, 3))  # four tables with rows
    for name in ("module_calls", "modules", "params", "buffers"):
        empty, full = getattr(log, name).to_pandas(), getattr(model_log, name).to_pandas()
        assert len(empty) == 0 and len(full) > 0
        assert list(empty.columns) == list(full.columns) and "address" in full.columns
