"""``tl.debug.nonfinite_origin``: the forward op where a NaN/Inf was born, on constructed models."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.debug.nonfinite import DETECT_ANOMALY_CODE
from accel_paths import PATHS, on_path


def line_of(func, needle: str) -> int:
    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, text in enumerate(lines) if needle in text)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.log(h - 100.0) * 2  # every element negative before log: NaN is born here


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.ReLU(), Inner())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(x).relu() + 1)


def test_nan_born_deep_inside_a_module_is_named_with_its_call_and_line():
    log = tl.trace(Deep().eval(), torch.randn(3, 4))
    report = tl.debug.nonfinite_origin(log)
    assert report.found and report.certain and report.kind == "nan" and report.origin_kind == "op"
    assert report.origin.func_name == "log"
    assert report.module == "block.1:1"
    assert report.source.line == line_of(Inner.forward, "torch.log")
    downstream = [op.label for op in log.ops if op.kind == "op" and op.index > report.origin.index]
    assert list(report.propagators) == downstream  # mul, relu, add, head
    assert report.origin_label in str(report)


def test_inf_from_exp_is_kind_inf():
    log = tl.trace(lambda x: torch.exp(x * 100.0).sum(), torch.full((3,), 10.0))
    report = tl.debug.nonfinite_origin(log)
    assert report.origin.func_name == "exp" and report.kind == "inf"
    assert [log[label].func_name for label in report.propagators] == ["sum"]


def test_nan_and_inf_in_one_output_is_kind_both():
    log = tl.trace(lambda x: torch.log(x) / x, torch.tensor([-1.0, 0.0, 2.0]))
    report = tl.debug.nonfinite_origin(log)
    assert report.origin.func_name == "log" and report.kind == "both"


def test_nan_in_the_input_is_reported_as_already_present():
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    log = tl.trace(nn.Linear(4, 2), x)
    report = tl.debug.nonfinite_origin(log)
    assert report.origin_kind == "input" and report.origin.label == "input_1:1"
    assert "already present in input" in str(report)
    assert [log[label].func_name for label in report.propagators] == ["linear"]


def test_nan_in_a_parameter_is_reported_as_already_present():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    report = tl.debug.nonfinite_origin(tl.trace(model, torch.randn(3, 4)))
    assert report.origin_kind == "parameter" and report.parameters == ("2.weight",)
    assert report.origin.module == "2:1"
    assert "parameter(s) 2.weight" in str(report)


def test_a_parameter_an_optimizer_step_made_non_finite_since_the_trace_is_not_blamed():
    """The training step after a forward whose loss overflowed: the backward's Inf gradients leave the weights
    Inf after ``optimizer.step()``.  The report read the parameters as they are now and blamed them for the
    forward's Inf ("already present in parameter(s)"), though the forward read them finite."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from zoo import MLP

    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.layers[0].weight.fill_(1e38)  # finite, but their sum overflows
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tl.trace(model, torch.ones(4, 16))
    before = tl.debug.nonfinite_origin(log)
    assert before.origin_kind == "op" and before.certain and before.origin_label == "linear_1_1:1"
    (log.output ** 2).sum().backward()
    optimizer.step()
    assert not torch.isfinite(model.layers[0].weight).all()
    after = tl.debug.nonfinite_origin(log)
    assert after.origin_kind == "op" and after.origin_label == "linear_1_1:1" and not after.certain
    assert "(parameter layers.0.weight, changed since the trace)" in after.possible_origins
    assert after.parameters == () and "layers.0.weight" in after.parameters_changed
    assert "changed since the trace (an optimizer step?) were not checked" in str(after)


class Healed(nn.Module):
    def forward(self, x):
        y = torch.log(x)  # x < 0: NaN
        return torch.nan_to_num(y, nan=0.0) + 1


