"""A trace is freed by reference counting the moment nothing refers to it, however much of it was read.

Every record a trace hands out is a view made on demand (``Op``, ``Layer``, ``ModuleCall``, ``Module``,
``Param``, ``Buffer``), and the trace keeps none of them, so there is no reference cycle for the
collector to find: dropping a trace frees its activations, its output and the autograd graph that output
holds at once.  Each case below runs with the collector off, reads the trace the way users do (every
record, the tables, the printed summary, gradients, interventions, a saved and reloaded copy), drops it,
and checks that it and its tensors are gone.  A record held on its own keeps its trace alive and usable.
"""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
from torch.overrides import handle_torch_function, has_torch_function

import real_models
import torchlens as tl
from real_models import build
from torchlens.tree import tensor_leaves
from zoo import zoo


def _read_everything(log) -> None:
    str(log), repr(log), str(log.summary()), log.summary().to_pandas()
    for records in (log.ops, log.layers, log.module_calls, log.modules, log.params, log.buffers):
        records.to_pandas()
        list(records)
    for op in log.ops:
        op.parents, op.children, op.module_call, op.layer, op.source, op.modules, op.activation, op.call
    for layer in log.layers:
        layer.ops, layer.first
    for call in log.module_calls:
        call.ops, call.children, call.parent, call.module.calls, call.input_ops, call.output_ops
    for param in log.params:
        param.ops
    log[log.labels[1]], log[log.op_layer_labels[1]], log.flops
    tl.debug.hot_path(log)


def _tensors_of(log, *held) -> list:
    """Weak references to what a dropped trace must free: its saved activations and its output, but for
    the tensors someone else holds (the inputs the caller passed, the model's parameters and buffers,
    which inputs and buffer ops save by reference)."""
    others = {id(t) for t in held}
    if log.model is not None:
        others |= {id(t) for t in (*log.model.parameters(), *log.model.buffers())}
    kept = [*log.saved_activations.values(), *(op.activation for op in log.outputs if op.activation is not None)]
    return [weakref.ref(t) for t in kept if id(t) not in others]


def _inputs(args, kwargs) -> list:
    return [t for _, t in tensor_leaves((args, kwargs))]


def _assert_freed(trace_ref, tensor_refs) -> None:
    assert trace_ref() is None, "the dropped trace is still alive: something forms a reference cycle"
    assert not [r for r in tensor_refs if r() is not None], "tensors of the dropped trace are still alive"


@pytest.mark.parametrize("name", ["gpt2", "bert", "lstm"])
def test_a_fully_read_trace_of_a_real_model_is_freed_when_dropped(name, no_collector):
    model, args, kwargs = build(name)
    log = tl.trace(model.eval(), args, kwargs)
    _read_everything(log)
    refs = weakref.ref(log), _tensors_of(log, *_inputs(args, kwargs))
    del log
    _assert_freed(*refs)


@pytest.mark.parametrize("name", sorted(zoo()))
def test_every_zoo_trace_read_whole_is_freed_when_dropped(name, no_collector):
    model, args, kwargs = zoo()[name]
    log = tl.trace(model, args, kwargs)
    _read_everything(log)
    refs = weakref.ref(log), _tensors_of(log, *_inputs(args, kwargs))
    del log
    _assert_freed(*refs)


def test_a_trace_with_gradients_frees_them_and_the_graph_of_its_output(no_collector):
    model, args, kwargs = build("gpt2")
    model.train()
    log = tl.trace(model, args, kwargs, grads=True, saved_for_backward=True)
    output = weakref.ref(log.output.logits)  # holds the autograd graph until the backward frees it
    log.backward(log.output.logits.sum(), retain_graph=True)  # the graph stays: only the trace holds it
    grads = [weakref.ref(op.grad) for op in log.ops if op.has_grad]
    assert grads
    log.to_pandas(), log.saved_for_backward_bytes, str(log.saved_for_backward()), log.params[0].grad
    _read_everything(log)
    trace = weakref.ref(log)
    del log
    assert trace() is None and output() is None
    assert not [g for g in grads if g() is not None]
    model.zero_grad(set_to_none=True)


def test_an_intervened_trace_is_freed_with_its_originals(no_collector):
    model, args, kwargs = build("gpt2")
    log = tl.trace(model.eval(), args, kwargs, intervene={"transformer.h.0": tl.zero_ablate()})
    originals = [weakref.ref(op.original) for op in log.ops if op.intervention is not None and op.original is not None]
    assert originals and log.interventions
    _read_everything(log)
    refs = weakref.ref(log), _tensors_of(log, *_inputs(args, kwargs))
    del log
    _assert_freed(*refs)
    assert not [o for o in originals if o() is not None]


