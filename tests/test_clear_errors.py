"""Nothing silently ignored: every mistake a user can make with a selection, a key or a model says so."""

from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from untouched import assert_clean_process, assert_untouched, snapshot
from zoo import MLP, SharedModule


@pytest.mark.parametrize("entry, closest", [("linearr_1_1", "linear_1_1"), ("rleu", "relu"),
                                            ("layers.0:3", "layers.0:1"), ("linear_9_9", "linear_1_1")])
def test_a_save_entry_that_matches_nothing_names_the_closest(entry, closest):
    # a call number past the last names the calls there were, rather than the closest keys
    named = rf"named .{entry}. in this trace.*save= matched nothing.*(closest|in this forward): .*{closest}"
    with pytest.raises(KeyError, match=named):
        tl.trace(MLP(), torch.randn(2, 16), save=["layers.0", entry])


def test_a_module_that_never_ran_is_not_silently_empty():
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    with pytest.raises(KeyError, match="never ran"):
        tl.trace(Skips(), torch.randn(1, 4), save=["unused"])


def test_matching_save_entries_still_work():
    log = tl.trace(MLP(), torch.randn(2, 16), save=["linear_1_1", "relu", "head", "layers.1:1"])
    assert log["linear_1_1"].has_activation and log["relu_1_2:1"].has_activation
    assert log["head"].has_activation and log["layers.1:1"].has_activation


def test_an_op_attribute_on_a_module_called_several_times_points_at_its_calls():
    log = tl.trace(SharedModule(), torch.randn(2, 8))
    with pytest.raises(AttributeError, match=r"fc ran 3 times.*log\['fc:2'\]"):
        log["fc"].shape
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        log["fc"].nonsense
    assert log["fc:2"].shape == (2, 8)


def test_an_index_past_the_end_names_the_trace_length():
    log = tl.trace(MLP(), torch.randn(2, 16))
    with pytest.raises(IndexError, match=f"this trace has {len(log)} ops"):
        log[99]
    with pytest.raises(IndexError, match=f"this trace has {len(log)} ops"):
        log[-len(log) - 1]
    assert log[-1].is_output


def test_a_module_class_is_refused_with_what_to_pass():
    with pytest.raises(TypeError, match="pass a module instance"):
        tl.trace(nn.Linear, torch.randn(2, 2))
    with pytest.raises(TypeError, match="pass a module instance"):
        tl.validate(nn.Linear, torch.randn(2, 2))


def test_validate_says_a_non_callable_model_is_not_callable():
    with pytest.raises(TypeError, match="got a str, which is not callable"):
        tl.validate("model", torch.randn(2, 2))


_ENTRY_POINTS = {
    "tl.trace": lambda m, x: tl.trace(m, x),
    "tl.report.flops_vs_dispatch": lambda m, x: tl.report.flops_vs_dispatch(m, x),
    "tl.report.kernel_profile": lambda m, x: tl.report.kernel_profile(m, x),
    "tl.extract": lambda m, x: tl.extract(m, [x], ["output_1"], "never-written"),
    "tl.report.activation_patching": lambda m, x: tl.report.activation_patching(m, x, x, lambda o: o.sum()),
    "tl.report.attribution_patching": lambda m, x: tl.report.attribution_patching(m, x, x, lambda o: o.sum()),
    "log_forward_pass": lambda m, x: tl.log_forward_pass(m, x),
}


@pytest.mark.parametrize("who", list(_ENTRY_POINTS))
def test_every_entry_point_refuses_a_model_it_cannot_run_in_its_own_name(who, tmp_path, monkeypatch):
    # Each said "tl.trace needs an nn.Module or a callable", naming a function the user never called.
    monkeypatch.chdir(tmp_path)
    x = torch.randn(2, 4)
    refused = rf"^{re.escape(who)} needs the model to run .*got an int, which is not callable"
    with pytest.raises(TypeError, match=refused):
        _ENTRY_POINTS[who](5, x)
    with pytest.raises(TypeError, match=rf"^{re.escape(who)} .*got the class Linear, which is not an instance"):
        _ENTRY_POINTS[who](nn.Linear, x)
    assert not (tmp_path / "never-written").exists()