def test_nan_healed_by_nan_to_num_is_still_found_when_its_birth_was_examined():
    x = -torch.rand(5) - 0.1
    report = tl.debug.nonfinite_origin(tl.trace(Healed(), x))
    assert report.found and report.origin.func_name == "log" and not report.propagators


def test_nan_healed_among_unexamined_ops_is_a_documented_miss_unless_flags_were_recorded():
    x = -torch.rand(5) - 0.1
    log = tl.trace(Healed(), x, save=["nantonum"])  # log's output was not kept
    miss = tl.debug.nonfinite_origin(log)
    assert not miss.found
    assert "log_1_1:1" in miss.unexamined and "not examined" in str(miss)
    flagged = tl.debug.nonfinite_origin(tl.trace(Healed(), x, save=["nantonum"], record_finite=True))
    assert flagged.found and flagged.origin.func_name == "log"


def test_unsaved_ancestors_that_could_be_the_origin_are_named():
    log = tl.trace(Deep().eval(), torch.randn(3, 4), save=["linear"])
    report = tl.debug.nonfinite_origin(log)
    assert report.found and not report.certain
    assert report.origin.func_name == "linear" and report.origin.module == "head:1"
    log_op = next(op.label for op in log.ops if op.func_name == "log")
    assert log_op in report.possible_origins
    first_linear = next(op.label for op in log.ops if op.func_name == "linear")
    assert first_linear not in report.possible_origins  # examined and finite: the walk stops there
    assert "may be among" in str(report) and "unexamined ancestor" in str(report)


def test_a_long_list_of_possible_origins_is_shortened_in_the_printed_report():
    """A save= selection of one late module leaves every op before it unexamined: the report named each of
    them on one line (over a hundred labels for a 2-layer Llama); it shows a few and where the rest are."""
    class SqrtBelowZero(nn.Module):
        def forward(self, h):
            return torch.sqrt(h - 2.0)  # tanh's outputs are below 1: NaN everywhere

    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(12)], SqrtBelowZero())
    x = torch.randn(2, 4)
    log = tl.trace(model, x, save=["12"])
    report = tl.debug.nonfinite_origin(log)
    assert report.found and not report.certain and len(report.possible_origins) > 20
    line = next(line for line in str(report).splitlines() if "may be among" in line)
    assert f"{len(report.possible_origins)} unexamined ancestors" in line
    assert f"(all {len(report.possible_origins)} in report.possible_origins)" in line
    assert report.possible_origins[-1] not in line and "record_finite=True" in line
    assert tl.debug.nonfinite_origin(tl.trace(model, x, save="none", record_finite=True)).certain


def test_both_evidence_bases_agree_and_flags_survive_cleanup():
    x = torch.randn(3, 4)
    from_activations = tl.debug.nonfinite_origin(tl.trace(Deep().eval(), x))
    log = tl.trace(Deep().eval(), x, save="none", record_finite=True)
    log.cleanup()
    from_flags = tl.debug.nonfinite_origin(log)
    assert from_flags.origin_label == from_activations.origin_label
    assert from_flags.propagators == from_activations.propagators
    assert from_flags.basis == "recorded finite flags" and not from_flags.parameters_checked


def test_a_cleaned_up_trace_without_flags_is_refused_clearly():
    log = tl.trace(Deep().eval(), torch.randn(3, 4))
    log.cleanup()
    with pytest.raises(tl.TraceCleanedUp, match="record_finite=True"):
        tl.debug.nonfinite_origin(log)
    with pytest.raises(ValueError, match="nothing to examine"):
        tl.debug.nonfinite_origin(tl.trace(Deep().eval(), torch.randn(3, 4), save="none"))


