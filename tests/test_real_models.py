"""The real-model corpus: standard architectures trace faithfully and validate without false verdicts.

Every entry of tests/real_models.py (``transformers`` models from small configs with random weights, and
``nn.LSTM``/``nn.GRU``/``nn.TransformerEncoder``), in eval mode with gradients on, in eval mode under
``no_grad`` and in train mode with dropout active:

- the traced output is bit-identical to an untraced run from the same seed, the trace draws exactly as
  much from the RNG, and nothing is left installed;
- every tensor an op read is a recorded parent or parameter;
- ``tl.validate`` finds no mismatch on these faithful traces, lists an op as random exactly when the
  forward draws from the RNG, and leaves the RNG and the model's parameters and buffers as one untraced
  forward would;
- a wrong saved activation, and a trace with nothing saved, are never reported as a pass;
- a saved trace loads back with the same labels, module calls, argument positions and activations;
- every reading of the record (NaN/Inf flags, the module table, the NaN search, the hot path) runs on it.

The ``transformers`` entries skip when ``transformers`` is not installed.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter

import pytest
import torch

import torchlens as tl
from real_models import CORPUS, MODES, TRANSFORMERS, build, in_mode, seed
from torchlens.tree import structures_equal, tensor_leaves
from untouched import assert_untouched, snapshot

SEED = 1234
CASES = [pytest.param(name, mode, id=f"{name}-{mode}") for name in CORPUS for mode in MODES]


def entry(name):
    if name in TRANSFORMERS:
        pytest.importorskip("transformers")
    return build(name)


def untraced(model, args, kwargs):
    """The output of a plain run from ``SEED``, and whether it drew from the RNG."""
    seed(SEED)
    start = torch.get_rng_state()
    out = model(*args, **kwargs)
    return out, not torch.equal(torch.get_rng_state(), start)


def input_tensors(args, kwargs):
    return [t for _, t in tensor_leaves((args, kwargs))]


def state_of(model) -> dict:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def rewind(model, state) -> None:
    """Parameters and buffers back to ``state`` (train-mode BatchNorm updates its running stats)."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(state[name])


@pytest.mark.parametrize("name, mode", CASES)
def test_traces_bit_identically(name, mode):
    model, args, kwargs = entry(name)
    with in_mode(model, mode):
        start = state_of(model)
        expected, _ = untraced(model, args, kwargs)
        after_untraced = torch.get_rng_state()
        rewind(model, start)
        before = snapshot(model, input_tensors(args, kwargs))
        seed(SEED)
        log = tl.trace(model, args, kwargs)
        after_traced = torch.get_rng_state()
        assert_untouched(before, snapshot(model, input_tensors(args, kwargs)))
    same, why = structures_equal(log.output, expected)
    assert same, why
    assert torch.equal(after_traced, after_untraced), "the trace drew a different amount from the RNG"
    ops = [op for op in log.ops if op.kind == "op"]
    assert ops
    # A complete graph: every tensor an op read is a recorded parent or parameter, none held live in its
    # recorded arguments, none from outside the trace.
    assert [op.label for op in ops if tensor_leaves((op.args, op.kwargs))] == []
    assert [op.label for op in ops if op.unattributed_args] == []


@pytest.mark.parametrize("name, mode", CASES)
def test_validates_without_false_alarms(name, mode):
    model, args, kwargs = entry(name)
    with in_mode(model, mode):
        start = state_of(model)
        _, draws = untraced(model, args, kwargs)
        after_one_forward = torch.get_rng_state(), state_of(model)
        rewind(model, start)
        seed(SEED)
        result = tl.validate(model, args, kwargs)
        after_validate = torch.get_rng_state(), state_of(model)
    assert result.outputs_match is True, str(result)
    assert result.mismatched == [], str(result)
    assert result.replayed > 0
    random = [label for label, reason in result.not_replayed if "random" in reason.lower()]
    if draws:
        assert random, f"the forward draws from the RNG, but no op is listed as random:\n{result}"
    else:
        assert not random, f"the forward draws nothing from the RNG, yet these are listed as random: {random}"
    assert torch.equal(after_validate[0], after_one_forward[0]), "validate left the RNG elsewhere than one forward"
    same, why = structures_equal(after_validate[1], after_one_forward[1])
    assert same, f"validate left the model's state elsewhere than one forward: {why}"


def test_train_mode_draws_where_dropout_is_active():
    # The corpus exercises random ops: in train mode the dropout-carrying entries do draw, in eval none do.
    drawing = set()
    for name in ("gpt2", "bert", "lstm", "transformer_encoder"):
        model, args, kwargs = entry(name)
        for mode in ("eval", "train"):
            with in_mode(model, mode):
                if untraced(model, args, kwargs)[1]:
                    drawing.add((name, mode))
    assert drawing == {(name, "train") for name in ("gpt2", "bert", "lstm", "transformer_encoder")}


def test_inference_path_takes_the_fast_path_with_nested_tensors():
    # The no_grad padded entry must run the path it is here for: the fused encoder layer on nested tensors.
    model, args, kwargs = build("transformer_encoder_padded")
    with in_mode(model, "eval_no_grad"):
        log = tl.trace(model, args, kwargs)
    names = {op.func_name for op in log.ops}
    assert "_transformer_encoder_layer_fwd" in names and "_nested_tensor_from_mask" in names, names