def test_warnings_name_the_users_line_not_a_line_of_torchlens(tmp_path):
    import warnings

    model, x = MLP().eval(), torch.randn(2, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tl.trace(model, x, max_saved_bytes=1)  # the budget warning, raised deep in the driver
        line = sys._getframe().f_lineno - 1
        folder = tmp_path / "t"
        tl.trace(model, x).save(folder)
        (folder / "notes.txt").write_text("kept")
        tl.trace(model, x).save(folder, overwrite=True)  # the kept-entries warning, raised in io/save.py
    budget = [w for w in caught if "max_saved_bytes" in str(w.message)]
    kept = [w for w in caught if "manifest did not list" in str(w.message)]
    assert budget and kept, [str(w.message) for w in caught]
    assert (budget[0].filename, budget[0].lineno) == (__file__, line)
    assert kept[0].filename == __file__


@pytest.mark.parametrize("call", [tl.trace, tl.validate, tl.report.flops_vs_dispatch, tl.report.kernel_profile])
def test_a_second_positional_argument_in_place_of_the_keywords_says_to_use_a_tuple(call):
    class Add(nn.Module):
        def forward(self, a, b):
            return a + b

    with pytest.raises(TypeError, match=r"got a Tensor; .* give them as one tuple: "
                                        r"tl\.(report\.)?\w+\(model, \(x, y\)\)"):
        call(Add(), torch.randn(2), torch.randn(2))



def test_a_list_meant_as_several_positional_arguments_gets_a_note_saying_so():
    class Add(nn.Module):
        def forward(self, a, b):
            return a + b

    with pytest.raises(TypeError, match="missing 1 required positional argument") as raised:
        tl.trace(Add(), [torch.randn(2), torch.randn(2)])
    assert any("give tl.trace(model, (a, b))" in note for note in raised.value.__notes__)
    assert torch.equal(tl.trace(Add(), (torch.ones(2), torch.ones(2))).output, torch.full((2,), 2.0))


def test_a_named_tuple_batch_passed_field_by_field_gets_a_note_saying_so(tmp_path):
    """A named tuple is a tuple, so its fields are the positional arguments; a forward taking the batch as one
    value fails in its own code, and the note says why and how to pass it whole (a DataLoader collates a
    dataset's named tuples into one, so tl.extract meets this as often as tl.trace)."""
    import collections

    from torch.utils.data import DataLoader

    Batch = collections.namedtuple("Batch", "x y")

    class Reads(nn.Module):
        def forward(self, batch):
            return batch.x * batch.y

    samples = [Batch(torch.randn(3), torch.randn(3)) for _ in range(4)]
    batch = next(iter(DataLoader(samples, batch_size=2)))
    assert type(batch) is Batch
    with pytest.raises(TypeError, match="takes 2 positional arguments but 3 were given") as raised:
        tl.trace(Reads(), batch)
    assert any("the Batch was passed as the positional arguments" in note and "(batch,)" in note
               for note in raised.value.__notes__)
    with pytest.raises(TypeError) as raised:
        tl.extract(Reads(), DataLoader(samples, batch_size=2), ["output_1"], tmp_path / "out", progress=False)
    assert any("args_of=lambda batch: (batch,)" in note for note in raised.value.__notes__)
    out = tl.extract(Reads(), DataLoader(samples, batch_size=2), ["output_1"], tmp_path / "whole",
                     args_of=lambda b: (b,), progress=False)
    assert torch.equal(tl.load_extracted(out, as_torch=True)["output_1"], torch.stack([s.x * s.y for s in samples]))


def test_a_dataloader_inputs_labels_batch_given_whole_gets_a_note_naming_args_of(tmp_path):
    """A DataLoader over an (inputs, labels) dataset yields a list, which is one positional argument: the
    forward fails inside torch (conv2d given a list) and the note says to pass the inputs alone."""
    from torch.utils.data import DataLoader, TensorDataset

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2)).eval()
    images = torch.randn(6, 3, 8, 8)
    model(images[:1])  # materialise the lazy layer
    loader = DataLoader(TensorDataset(images, torch.randint(0, 2, (6,))), batch_size=3)
    with pytest.raises(TypeError, match="conv2d") as raised:
        tl.extract(model, loader, ["2"], tmp_path / "out", progress=False)
    assert any("a list of 2 items" in note and "args_of=lambda batch: batch[0]" in note
               for note in raised.value.__notes__)
    out = tl.extract(model, loader, ["2"], tmp_path / "fixed", args_of=lambda batch: batch[0], progress=False)
    with torch.no_grad():
        assert torch.equal(tl.load_extracted(out, as_torch=True)["2"], model(images))