def test_a_trace_loaded_without_its_activations_is_described_as_such(tmp_path):
    x = torch.randn(3, 4)
    model = Deep().eval()
    full = tl.debug.nonfinite_origin(tl.trace(model, x))
    # Saved with activations=False: tracing with save='all' again would not help, saving them would.
    tl.trace(model, x).save(tmp_path / "meta", activations=False)
    with pytest.raises(ValueError, match="saved with activations=False"):
        tl.debug.nonfinite_origin(tl.load(tmp_path / "meta"))
    # With flags, the origin is found from them alone, and the report says so.
    tl.trace(model, x, record_finite=True).save(tmp_path / "flags", activations=False)
    from_flags = tl.debug.nonfinite_origin(tl.load(tmp_path / "flags"))
    assert from_flags.origin_label == full.origin_label and from_flags.propagators == full.propagators
    assert from_flags.basis == "recorded finite flags"
    unsaved = tl.debug.nonfinite_origin(tl.trace(model, x, save="none", record_finite=True))
    assert unsaved.basis == "recorded finite flags"


def test_a_meta_device_forward_is_named_as_the_reason_nothing_was_examined():
    # Asking for flags on a meta model must not read as "you forgot record_finite=True".
    with torch.device("meta"):
        model, x = Deep().eval(), torch.randn(3, 4)
    log = tl.trace(model, x, record_finite=True)
    with pytest.raises(ValueError, match="meta device"):
        tl.debug.nonfinite_origin(log)


def test_every_reader_gives_the_same_flags_for_the_same_values():
    # record_finite during capture, nonfinite_origin over saved activations, and the viewer's marks
    # all answer from one check: the same ops are marked whichever is asked.
    log = tl.trace(lambda x: (torch.log(x - 10).relu(), (x > 0).long(), torch.sqrt(x)), torch.rand(4),
                   save="none", record_finite=True)
    from torchlens.viz.metrics import nonfinite_marks
    flagged = {log.labels[i] for i, (nan, inf) in log.finite_flags.items() if nan or inf}
    saved_only = tl.trace(lambda x: (torch.log(x - 10).relu(), (x > 0).long(), torch.sqrt(x)), torch.rand(4))
    marked = {saved_only.labels[i] for i, bad in enumerate(nonfinite_marks(saved_only)) if bad}
    assert {log[label].func_name for label in flagged} == {"log", "relu"}
    # The viewer also marks the output node that repeats relu's tensor, from flags or from values.
    assert marked == flagged | {"output_1:1"}
    assert {log.labels[i] for i, bad in enumerate(nonfinite_marks(log)) if bad} == marked


def test_two_independent_births_are_both_reported():
    log = tl.trace(lambda x: (torch.log(x - 10), torch.sqrt(x - 10)), torch.rand(4))
    report = tl.debug.nonfinite_origin(log)
    births = [report.origin_label, *report.other_origins]
    assert [log[label].func_name for label in births] == ["log", "sqrt"]


class BackwardNaN(nn.Module):
    """Finite forward (sqrt(0) * 0 = 0) whose backward multiplies 0 by sqrt's infinite slope at 0."""

    def forward(self, x):
        return torch.sqrt(x * 0) * 0


def test_backward_born_nan_is_outside_the_forward_and_the_recipe_finds_it():
    x = torch.randn(3, requires_grad=True)
    report = tl.debug.nonfinite_origin(tl.trace(BackwardNaN(), x))
    assert not report.found
    assert tl.debug.DETECT_ANOMALY_RECIPE in str(report)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="SqrtBackward0.*nan"):
        exec(DETECT_ANOMALY_CODE, {"model": BackwardNaN(), "x": x})


def test_the_recipe_is_word_for_word_the_same_in_every_report():
    found = str(tl.debug.nonfinite_origin(tl.trace(Deep().eval(), torch.randn(3, 4))))
    clean = str(tl.debug.nonfinite_origin(tl.trace(nn.Linear(4, 2), torch.randn(3, 4))))
    recipe = tl.debug.DETECT_ANOMALY_RECIPE
    assert found.endswith(recipe) and clean.endswith(recipe)
    assert "torch.autograd.set_detect_anomaly(True)" in recipe
    assert all(f"    {line}" in recipe for line in DETECT_ANOMALY_CODE.splitlines() if line)