@pytest.mark.parametrize("site", ["1:1", "linear_2_3", "2"])
def test_a_trace_stopped_early_frees_its_model_and_inputs_when_dropped(site, no_collector):
    """stop_after= ends the forward by an exception the capture state notes as it leaves each module call: kept,
    it held the forward's frames, so the model and its inputs lived on in a cycle only the collector frees."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2), torch.nn.Tanh())
    x = torch.randn(3, 4)
    log = tl.trace(model, x, stop_after=site)
    assert log.stopped_after is not None and log.output is None
    _read_everything(log)
    refs = weakref.ref(log), _tensors_of(log, x)
    dropped = weakref.ref(model), weakref.ref(x)
    del log, model, x
    _assert_freed(*refs)
    assert not [r for r in dropped if r() is not None], "the stopped trace left its model or input in a cycle"


class _FallsBack(torch.nn.Module):
    """Tries one path and falls back on another when it raises, as models do around optional kernels: the
    exception comes out of a module call (``module``) or out of a torch call in the forward itself (``op``)."""

    def __init__(self, raises: str):
        super().__init__()
        self.raises = raises
        self.fast, self.slow = torch.nn.Linear(5, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        try:
            return self.fast(x) if self.raises == "module" else torch.mm(x, self.fast.weight.T)
        except RuntimeError:  # the shapes do not match: the other path
            return self.slow(x).relu()


@pytest.mark.parametrize("raises", ["module", "op"])
def test_a_trace_whose_forward_caught_an_exception_is_freed_when_dropped(raises, no_collector):
    """The capture state notes where an exception left a module call or a torch call; the exception's traceback
    holds the forward's frames, which hold that state: kept past the forward, the activations lived on in a
    cycle that only the collector frees."""
    model, x = _FallsBack(raises), torch.randn(3, 4)
    log = tl.trace(model, x)
    assert torch.equal(log.output, model(x)) and log.ops[-2].type == "relu"  # the path it fell back on
    _read_everything(log)
    refs = weakref.ref(log), _tensors_of(log, x)
    assert refs[1]
    del log
    _assert_freed(*refs)


def test_a_loaded_trace_is_freed_when_dropped(tmp_path, no_collector):
    model, args, kwargs = zoo()["small_cnn"]
    tl.trace(model, args, kwargs).save(tmp_path / "run")
    loaded = tl.load(tmp_path / "run")
    str(loaded), loaded.to_pandas(), loaded.module_calls.to_pandas()
    [(op.parents, op.module_call, op.activation) for op in loaded.ops]  # no name left holding an op
    refs = weakref.ref(loaded), _tensors_of(loaded)
    del loaded
    _assert_freed(*refs)


def test_a_record_held_alone_keeps_its_trace_alive_and_readable(no_collector):
    model, args, kwargs = zoo()["small_cnn"]
    log = tl.trace(model, args, kwargs)
    label, expected = log.labels[2], log.ops[2].activation.clone()
    op, call, layer = log[label], log.module_calls[0], log.layers[1]
    trace = weakref.ref(log)
    del log
    assert trace() is not None  # held by the records
    assert op.label == label and torch.equal(op.activation, expected)
    assert call.ops and call.module.calls[0] == call and layer.first.layer_label == layer.layer_label
    del op, call, layer
    assert trace() is None


def test_records_are_views_equal_by_what_they_address():
    model, args, kwargs = zoo()["small_cnn"]
    log = tl.trace(model, args, kwargs)
    assert log.ops[3] == log[log.labels[3]] and hash(log.ops[3]) == hash(log[log.labels[3]])
    assert log.module_calls[0] == log.module_calls[0] and log.module_calls[0] != log.module_calls[-1]
    assert log.ops[3].layer == log.layers_by_label[log.op_layer_labels[3]]
    assert len({log.modules[0], log.modules[0], log.modules[-1]}) == (2 if len(log.modules) > 1 else 1)
    assert log.ops == log.ops and list(log.ops[1:3]) == [log.ops[1], log.ops[2]]
    other = tl.trace(model, args, kwargs)
    assert log.ops[3] != other.ops[3]  # the same address in another trace is another record


class _FailsInABlock(torch.nn.Module):
    """Five layers' activations, then a failure: a torch op of a submodule (``shape``) or the forward's own
    ``raise`` (``model``)."""

    def __init__(self, how: str):
        super().__init__()
        self.layer, self.head, self.how = torch.nn.Linear(16, 16), torch.nn.Linear(3, 3), how

    def forward(self, x):
        for _ in range(5):
            x = torch.relu(self.layer(x))
        if self.how == "model":
            raise ValueError("the model's own error")
        return self.head(x)  # 16 features into a Linear of 3: the op raises


def _doubled_noting(given: list):
    """An intervention action that doubles each value, noting (weakly) the original it is given."""
    def action(t, op):
        given.append(weakref.ref(t))
        return t * 2
    return action


@pytest.mark.parametrize("how", ["shape", "model"])
@pytest.mark.parametrize("option", ["plain", "grads", "saved_for_backward", "record_finite", "intervened"])
def test_a_failed_traces_exception_holds_no_activation_and_no_cycle(how, option, no_collector):
    """A kept exception (a notebook keeps the last one) keeps what an untraced forward's exception keeps, not
    every activation (or intervened op's original value) the abandoned trace saved; dropping it frees the model
    by reference counting."""
    model, x = _FailsInABlock(how), torch.randn(4, 16)
    made = []
    model.layer.register_forward_hook(lambda module, inputs, output: made.append(weakref.ref(output)))
    options = {"intervene": {"layer": _doubled_noting(made)}} if option == "intervened" else \
        {} if option == "plain" else {option: True}
    # Without gradients an intervened op's kept original is the very tensor the action was given (with them,
    # a detached alias of it, which a weak reference to that tensor cannot follow).
    with pytest.raises((RuntimeError, ValueError)) as raised, torch.set_grad_enabled(option != "intervened"):
        tl.trace(model, x, **options)
    assert len(made) == (10 if option == "intervened" else 5)
    assert "torchlens: raised" in "\n".join(raised.value.__notes__)
    assert not [r for r in made if r() is not None], "the kept exception holds the failed trace's activations"
    dropped = weakref.ref(model)
    del model, raised
    assert dropped() is None, "the failed trace left a reference cycle: only the collector frees the model"


def _fails_on_its_second_run(runs: list) -> torch.nn.Module:
    """A model that runs once (a label site's reference pass), then raises in the intervened run.  It counts its
    runs in ``runs``, outside its attributes, which the reference pass puts back as they were."""

    class FailsOnItsSecondRun(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(16, 16)

        def forward(self, x):
            runs.append(x.shape)
            if len(runs) == 2:
                raise ValueError("the model's own error")
            return torch.relu(self.layer(x))

    return FailsOnItsSecondRun()


def test_a_failed_label_site_runs_exception_holds_no_reference_trace(no_collector):
    """A label site is resolved against a reference trace, which holds its output, and each site's op views it:
    a kept exception of the intervened run that failed keeps neither."""
    runs, returned = [], []
    model = _fails_on_its_second_run(runs)
    model.register_forward_hook(lambda module, inputs, output: returned.append(weakref.ref(output)))
    with pytest.raises(ValueError) as raised:
        tl.trace(model, torch.randn(4, 16), intervene={"relu_1_2": lambda t, op: t * 2})
    assert len(runs) == 2 and len(returned) == 1 and "torchlens: raised" in "\n".join(raised.value.__notes__)
    assert returned[0]() is None, "the kept exception holds the reference trace and its output"


@pytest.mark.parametrize("refusal", ["save", "site"])
def test_a_trace_refused_after_its_forward_leaves_no_activation_in_the_exception(refusal, no_collector):
    """A save= entry that matched nothing, or an intervention site the forward never reached, is refused once the
    forward has run and the trace is made: the kept refusal held that trace, and every activation it saved."""
    model, made = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()), []
    model[0].register_forward_hook(lambda module, inputs, output: made.append(weakref.ref(output)))
    options = {"save": ["linear", "conv2d"]} if refusal == "save" else {"intervene": {"0:2": lambda t, op: t * 2}}
    with pytest.raises((tl.UnmatchedSelection, tl.InterventionError), match="conv2d|never reached") as raised:
        tl.trace(model, torch.randn(4, 16), **options)
    assert len(made) == 1 and made[0]() is None, "the kept refusal holds the trace's activations"
    dropped = weakref.ref(model)
    del model, raised
    assert dropped() is None, "the refused trace left a reference cycle: only the collector frees the model"


class _DropsCycles(torch.nn.Module):
    """Each step drops an object that refers to itself and holds a tensor: garbage only the collector frees.
    With ``collect``, the forward then calls ``gc.collect()`` once (a full collection of a test process's
    heap takes seconds; one frees every step's cycle as three would)."""

    def __init__(self, collect: bool):
        super().__init__()
        self.collect, self.seen = collect, []

    def forward(self, x):
        import gc

        for _ in range(3):
            node = {"value": x * 2}
            node["self"] = node
            self.seen.append(weakref.ref(node["value"]))
            del node
        if self.collect:
            gc.collect()
        self.seen.append(gc.isenabled())
        return x + 1


@pytest.mark.parametrize("collect", [False, True])
def test_the_collector_waits_for_the_trace_to_end_and_an_explicit_collect_still_runs(collect):
    # docs/capture_honesty.md ("The cycle collector"): paused during the forward, as the user left it after.
    import gc

    assert gc.isenabled()
    model = _DropsCycles(collect)
    tl.trace(model, torch.randn(3), save="none")
    *values, enabled_inside = model.seen
    assert enabled_inside is False and gc.isenabled()
    if collect:  # the forward's own gc.collect() freed each step's cycle
        assert all(value() is None for value in values)
    gc.collect()
    assert all(value() is None for value in values)


def _forward_replaced(model):
    """``model`` with a forward of its own that calls the one it had, as a patching wrapper sets it: the new
    forward's closure holds the old bound forward, which holds the model."""
    old = model.forward

    def forward(self, *args, **kwargs):
        return old(*args, **kwargs).logits * 2

    model.forward = types.MethodType(forward, model)
    return model


def _forward_closing_over(weight):
    """A model whose class is made around ``weight``, which its forward's closure holds."""

    class Projection(torch.nn.Module):
        def forward(self, x):
            return x @ weight

    return Projection()


def _scaling_by(weight):
    """A model whose forward calls a function of its own that speaks torch's protocol (as library functions do:
    recorded as one op), made around ``weight``, which the function's closure holds."""

    def scaled(x):
        if has_torch_function((x,)):
            return handle_torch_function(scaled, (x,), x)
        return x * weight.mean()

    class Scaling(torch.nn.Module):
        def forward(self, x):
            return scaled(x.relu())

    return Scaling()


def _passing_through(weight):
    """As ``_scaling_by``, with a function that returns its argument itself (as eval-mode dropout does), called
    in a submodule (a pass-through is noted inside a module call)."""

    def kept(x):
        if has_torch_function((x,)):
            return handle_torch_function(kept, (x,), x)
        return x if weight.numel() else x * weight

    class PassingThrough(torch.nn.Module):
        def forward(self, x):
            return kept(x.relu()) + 1

    return torch.nn.Sequential(PassingThrough())


_MADE_AROUND = {"forward closing over a tensor": _forward_closing_over, "protocol function": _scaling_by,
                "protocol function returning its argument": _passing_through}


@pytest.mark.parametrize("kind", ["forward replaced", *_MADE_AROUND])
def test_what_the_functions_of_a_traced_model_hold_is_freed_with_it(kind):
    """The signature of a module's forward was cached per forward function, which the cache held: a forward set
    on the model, whose closure leads back to it, kept the model and its parameters alive once it and its
    trace were dropped, as a forward closing over a tensor kept the tensor, until 256 other forwards had been
    traced; and the in-place verdict of each function a trace records was kept for the life of the process (in
    two caches, one for a function returning its argument), a function made with its model among them.  Each is
    a cycle that a collection frees untraced (a model and its bound forward, a class and its functions), so the
    test collects."""
    if kind == "forward replaced":
        model, args, kwargs = real_models.gpt2()
        model = _forward_replaced(model.eval())
        held = weakref.ref(model)
    else:
        weight = torch.randn(4, 4)
        model, args, kwargs, held = _MADE_AROUND[kind](weight), (torch.randn(2, 4),), {}, weakref.ref(weight)
        del weight
    log = tl.trace(model, args, kwargs)
    assert torch.equal(log.output, model(*args, **kwargs))
    del model, log
    gc.collect()
    assert held() is None



def test_the_code_of_a_function_made_at_run_time_is_freed_with_it(no_collector):
    """Capture classifies the code of each frame it walks once (user code, torch's, its own) and kept every code
    object it classified for the life of the process: code made at run time (by ``exec``, as ``torch.fx`` makes
    each GraphModule's forward) stayed in memory once its function and the trace were dropped, one more per
    function traced; reading the trace's labels and source lines kept it too, until thousands of others were
    read."""
    x = torch.randn(3, 4)
    codes = []
    for _ in range(2):  # the second trace classifies its frames with the first one's verdicts cached
        namespace: dict = {}
        exec(compile("def made(x):\n    return (x * 2).relu()\n", "<made at run time>", "exec"), namespace)
        made = namespace.pop("made")
        log = tl.trace(made, x)
        assert torch.equal(log.output, made(x))
        assert log.ops[1].type == "mul" and log.ops[1].source.function == "made"  # labels and lines: read per code
        codes.append(weakref.ref(made.__code__))
        del made, log
    assert not [code for code in codes if code() is not None]