def test_validate_says_how_the_arguments_were_passed_when_its_untraced_run_fails_taking_them():
    """tl.validate reads its arguments by tl.trace's rule, and its untraced run fails first: it ended without
    the note a trace adds (a named tuple's fields passed one by one, a list passed whole)."""
    import collections

    Batch = collections.namedtuple("Batch", "x y")

    class Reads(nn.Module):
        def forward(self, batch):
            return batch.x * batch.y

    class Add(nn.Module):
        def forward(self, a, b):
            return a + b

    with pytest.raises(TypeError, match="takes 2 positional arguments but 3 were given") as raised:
        tl.validate(Reads(), Batch(torch.randn(3), torch.randn(3)))
    assert any("the Batch was passed as the positional arguments" in note and "(batch,)" in note
               for note in raised.value.__notes__)
    with pytest.raises(TypeError, match="missing 1 required positional argument") as raised:
        tl.validate(Add(), [torch.randn(2), torch.randn(2)])
    assert any("give tl.trace(model, (a, b))" in note for note in raised.value.__notes__)
    assert tl.validate(Reads(), (Batch(torch.randn(3), torch.randn(3)),)).passed


def test_a_trace_refuses_pickle_and_copy_and_points_at_save(tmp_path):
    import copy
    import pickle

    log = tl.trace(MLP(), torch.randn(2, 16))
    for attempt in (lambda: pickle.dumps(log), lambda: torch.save(log, tmp_path / "t.pt"), lambda: copy.copy(log),
                    lambda: copy.deepcopy(log), lambda: pickle.dumps(log.ops[1])):
        with pytest.raises(TypeError, match=r"log\.save\(path\) .* tl\.load\(path\)"):
            attempt()
    assert log.ops[1].activation is not None and len(tl.load(log.save(tmp_path / "kept"))) == len(log)
    # A loaded trace holds no model, and is refused without saying it does.
    with pytest.raises(TypeError, match=r"a live one holds the model.*tl\.load\(path\)"):
        pickle.dumps(tl.load(tmp_path / "kept"))