def _replayed_op(log, result, model):
    """A single-output op validate replayed whose saved float output shares its memory with no other
    saved tensor (a write into a shared one would make its neighbours wrong too) and with no parameter
    or buffer of the model (``weight.t()`` does)."""
    skipped = {label for label, _ in result.mismatched + result.not_replayed}
    saved = [op.activation for op in log.ops if op.has_activation and isinstance(op.activation, torch.Tensor)]
    saved += list(model.state_dict().values())
    sharing = Counter(t.untyped_storage().data_ptr() for t in saved if t.layout == torch.strided)
    candidates = [op for op in log.ops if op.kind == "op" and op.label not in skipped and op.has_activation
                  and op.multi_output_index is None and isinstance(op.activation, torch.Tensor)
                  and op.activation.is_floating_point() and op.activation.numel() > 0
                  and op.activation.layout == torch.strided
                  and sharing[op.activation.untyped_storage().data_ptr()] == 1]
    assert candidates, "nothing was replayed"
    return candidates[len(candidates) // 2]


@pytest.mark.parametrize("name", list(CORPUS))
def test_a_wrong_saved_activation_is_named(name):
    model, args, kwargs = entry(name)
    with in_mode(model, "eval"):
        seed(SEED)
        log = tl.trace(model, args, kwargs)
        planted = _replayed_op(log, log.validate(), model)
        with torch.no_grad():
            planted.activation.add_(1.0)  # as a user writing into a saved tensor (through NumPy, say) would
        result = log.validate()
    assert not result.passed
    named = {label for label, _ in result.mismatched + result.not_replayed}
    assert planted.label in named, str(result)


@pytest.mark.parametrize("name", list(CORPUS))
def test_nothing_saved_is_not_a_pass(name):
    model, args, kwargs = entry(name)
    with in_mode(model, "eval"):
        unsaved = tl.trace(model, args, kwargs, save="none")
        cleaned = tl.trace(model, args, kwargs)
    cleaned.cleanup()
    for log in (unsaved, cleaned):
        result = log.validate()
        assert result.replayed == 0
        assert not result.passed, f"nothing was checked, yet: {result}"


@pytest.mark.parametrize("name", list(CORPUS))
def test_a_saved_trace_loads_back_equal(name, tmp_path):
    model, args, kwargs = entry(name)
    with in_mode(model, "eval"):
        log = tl.trace(model, args, kwargs)
    loaded = tl.load(log.save(tmp_path / name))
    assert loaded.labels == log.labels
    assert [c.label for c in loaded.module_calls] == [c.label for c in log.module_calls]
    assert [c.parents for c in loaded.calls] == [c.parents for c in log.calls]
    for label in log.labels:
        op = log[label]
        if op.has_activation and isinstance(op.activation, torch.Tensor) and op.activation.layout == torch.strided:
            # NaN-aware: DeepSeek-V3's new_empty is uninitialized memory, whose bits may read as NaN.
            assert structures_equal(loaded[label].activation, op.activation)[0], label
    assert str(loaded).splitlines()[1:3] == str(log).splitlines()[1:3]


@pytest.mark.parametrize("name", list(CORPUS))
def test_every_reading_of_the_record_runs_on_it(name):
    # Under no_grad, the standard inference path (nested tensors in the padded encoder): NaN/Inf flags taken
    # during capture, the module table, the NaN search and the hot path all read every op's record.
    model, args, kwargs = entry(name)
    with in_mode(model, "eval_no_grad"):
        log = tl.trace(model, args, kwargs, record_finite=True)
    floats = [op for op in log.ops if op.kind == "op" and op.has_activation
              and isinstance(op.activation, torch.Tensor) and op.activation.is_floating_point()]
    for op in floats:  # the flags taken during capture, against the saved values read here
        parts = op.activation.unbind() if op.activation.is_nested else (op.activation,)
        assert op.finite == (any(bool(p.isnan().any()) for p in parts),
                             any(bool(p.isinf().any()) for p in parts)), op.label
    report = tl.debug.nonfinite_origin(log)  # masks hold -inf; uninitialized memory (new_empty) may hold NaN
    assert bool(report) == any(any(op.finite) for op in floats if op.label not in report.uninitialized)
    produced = sum(op.nbytes for op in log.ops if op.kind == "op" and not op.is_inplace)
    assert log.summary().rows[0]["activation_bytes"] == produced
    assert len(tl.debug.hot_path(log, by="memory", group="module").rows) > 0


def _corpus_script():
    """scripts/validate_corpus.py, loaded as a module."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "validate_corpus.py")
    spec = importlib.util.spec_from_file_location("validate_corpus", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_corpus_script_counts_every_run(capsys):
    # scripts/validate_corpus.py is how the false-alarm and false-pass figures are produced: keep it running.
    script = _corpus_script()
    assert script.main(["lstm", "gru", "--modes", "eval,train", "--plants", "2"]) == 0
    out = capsys.readouterr().out
    assert "runs: 4 (2 models x 2 modes), crashed: 0" in out
    assert "traced == untraced: 4 of 4" in out
    assert "planted activations missed: 0 of 8" in out, out


class MaskedScores(torch.nn.Module):
    """Scores masked with float32's lowest value, made by ``torch.full`` (as ProphetNet's decoder does)."""

    def forward(self, x):
        lowest = torch.full((), torch.finfo(x.dtype).min)
        return torch.where(x > 0, x * 2, lowest).softmax(-1)


def test_corpus_script_plants_only_values_that_adding_one_changes():
    # float32's lowest plus one is itself: a plant there changed nothing, validate rightly passed, and the
    # script counted a false pass (ProphetNet in train mode).
    script = _corpus_script()
    log = tl.trace(MaskedScores(), torch.randn(2, 4, generator=torch.Generator().manual_seed(0)))
    candidates = [op.func_name for op in script.plant_candidates(log, log.validate())]
    assert "full" not in candidates and "mul" in candidates
