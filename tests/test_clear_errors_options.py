"""Nothing silently ignored: an option of a trace, of tl.validate or of a reader of a trace that would be misread,
ignored or fail midway is refused before anything runs, saying what was wrong and what to give."""

from __future__ import annotations

import re

import pytest
import torch

import torchlens as tl
from zoo import MLP


def test_a_budget_or_save_device_that_cannot_work_is_refused_before_the_forward():
    # max_saved_bytes='1GB' failed at the first saved tensor ("'>' not supported"); -1, meant as no limit, saved
    # nothing; save_device='cuda' on a machine without CUDA failed mid-forward with an AssertionError.
    from untouched import assert_untouched, snapshot

    model, x = MLP().eval(), torch.randn(2, 16)
    before = snapshot(model, (x,))
    with pytest.raises(TypeError, match=r"max_saved_bytes='1GB' is a str; give a number of bytes "
                                        r"\(2\*\*30 for 1 GiB\)"):
        tl.trace(model, x, max_saved_bytes="1GB")
    with pytest.raises(ValueError,
                       match="max_saved_bytes=-1 is negative; give a number of bytes .* or None for no limit"):
        tl.trace(model, x, max_saved_bytes=-1)
    # NaN compares false with every size, so a NaN budget saved everything: no limit, without a word.
    with pytest.raises(ValueError, match=r"max_saved_bytes=nan is not a number \(NaN\); give a number of bytes"):
        tl.trace(model, x, max_saved_bytes=float("nan"))
    unusable = ["gpu"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in unusable:
        with pytest.raises(ValueError, match=rf"save_device='{device}': saved tensors cannot be moved there"):
            tl.trace(model, x, save_device=device)
    # save_device='meta' was taken, and every saved activation held a shape and no values.
    with pytest.raises(ValueError, match=r"save_device='meta': a meta tensor holds no values.*such as 'cpu', or "
                                         r"save='none' to record shapes"):
        tl.trace(model, x, save_device="meta")
    assert_untouched(before, snapshot(model, (x,)))
    assert tl.trace(model, x, max_saved_bytes=2**20, save_device="cpu")["head"].has_activation


def test_the_readers_of_a_trace_given_the_model_say_to_trace_it_first():
    # nonfinite_origin(model, x) failed with "Boolean value of Tensor with more than one value is ambiguous" (x
    # read as grads=), hot_path(model) with "'GPT2LMHeadModel' object has no attribute 'ops'".
    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    gpt2, ids = small_gpt2_lm(), torch.randint(0, 64, (1, 6))
    with pytest.raises(TypeError, match=r"nonfinite_origin takes a Trace \(log = tl\.trace\(model, x\)\), got "
                                        r"GPT2LMHeadModel: trace the model first"):
        tl.debug.nonfinite_origin(gpt2, ids)
    with pytest.raises(TypeError, match=r"hot_path takes a Trace .*, got GPT2LMHeadModel"):
        tl.debug.hot_path(gpt2)
    log = tl.trace(gpt2, ids)
    with pytest.raises(TypeError, match=r"nonfinite_origin: grads=tensor\(.* is a Tensor, not True or False; "
                                        r"give True or "
                                        r"False: nonfinite_origin reads the trace alone and runs nothing"):
        tl.debug.nonfinite_origin(log, ids)
    assert not tl.debug.nonfinite_origin(log).found and tl.debug.hot_path(log).rows


def test_options_that_would_be_misread_or_ignored_are_refused_before_the_forward():
    # deep="yes" was taken as True, name=3 as a display name, and reference= without intervene= or stop_after=
    # was silently ignored.
    from untouched import assert_untouched, snapshot

    model, x = MLP().eval(), torch.randn(2, 16)
    before = snapshot(model, (x,))
    with pytest.raises(TypeError, match="deep='yes' is a str, not True or False; give True"):
        tl.trace(model, x, deep="yes")
    # record_finite="no" and saved_for_backward="no" were true to Python, so each did what it said not to.
    with pytest.raises(TypeError, match="record_finite='no' is a str, not True or False; give True to record"):
        tl.trace(model, x, record_finite="no")
    with pytest.raises(TypeError, match="saved_for_backward=0 is an int, not True or False"):
        tl.trace(model, x, saved_for_backward=0)
    with pytest.raises(TypeError, match=r"name= takes a string .*got int 3"):
        tl.trace(model, x, name=3)
    reference = tl.trace(model, x, save="none")
    with pytest.raises(ValueError, match=r"reference= .* this call gives neither, so it would be ignored"):
        tl.trace(model, x, reference=reference)
    assert_untouched(before, snapshot(model, (x,)))
    assert repr(tl.trace(model, x, deep=True, name="mlp")).startswith("<Trace of mlp")
    assert tl.trace(model, x, reference=reference, intervene={"relu_1_2": tl.scale(2.0)}).interventions


def test_validate_names_its_own_unknown_keyword_and_the_trace_option_meant():
    # tl.validate(m, x, grad=True) reported "trace() got an unexpected keyword argument 'grad'", naming a function
    # the user did not call; save= clashed with the save="all" validate passes ("multiple values").
    model, x = MLP().eval(), torch.randn(2, 16)
    with pytest.raises(TypeError, match=r"tl\.validate\(\) got an unexpected keyword argument 'grad'.*closest: grads"):
        tl.validate(model, x, grad=True)
    with pytest.raises(TypeError, match=r"tl\.validate\(\) saves every activation .* takes no save="):
        tl.validate(model, x, save="none")
    # intervene= and stop_after= made another run than the untraced one it is compared with: "validation FAILED"
    # for a faithful trace.
    for option, value in (("intervene", {"layers.0": tl.zero_ablate()}), ("stop_after", "layers.0")):
        with pytest.raises(ValueError, match=rf"tl\.validate\(\) compares the trace with an untraced run of the model, "
                                             rf"which {option}= would not change.* call log\.validate\(\)"):
            tl.validate(model, x, **{option: value})
    assert tl.trace(model, x, intervene={"layers.0": tl.zero_ablate()}).validate().passed
    assert tl.validate(model, x, record_finite=True).passed


@pytest.mark.parametrize("option", ["save", "grads"])
def test_a_predicate_that_raises_reaches_the_caller_naming_the_op_it_was_given(option):
    # The predicate's own exception came with no word of the op it was called with, nor of when.
    def needs_a_module(op):
        return op.module.startswith("1")  # an op outside every module has None there, which has no startswith

    from untouched import assert_clean_process

    with pytest.raises(AttributeError) as raised:
        tl.trace(MLP(), torch.randn(2, 16), **{option: needs_a_module})
    notes = raised.value.__notes__
    assert len(notes) == 1 and re.fullmatch(rf"torchlens: raised by the {option}= predicate, called after the forward "
                                            r"with op \w+:1; no trace is returned", notes[0]), notes
    assert_clean_process()


def test_a_record_given_where_its_name_is_asked_for_is_answered_with_that_name(tmp_path):
    # log[op], save=[op], intervene={op: ...}, stop_after=op and layers=[op] (an op of another trace, say) said
    # only that a string was wanted, leaving the user to find which attribute holds it.
    model, x = MLP(), torch.randn(2, 16)
    log = tl.trace(model, x)
    records = [(log["linear_1_1:1"], "label, 'linear_1_1:1'"), (log.layers[1], "layer label, 'linear_1_1'"),
               (log.module_calls[0], "call label, 'layers.0:1'"), (log.modules[0], "address, 'layers.0'")]
    for record, name in records:
        uses = [lambda: log[record], lambda: tl.trace(model, x, save=[record]),
                lambda: tl.trace(model, x, intervene={record: tl.zero_ablate()}),
                lambda: tl.trace(model, x, stop_after=record),
                lambda: tl.extract(model, [x], [record], tmp_path / "feats", progress=False)]
        for use in uses:
            with pytest.raises((TypeError, ValueError), match=f"; give its {name}$"):
                use()


def test_an_option_whose_truth_was_read_before_its_type_is_refused_in_its_own_name():
    # intervene="" or 0 was taken for no interventions, without a word; intervene=, deep= or (beside stop_after=)
    # grads= given a tensor failed with "Boolean value of Tensor ... is ambiguous"; grads="none" beside stop_after=
    # was refused as asking for gradients; kernel_profile(activities="") profiled the default activities.
    from untouched import assert_untouched, snapshot

    model, x, vector = MLP().eval(), torch.randn(2, 16), torch.ones(2)
    before = snapshot(model, (x,))
    for intervene in ("", 0, vector):
        with pytest.raises(TypeError, match=r"intervene= takes a dict \{site: action\}, got (str|int|Tensor)$"):
            tl.trace(model, x, intervene=intervene)
    with pytest.raises(TypeError, match=r"deep=tensor\(.* is a Tensor, not True or False"):
        tl.trace(model, x, deep=vector)
    with pytest.raises(ValueError, match=r"stop_after='linear_1_1' stops the forward before it makes one"):
        tl.trace(model, x, stop_after="linear_1_1", grads=vector)
    for activities in ("", 0, vector):
        with pytest.raises(TypeError, match="activities= is a list of torch.profiler.ProfilerActivity values"):
            tl.report.kernel_profile(model, x, activities=activities)
    assert_untouched(before, snapshot(model, (x,)))
    assert tl.trace(model, x, stop_after="linear_1_1", grads="none").stopped_after == "linear_1_1:1"
    assert tl.trace(model, x, intervene={}).output is not None
    assert tl.report.kernel_profile(model, x, activities=[])["linear_1_1:1"]["cpu_ns"] > 0


def test_an_empty_output_path_is_refused_before_the_work_it_would_receive(tmp_path, monkeypatch):
    # render("") and to_chrome_trace("") failed opening the file after the layout with a bare IsADirectoryError or
    # FileNotFoundError, and kernel_profile(chrome_trace="") so after the profile had been taken.
    monkeypatch.chdir(tmp_path)
    model, x = MLP().eval(), torch.randn(2, 16)
    log = tl.trace(model, x)
    for who, call in (("render", lambda: log.render("")), ("to_chrome_trace", lambda: log.to_chrome_trace("")),
                      ("kernel_profile", lambda: tl.report.kernel_profile(model, x, chrome_trace=""))):
        with pytest.raises(ValueError, match=rf"^{who}: \w+='' is empty; name a file in an existing folder"):
            call()
    assert list(tmp_path.iterdir()) == []


def test_a_misspelt_option_of_a_trace_method_is_answered_with_the_one_meant(tmp_path):
    # log.save(path, activation=False) was told only "save() got an unexpected keyword argument 'activation'",
    # where log.show(colour_by=...) named color_by; so log.render and log.to_chrome_trace.
    log = tl.trace(MLP(), torch.randn(2, 16))
    calls = {"log.save": (lambda: log.save(tmp_path / "t", activation=False), "activation", "activations"),
             "log.render": (lambda: log.render(tmp_path / "g.dot", colour_by="flops"), "colour_by", "color_by"),
             "log.to_chrome_trace": (lambda: log.to_chrome_trace(tmp_path / "c.json", modules=False), "modules",
                                     "module_calls")}
    for who, (call, given, meant) in calls.items():
        with pytest.raises(TypeError, match=rf"^{re.escape(who)}\(\) got an unexpected keyword argument '{given}'; "
                                            rf"it takes .*; closest: {meant}"):
            call()
    assert list(tmp_path.iterdir()) == []


def test_a_name_written_in_other_case_is_answered_with_the_name_meant():
    # log["LINEAR_1_1"] and intervene={"LAYERS.0": ...} named no closest key: the case differs in too many letters
    # for a spelling match.
    model, x = MLP(), torch.randn(2, 16)
    log = tl.trace(model, x)
    with pytest.raises(KeyError, match=r"'LINEAR_1_1' in this trace; closest: linear_1_1"):
        log["LINEAR_1_1"]
    with pytest.raises(KeyError, match=r"'LAYERS.0' .*; closest: layers.0"):
        tl.trace(model, x, intervene={"LAYERS.0": tl.zero_ablate()})


def test_a_reader_given_no_list_or_no_path_says_so_in_its_own_name():
    # tl.distributed.compare(3) failed in its loop ("'int' object is not iterable"), a generator of traces likewise
    # once consumed, and tl.viz.format_of(3) inside pathlib ("expected str, bytes or os.PathLike object").
    log = tl.trace(MLP(), torch.randn(2, 16))
    for traces in (3, iter([log, log])):
        with pytest.raises(TypeError, match=r"^compare: traces=.* is an? \w+; give one trace per rank, in rank order"):
            tl.distributed.compare(traces)
    with pytest.raises(TypeError, match=r"^format_of: path=3 is an int; name a file"):
        tl.viz.format_of(3)
    assert tl.viz.format_of("graph.SVG") == "svg" and len(tl.distributed.compare((log, log))) == 1


def test_a_module_object_given_as_a_key_is_answered_with_its_address():
    # log[model.layers[0]] said only "index a trace with a label string, an int or a slice, not Linear", where
    # save=model.layers[0] names the address to give.
    model = MLP()
    log = tl.trace(model, torch.randn(2, 16))
    answers = {model.layers[0]: r"; give its address, 'layers.0'$",
               model: r"; the traced model's own call is the whole",
               torch.nn.Linear(2, 2): r"; this module is no submodule of the traced model"}
    for key, answer in answers.items():
        with pytest.raises(TypeError, match=rf"^index a trace with a label string, an int or a slice, not \w+{answer}"):
            log[key]
    assert log["layers.0"].module_address == "layers.0"


def test_a_misspelt_option_of_a_helper_or_public_function_is_answered_with_the_one_meant(tmp_path):
    # tl.scale(2, atx=1) was told "scale.__init__() got an unexpected keyword argument 'atx'" (tl.zero_ablate's
    # named Action.__init__), and tl.load_extracted(p, astorch=True) no more than its name: none said what it took.
    model, x = MLP().eval(), torch.randn(2, 16)
    log = tl.trace(model, x)
    vector = torch.ones(16)
    calls = {"tl.scale": (lambda: tl.scale(2, atx=1), "atx", "at"),
             "tl.steer": (lambda: tl.steer(vector, scal=2.0), "scal", "scale"),
             "tl.clamp": (lambda: tl.clamp(minimum=0.0), "minimum", "min"),
             "tl.noise": (lambda: tl.noise(0.1, generater=None), "generater", "generator"),
             "tl.mean_ablate": (lambda: tl.mean_ablate(dim=0), "dim", "dims"),
             "tl.zero_ablate": (lambda: tl.zero_ablate(at_=1), "at_", "at"),
             "tl.patch_from": (lambda: tl.patch_from(source=log), "source", "trace"),
             "tl.load_extracted": (lambda: tl.load_extracted(tmp_path, astorch=True), "astorch", "as_torch"),
             "tl.load": (lambda: tl.load(paths=tmp_path), "paths", "path"),
             "tl.debug.hot_path": (lambda: tl.debug.hot_path(log, by_="flops"), "by_", "by"),
             "tl.debug.nonfinite_origin": (lambda: tl.debug.nonfinite_origin(log, grad=True), "grad", "grads"),
             "tl.distributed.compare": (lambda: tl.distributed.compare([log], rtl=0.1), "rtl", "rtol"),
             "tl.distributed.gather": (lambda: tl.distributed.gather(log, activation=True), "activation",
                                       "activations")}
    for who, (call, given, meant) in calls.items():
        with pytest.raises(TypeError, match=rf"^{re.escape(who)}\(\) got an unexpected keyword argument '{given}'; "
                                            rf"it takes .*; closest: {meant}"):
            call()
    # The options they do take still work, given by name.
    actions = [tl.scale(k=2, at=1), tl.steer(vector=vector, scale=2.0, dim=-1), tl.clamp(max=0.0), tl.zero_ablate(at=0)]
    for action in actions:
        assert not torch.equal(tl.trace(model, x, intervene={"relu_1_2:1": action}).output, log.output)