def test_saving_to_an_unusable_path_says_what_is_wrong(tmp_path):
    from torchlens.io import TraceFileError

    log = tl.trace(MLP(), torch.randn(2, 16))
    with pytest.raises(TraceFileError, match="the save path is empty"):
        log.save("")
    (tmp_path / "notes.txt").write_text("not a folder")
    with pytest.raises(TraceFileError, match=r"notes\.txt is a file, not a folder"):
        log.save(tmp_path / "notes.txt" / "run" / "t")
    with pytest.raises(TraceFileError, match=r"notes\.txt exists and is a file, not a saved trace"):
        log.save(tmp_path / "notes.txt", overwrite=True)
    log.save(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(TraceFileError, match="is a symbolic link; torchlens does not save through links"):
        log.save(tmp_path / "link", overwrite=True)


def test_a_picture_or_chrome_trace_path_that_cannot_be_written_is_refused_before_the_layout(tmp_path, monkeypatch):
    """render wrote its file only after laying the graph out (seconds on a large trace), then failed with a bare
    FileNotFoundError; to_chrome_trace likewise."""
    from torchlens.viz import graph

    log = tl.trace(SharedModule(), torch.randn(2, 8))
    (tmp_path / "notes.txt").write_text("not a folder")
    bad = {tmp_path / "missing" / "g.html": r"missing, which does not exist",
           tmp_path / "notes.txt" / "g.svg": r"notes\.txt, which is not a folder",
           tmp_path: r"is a folder"}

    def no_layout(*args, **kwargs):
        raise AssertionError("the graph was built before the path was checked")

    monkeypatch.setattr(graph, "build_structure", no_layout)
    for path, problem in bad.items():
        with pytest.raises(ValueError, match=rf"render: path=.*{problem}; name a file in an existing folder"):
            log.render(path, format="html")
        with pytest.raises(ValueError, match=rf"to_chrome_trace: path=.*{problem}; name a file in an existing"):
            log.to_chrome_trace(path)
    with pytest.raises(TypeError, match=r"render: path=3 is an int; name a file"):
        log.render(3)
    monkeypatch.undo()
    assert log.render(tmp_path / "g.dot").read_text().startswith("digraph")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.dot", "notes.txt"]


def test_a_bool_is_not_an_op_index():
    log = tl.trace(MLP(), torch.randn(2, 16))
    for flag in (True, False):
        with pytest.raises(TypeError, match="not a bool"):
            log[flag]
        # log.ops[True] gave op 1 and log.modules[False] module 0, where log[True] is refused.
        for records in (log.ops, log.modules, log.module_calls):
            with pytest.raises(TypeError, match=r"index the \w+ records with an int or a slice, not a bool"):
                records[flag]
    assert log[1].index == 1 and log.ops[1].index == 1
    # log.ops[100] said only "range object index out of range".
    with pytest.raises(IndexError, match=rf"Op index 100 is out of range: this trace has {len(log)} Op records"):
        log.ops[100]
    # log.ops[1.5] and log.layers[None] said only "range indices must be integers" or "list indices ...".
    for records in (log.ops, log.layers, log.params):
        for key in (1.5, None, (0,)):
            with pytest.raises(TypeError, match=rf"index the \w+ records with an int or a slice, not "
                                                rf"{type(key).__name__}$"):
                records[key]


class WithIdleModules(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks, self.head, self.spare = nn.ModuleList([nn.Linear(4, 4)]), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blocks[0](x))


def test_a_key_naming_a_module_that_made_no_call_says_why():
    # log["spare"] and log["blocks"] said only "no op, layer, module call or module named ...", where save= with
    # the same names says the module never ran, or is a container with no forward.
    log = tl.trace(WithIdleModules(), torch.randn(2, 4))
    for key in ("spare", "spare:1"):
        with pytest.raises(KeyError, match=r"named 'spare(:1)?' in this trace \('spare' is a module of the model that "
                                           r"never ran in this forward\)"):
            log[key]
    with pytest.raises(KeyError, match=r"\('blocks' is a ModuleList, a container with no forward of its own: it is "
                                       r"never called, so it has no output; name the modules it holds \(blocks.0\)\)"):
        log["blocks"]
    with pytest.raises(KeyError, match=r"named 'head:2' in this trace \(head made 1 call in this forward: head:1\)"):
        log["head:2"]  # head ran, once
    for option in ("save", "grads"):  # a call label of the idle module said nothing of it, where its address did
        with pytest.raises(KeyError, match=rf"'spare:1' .*{option}= matched nothing for it \(that module exists but "
                                           r"never ran in this forward\)"):
            tl.trace(WithIdleModules(), torch.randn(2, 4), **{option: ["spare:1"]})
    # log["7"] was read as call 7 of the model itself, and said "('' is a module of the model that never ran)".
    for key in ("7", ":1"):  # ":1" said the same of the model's own address
        with pytest.raises(KeyError, match=f"named '{key}' in this trace") as digits:
            log[key]
        assert "''" not in str(digits.value) and "never ran" not in str(digits.value)
    log.cleanup()
    with pytest.raises(KeyError, match="named 'spare' in this trace") as released:
        log["spare"]
    assert "never ran" not in str(released.value)  # the model is let go: nothing is claimed about it


def test_a_numpy_integer_indexes_a_trace_as_an_int_does():
    # log[np.int64(2)] was refused ("not int64") where log.ops[np.int64(2)] answered: the positions a NumPy
    # ranking or a DataFrame's index hands back are NumPy integers.
    import numpy as np

    log = tl.trace(MLP(), torch.randn(2, 16))
    for i in (np.int64(2), np.int32(-1), np.uint8(0)):
        assert log[i].label == log.ops[i].label == log[int(i)].label
    with pytest.raises(IndexError, match="op index 100 is out of range"):
        log[np.int64(100)]
    with pytest.raises(TypeError, match="not float64"):
        log[np.float64(2.0)]
    table = log.summary()  # its rows by number, as log.summary()[1] reads them
    assert table[np.int64(1)] is table[1] and table[np.int64(-1)] is table[-1]


def test_a_module_class_as_a_selection_or_site_is_refused_not_called_on_every_op():
    # A class is callable: taken as a predicate over ops, nn.ReLU(op) built a module of every op, which is
    # true, so every op was selected (every activation saved, every op ablated).
    from untouched import assert_untouched, snapshot

    model, x = MLP().eval(), torch.randn(2, 16)
    before = snapshot(model, (x,))
    for misuse in ({"intervene": {nn.ReLU: tl.zero_ablate()}}, {"save": nn.ReLU}, {"grads": nn.ReLU},
                   {"stop_after": nn.ReLU}):
        with pytest.raises(TypeError, match=r"got the class ReLU, which names no op and no module.*predicate"):
            tl.trace(model, x, **misuse)
    with pytest.raises(TypeError, match=r"its modules' addresses \('layers\.0', 'layers\.1', 'layers\.2' and 1 more\)"):
        tl.trace(model, x, save=nn.Linear)
    assert_untouched(before, snapshot(model, (x,)))
    assert torch.equal(tl.trace(model, x).output, model(x))


def test_a_module_object_as_a_selection_or_site_is_answered_with_its_address():
    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    gpt2, ids = small_gpt2_lm(), torch.randint(0, 64, (1, 6))
    block = gpt2.transformer.h[0]
    for misuse in ({"intervene": {block: tl.zero_ablate()}}, {"stop_after": block}, {"save": block},
                   {"save": [block]}, {"grads": [block]}):
        with pytest.raises(TypeError, match=r"module object \(GPT2Block\).*its address instead: 'transformer\.h\.0'"):
            tl.trace(gpt2, ids, **misuse)
    with pytest.raises(TypeError, match="no submodule of the traced model"):
        tl.trace(gpt2, ids, save=nn.Linear(2, 2))
    assert tl.trace(gpt2, ids, save=["transformer.h.0"])["transformer.h.0"].has_activation


def test_an_input_or_output_path_is_a_selection_as_it_is_a_key():
    # save=["input.attention_mask"] raised UnmatchedSelection (read as an op type), though log["input.attention_mask"]
    # finds the input.
    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    gpt2, ids = small_gpt2_lm(), torch.randint(0, 64, (2, 5))
    mask = torch.ones(2, 5)
    log = tl.trace(gpt2, ids, {"attention_mask": mask}, save=["input.attention_mask", "output.logits"])
    kept = [op for op in log if op.has_activation]
    assert [op.io_path for op in kept] == ["input.attention_mask", "output.logits"]
    assert torch.equal(log["input.attention_mask"].activation, mask)
    # A tensor passed twice is one input, which either path selects.
    twice = tl.trace(gpt2, ids, {"labels": ids}, save=["input.labels"])
    assert [op.label for op in twice if op.has_activation] == [twice["input.input_ids"].label]
    with pytest.raises(tl.UnmatchedSelection, match=r"'input.atention_mask'.*closest: input\.attention_mask"):
        tl.trace(gpt2, ids, {"attention_mask": mask}, save=["input.atention_mask"])


class _Nested(nn.Module):
    """A chain of module calls ``depth`` deep, each forward calling the next."""

    def __init__(self, depth: int):
        super().__init__()
        self.inner = _Nested(depth - 1) if depth > 1 else None

    def forward(self, x):
        return x + 1 if self.inner is None else self.inner(x) * 1.0


def _stack_depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


def _run_at_least_limit(model, x, limit: int):
    """``model(x)`` under the lowest recursion limit, from ``limit`` up in steps of 5, that it runs under (how
    much a call counts against the limit depends on the interpreter's version)."""
    while True:
        sys.setrecursionlimit(limit)
        try:
            return model(x)
        except RecursionError:
            limit += 5


def test_a_forward_that_overflows_the_stack_only_traced_is_told_why():
    """A trace runs each module call in more frames than the model does: near the recursion limit, a forward
    that runs untraced raises RecursionError traced, and the note says the trace's frames are the cause."""
    depth, x = 20, torch.randn(2)
    model = _Nested(depth)
    limit, before = sys.getrecursionlimit(), snapshot(model, [x])
    try:
        untraced = _run_at_least_limit(model, x, _stack_depth() + 2 * depth)
        sys.setrecursionlimit(sys.getrecursionlimit() + 10)  # a little room more, not capture's frames
        with pytest.raises(RecursionError) as info:
            tl.trace(model, x)
    finally:
        sys.setrecursionlimit(limit)
    assert_untouched(before, snapshot(model, [x]))  # torn down, though the stack was full
    assert torch.equal(untraced, x + 1)
    notes = " ".join(info.value.__notes__)
    assert "a trace runs every module call in more frames" in notes and "sys.setrecursionlimit" in notes
    assert torch.equal(tl.trace(model, x).output, untraced)  # with room again, the same model traces


def test_a_single_selector_is_taken_by_save_as_by_grads_and_extract():
    # grads="relu" and tl.extract(layers="fc") took one selector alone; save="relu" was refused as "not understood".
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    for selector in ("relu", "2", "linear_1_1:1"):
        alone, listed = tl.trace(model, x, save=selector), tl.trace(model, x, save=[selector])
        assert [op.label for op in alone if op.has_activation] == [op.label for op in listed if op.has_activation]
        assert any(op.has_activation for op in alone)
    assert not any(op.has_activation for op in tl.trace(model, x, save="none"))
    with pytest.raises(tl.UnmatchedSelection, match="'rleu'"):
        tl.trace(model, x, save="rleu")
    with pytest.raises(TypeError, match="save=7 is an int, which is not understood"):
        tl.trace(model, x, save=7)
    with pytest.raises(TypeError, match="grads=1.5 is a float, which is not understood"):  # a ValueError, as save's
        tl.trace(model, x, grads=1.5)


def test_an_empty_entry_is_refused_before_the_forward_and_a_capitalised_all_is_answered():
    # save="" (the root module's address) ran the forward and then said the model "never ran", and grads="" meant
    # no gradients; save="ALL" and save=["all"] were refused after the forward without naming the options.
    forwards = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    x = torch.randn(3, 4)
    for option in ("save", "grads"):
        for empty in ("", ["", "0"]):
            with pytest.raises(ValueError, match=f"{option}= entry '' names the model itself, whose output is "
                                                 f"log.output, and no op; give op labels.*{option}='none'"):
                tl.trace(model, x, **{option: empty})
    assert forwards == []
    # A mistyped one (save="al") is no label, so no closest label was named either: it was told nothing.
    for spelt in ("ALL", ["all"], "None", "al", ["0", "nnone"]):
        with pytest.raises(tl.UnmatchedSelection, match="give save='all' or save='none' itself"):
            tl.trace(model, x, save=spelt)


def test_extract_layers_spelling_all_is_told_layers_takes_no_all(tmp_path):
    # tl.extract's layers= (which has no 'all') spelt 'all' was told to "give save='all' or save='none' itself":
    # tl.extract has no save=, and layers='all' is refused too.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    for i, spelt in enumerate(("all", ["ALL"], ["0", "none"])):
        with pytest.raises(tl.UnmatchedSelection, match="layers= matched nothing") as caught:
            tl.extract(model, [torch.randn(3, 4)], spelt, tmp_path / str(i), progress=False)
        assert "save=" not in str(caught.value)
        assert "layers= takes no 'all' or 'none': list the op labels or module addresses" in str(caught.value)


@pytest.mark.parametrize("kind, records, address", [("parameter", "params", "0.weight"),
                                                     ("buffer", "buffers", "1.running_mean")])
def test_a_parameter_or_buffer_asked_for_by_address_is_answered_with_where_its_record_is(kind, records, address):
    # log.params is a list: log.params["0.weight"] was told to use log["0.weight"], which finds ops, layers and
    # modules only and raised a KeyError with no hint (and so for a buffer).  Both now say how to find the record.
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2)).eval()
    log = tl.trace(model, torch.randn(2, 3), grads=True)
    log.backward(log.output.sum())
    recipe = f"next({records[0]} for {records[0]} in log.{records} if {records[0]}.address == {address!r})"
    with pytest.raises(TypeError, match="indexed by position") as raised:
        getattr(log, records)[address]
    assert recipe in str(raised.value) and f"log[{address!r}]" not in str(raised.value)
    with pytest.raises(KeyError, match=f"{address} is a {kind}") as raised:
        log[address]
    assert recipe in str(raised.value)
    assert eval(recipe, {"log": log}).address == address
    if kind == "parameter":
        assert eval(recipe, {"log": log}).grad is model[0].weight.grad
        with pytest.raises(TypeError, match=r"log\['relu'\] finds an op"):
            log.ops["relu"]