def test_later_non_finite_ops_fed_by_unexamined_ops_are_not_called_independent_origins():
    chain = lambda x: torch.log(x - 10).mul(2).relu().add(1)  # noqa: E731
    log = tl.trace(chain, torch.rand(4), save=["mul", "add"])
    report = tl.debug.nonfinite_origin(log)
    assert report.origin.func_name == "mul" and not report.certain
    assert [log[label].func_name for label in report.undetermined] == ["add"]
    assert report.other_origins == () and "cannot tell" in str(report)


def test_device_flags_are_read_back_once_after_the_forward():
    from torchlens.record.finite import drained_flags

    flags = {0: torch.tensor([True, False]), 1: (False, False), 2: torch.tensor([False, True])}
    assert drained_flags(flags) == {0: (True, False), 1: (False, False), 2: (False, True)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_finite_flags_on_cuda_find_the_origin():
    log = tl.trace(Deep().eval().cuda(), torch.randn(3, 4, device="cuda"), save="none", record_finite=True)
    assert all(isinstance(flag, tuple) for flag in log._finite.values())
    assert tl.debug.nonfinite_origin(log).origin.func_name == "log"


def _nan_in_unit_3(t, op):
    return t.masked_fill(torch.arange(t.shape[-1]) == 3, float("nan"))


@pytest.mark.parametrize("site", ["transformer.h.0.mlp", "dropout_3_53:1"])
def test_a_nan_an_intervention_put_in_is_the_actions_not_the_ops(site):
    """GPT-2's MLP makes finite values; the action writes NaN into them.  The report names the intervention,
    not the op as having produced NaN from finite inputs, and a probe (an action keeping the value) at the same
    site on a finite forward leaves nothing to report."""
    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    model, tokens = small_gpt2_lm(), torch.tensor([[5, 9, 13, 21, 7, 30]])
    plain = tl.trace(model, tokens)
    assert bool(plain["transformer.h.0.mlp"].activation.isfinite().all())
    log = tl.trace(model, tokens, intervene={site: _nan_in_unit_3})
    report = tl.debug.nonfinite_origin(log)
    assert report.origin_kind == "intervention" and report.certain and report.origin_label == "dropout_3_53:1"
    assert torch.equal(report.origin.original, plain["transformer.h.0.mlp"].activation)
    assert report.origin.activation.isnan().any() and "the op's own value was finite" in str(report)
    assert "produced NAN from finite inputs" not in str(report)
    assert report.propagators and report.propagators[0] == "add_6_54:1"
    probed = tl.trace(model, tokens, intervene={site: lambda t, op: None})
    assert not tl.debug.nonfinite_origin(probed).found


def test_with_flags_only_a_nan_where_an_intervention_ran_is_not_pinned_on_either():
    """Without the op's own value (save="none"), the flags say the value downstream saw held NaN, not who made it."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).eval()
    log = tl.trace(model, torch.randn(4, 8), save="none", record_finite=True, intervene={"0": _nan_in_unit_3})
    report = tl.debug.nonfinite_origin(log)
    assert report.origin_kind == "intervention" and not report.certain
    assert "either the op or the action may have made it" in str(report)


def test_a_nan_the_op_made_itself_is_the_ops_though_an_action_then_ran():
    """The op's own value (op.original) already held NaN: the action that scaled it did not make it."""
    model = Inner().eval()  # its log makes NaN
    x = torch.randn(3, 4)
    label = next(op.label for op in tl.trace(model, x).ops if op.func_name == "log")
    log = tl.trace(model, x, intervene={label: tl.scale(2.0)})
    assert log[label].original.isnan().any()
    report = tl.debug.nonfinite_origin(log)
    assert report.origin_label == label and report.origin_kind == "op" and report.certain


class Float8Cast(nn.Module):
    """Simulated float8 storage of an activation: e5m2 overflows to Inf past 57344; e4m3fn saturates."""

    def __init__(self, dtype):
        super().__init__()
        self.fc, self.dtype = nn.Linear(4, 4), dtype

    def forward(self, x):
        stored = (self.fc(x) * 1e5).to(self.dtype)
        return stored.float().abs().sum()


@pytest.mark.parametrize("dtype, flags", [(torch.float8_e5m2, (False, True)), (torch.float8_e4m3fn, (False, False))])
def test_float8_values_are_examined_as_the_float32_values_they_are(tmp_path, dtype, flags):
    # torch has no CPU isfinite, min or norm for some float8 dtypes: readers of values raised
    # NotImplementedError (record_finite=True during the trace, nonfinite_origin, the html viewer, the
    # gradient statistics of to_pandas and of log.save).
    torch.manual_seed(0)
    model, x = Float8Cast(dtype), torch.randn(3, 4)
    flagged = tl.trace(model, x, record_finite=True)
    cast = next(op for op in flagged if op.dtype == dtype)
    assert cast.finite == flags and flagged["mul_1_2:1"].finite == (False, False)
    for log in (flagged, tl.trace(model, x)):  # from the flags, and from the saved activations
        origin = tl.debug.nonfinite_origin(log).origin
        assert (origin.label if origin is not None else None) == (cast.label if any(flags) else None)
    from torchlens.viz.metrics import nonfinite_marks
    assert nonfinite_marks(tl.trace(model, x))[cast.index] is any(flags)
    assert str(dtype).split(".")[1] in tl.trace(model, x).render(format="html")
    grads = tl.trace(model, x, grads=True)
    grads.output.backward()
    row = grads.to_pandas().set_index("label").loc[cast.label]
    expected = grads[cast.label].grad.float()
    assert (row.grad_min, row.grad_max, row.grad_nonfinite) == (float(expected.min()), float(expected.max()), 0)
    loaded = tl.load(grads.save(tmp_path / "run"))
    assert torch.equal(loaded[cast.label].grad.float(), expected)


@pytest.mark.parametrize("flags", [False, True])
def test_uninitialized_memory_holding_nan_is_no_origin(flags):
    """DeepSeek-V3 builds its key states in a ``new_empty`` and writes them into two slices of it.  With
    ``torch.use_deterministic_algorithms(True)`` torch fills such memory with NaN, and before, the report
    named the ``new_empty`` as the origin of a NaN "from finite inputs" (its slices as further origins),
    although every value the model computed with was written first.  Those values are set aside by name,
    and the real origin, the router's -inf mask, is named."""
    pytest.importorskip("transformers")
    from real_models import build

    model, args, kwargs = build("deepseek_v3")
    model.eval()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.no_grad():
            log = tl.trace(model, args, kwargs, record_finite=flags)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    empties = [op for op in log.ops if op.func_name == "new_empty"]
    assert empties and all(op.activation.isnan().all() for op in empties)  # what the model overwrote
    report = tl.debug.nonfinite_origin(log)
    assert report.origin.func_name == "masked_fill" and report.kind == "inf" and report.certain
    assert {op.label for op in empties} <= set(report.uninitialized)
    assert not {op.label for op in empties} & set(report.other_origins + report.propagators)
    assert "not evidence: " in str(report)


def test_a_returned_parameter_is_not_marked_by_the_last_op():
    """An output node showing a tensor no op made (producer -1) has no producer flag to copy: reading flags[-1]
    marked a returned parameter non-finite whenever the model's last output held a NaN."""
    from torchlens.viz.metrics import nonfinite_marks

    class ReturnsWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return self.w, torch.log(x - 5)  # the second output is NaN

    log = tl.trace(ReturnsWeight(), torch.ones(3), save=["log"])
    weight_out, nan_out = log.outputs
    marks = nonfinite_marks(log)
    assert marks[nan_out.index] is True and marks[weight_out.index] is None


def test_a_collective_with_unexamined_inputs_still_says_to_look_at_every_rank(monkeypatch):
    # With unexamined ancestors beside the other ranks' values, the report gave only the generic advice (trace with
    # record_finite=True), though one of its possible origins is on another rank. The collective is stood for by
    # the log of this one-process forward: what marks an op as a collective of several ranks is patched in.
    import torchlens.debug.nonfinite as nonfinite

    log = tl.trace(lambda x: (x * 2).log() + 1, torch.tensor([-1.0, 2.0]), save=["log"])
    monkeypatch.setattr(nonfinite, "_from_other_ranks", lambda trace, i: trace.labels[i].startswith("log"))
    report = tl.debug.nonfinite_origin(log)
    assert not report.certain and nonfinite.OTHER_RANKS in report.possible_origins
    assert "it is a collective, so run nonfinite_origin on every rank too" in str(report)


class _ScaledByAPlainAttribute(nn.Module):
    """Reads a tensor held as a plain attribute, not a buffer: the trace has no value or flag for it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = torch.tensor([float("nan"), 1.0, 1.0, 1.0])

    def forward(self, x):
        return self.fc(x) * self.scale


def test_a_tensor_made_outside_the_trace_is_advised_on_as_such_not_by_recording_flags_again():
    model = _ScaledByAPlainAttribute()
    report = tl.debug.nonfinite_origin(tl.trace(model, torch.randn(2, 4), save="none", record_finite=True))
    assert not report.certain and report.possible_origins == ("(a tensor made outside the trace)",)
    assert "record_finite=True" not in str(report) and "register_buffer" in str(report)
    model.register_buffer("scale", model.__dict__.pop("scale"))  # now the trace examines it
    report = tl.debug.nonfinite_origin(tl.trace(model, torch.randn(2, 4), save="none", record_finite=True))
    assert report.certain and report.origin_kind == "buffer"


def test_recorded_finite_flags_are_a_column_of_to_pandas_that_survives_cleanup():
    log = tl.trace(Deep(), torch.randn(3, 4), save="none", record_finite=True)
    log.cleanup()
    frame = log.to_pandas().set_index("label")
    origin = tl.debug.nonfinite_origin(log).origin_label
    assert frame.loc[origin, "finite"] == (True, False) == log[origin].finite
    assert frame.loc["input_1:1", "finite"] == (False, False)
    assert "finite" not in tl.trace(Deep(), torch.randn(3, 4)).to_pandas().columns


def _packed_as(dtype):
    """Bytes viewed as ``dtype`` and read back as bytes: a forward holding a value torch can barely compute on."""
    return lambda codes: codes.view(dtype).view(torch.uint8).float()


@pytest.mark.parametrize("compiled", PATHS)
def test_packed_float4_and_bits_values_are_read_rather_than_failing_the_readers(compiled):
    # torch has no isfinite for float4_e2m1fn_x2 and no conversion of torch.bits8 or torch.uint4 values:
    # record_finite=True failed the trace, and nonfinite_origin and the html viewer raised NotImplementedError.
    from torchlens.viz.records import activation_stats

    codes = torch.tensor([0x21, 0x7F], dtype=torch.uint8)  # float4 codes 1, 2, 15, 7: 0.5, 1.0, -6.0, 6.0
    with on_path(compiled):
        for dtype in (torch.float4_e2m1fn_x2, torch.bits8, torch.uint4):
            log = tl.trace(_packed_as(dtype), codes, record_finite=True)
            assert log["view_1_1"].dtype == dtype and log["view_1_1"].finite == (False, False)
            assert tl.debug.nonfinite_origin(log).origin is None and "view_1_1" in log.render(format="html")
    float4 = activation_stats(codes.view(torch.float4_e2m1fn_x2))
    assert (float4["numel"], float4["min"], float4["max"], float4["nan"], float4["inf"]) == (2, -6.0, 6.0, 0, 0)
    assert activation_stats(codes.view(torch.bits8)) == {"numel": 2}