@pytest.mark.parametrize("key", ["fc:01", "fc:١"])
def test_a_call_number_written_otherwise_than_a_trace_writes_it_is_refused_as_a_key_a_selection_and_a_site(key):
    # intervene={"fc:01": ...} was taken as the call fc:1, while log["fc:01"] and save=["fc:01"] named nothing.
    model, x = nn.Sequential(), torch.randn(2, 4)
    model.add_module("fc", nn.Linear(4, 4))
    says = rf"no op, layer, module call or module named '{key}' in this trace.*closest: fc:1"
    with pytest.raises(KeyError, match=says):
        tl.trace(model, x)[key]
    with pytest.raises(KeyError, match=says):
        tl.trace(model, x, save=[key])
    with pytest.raises(KeyError, match=rf"intervention site '{key}': {says}"):
        tl.trace(model, x, intervene={key: tl.scale(2.0)})
    with pytest.raises(KeyError, match=rf"stop_after site '{key}': {says}"):
        tl.trace(model, x, stop_after=key)
    assert tl.trace(model, x, intervene={"fc:1": tl.zero_ablate()}).output.eq(0).all()


def test_a_predicate_that_cannot_take_an_op_is_refused_before_the_forward():
    # save=lambda: True failed after the forward (intervene={lambda: True: ...} after the reference forward) with
    # Python's bare "takes 0 positional arguments but 1 was given".
    model, x = MLP(), torch.randn(2, 16)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    for option, called in (("save", "save"), ("grads", "grads")):
        with pytest.raises(TypeError, match=rf"{option}= as a predicate is called as {called}\(op\), with each op .*"
                                            r"cannot take that argument"):
            tl.trace(model, x, **{option: lambda: True})
    with pytest.raises(TypeError, match=r"a predicate intervention site is called as site\(op\).*\(op, log\) "
                                        r"cannot take that argument"):
        tl.trace(model, x, intervene={lambda op, log: True: tl.zero_ablate()})
    with pytest.raises(TypeError, match=r"a predicate stop_after site is called as site\(op\)"):
        tl.trace(model, x, stop_after=lambda: True)
    assert not forwards
    assert tl.trace(model, x, save=lambda op: op.type == "relu")["relu_1_2:1"].has_activation


def test_a_pass_or_call_number_past_the_last_says_how_many_there_were(tmp_path):
    # log["linear_1_1:4"] of a layer run three times listed the closest keys, leaving the passes to be counted.
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            for _ in range(3):
                x = self.fc(x)
            return torch.relu(x)

    model, x = Loop(), torch.randn(2, 4)
    log = tl.trace(model, x)
    with pytest.raises(KeyError, match=r"\(linear_1_1 ran 3 passes in this forward: linear_1_1:1 to linear_1_1:3\)"):
        log["linear_1_1:4"]
    with pytest.raises(KeyError, match=r"\(relu_1_2 ran 1 pass in this forward: relu_1_2:1\)"):
        log["relu_1_2:2"]
    with pytest.raises(KeyError, match=r"\(fc made 3 calls in this forward: fc:1 to fc:3\)"):
        log["fc:9"]
    with pytest.raises(KeyError, match=r"intervention site 'linear_1_1:4': .*linear_1_1 ran 3 passes"):
        tl.trace(model, x, intervene={"linear_1_1:4": tl.zero_ablate()})
    # save=, grads= and layers= listed only the closest keys, leaving the passes and calls to be counted.
    for option in ("save", "grads"):
        with pytest.raises(tl.UnmatchedSelection, match=rf"{option}= matched nothing for it \(linear_1_1 ran 3 passes"):
            tl.trace(model, x, **{option: ["linear_1_1:4"]})
        with pytest.raises(tl.UnmatchedSelection, match=r"\(fc made 3 calls in this forward: fc:1 to fc:3\)"):
            tl.trace(model, x, **{option: ["fc:4"]})
    with pytest.raises(tl.UnmatchedSelection, match=r"layers= .* \(linear_1_1 ran 3 passes in this forward"):
        tl.extract(model, [x], layers=["linear_1_1:4"], out=str(tmp_path / "feats"))
    with pytest.raises(KeyError, match=r"closest: "):  # no such layer: the closest keys, as before
        log["linear_9_9:1"]
    # Number 0 is no pass and no call: said so, where the closest keys (linear_1_1:1, linear_1_1) left it a guess.
    with pytest.raises(KeyError, match=r"\(passes are numbered from 1: linear_1_1:1 to linear_1_1:3\)"):
        log["linear_1_1:0"]
    with pytest.raises(KeyError, match=r"intervention site 'linear_1_1:0': .*passes are numbered from 1"):
        tl.trace(model, x, intervene={"linear_1_1:0": tl.zero_ablate()})
    with pytest.raises(KeyError, match=r"\(calls are numbered from 1: fc:1 to fc:3\)"):
        log["fc:0"]
    # A negative number, Python's count from the end, named nothing with only the closest keys: said so, with the last.
    with pytest.raises(KeyError, match=r"passes are numbered from 1, not from the end: .* last being linear_1_1:3"):
        log["linear_1_1:-1"]
    with pytest.raises(KeyError, match=r"calls are numbered from 1, not from the end: fc:1 to fc:3, the last being"):
        log["fc:-1"]
    with pytest.raises(KeyError, match=r"passes are numbered from 1, not from the end: relu_1_2:1 is the only pass"):
        log["relu_1_2:-1"]
