"""The public API is discoverable: ``dir(tl)`` lists it, signatures show no private knobs, and the
reference library's commonest names work where they mean the same thing."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from zoo import MLP


@pytest.mark.path_independent  # imports only, no trace: once, on the first pass
def test_dir_lists_every_public_name_and_the_lazy_ones_without_importing_them():
    code = ("import sys, torchlens as tl; names = dir(tl); "
            "print(','.join(n for n in ('debug', 'report', 'load', 'extract', 'viz', 'io', 'load_extracted', "
            "'log_forward_pass', 'trace', 'validate') if n in names)); "
            "print(any(m in sys.modules for m in ('torchlens.io', 'torchlens.debug', 'torchlens.report')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["debug,report,load,extract,viz,io,load_extracted,log_forward_pass,trace,validate", "False"]
    assert set(tl.__all__) <= set(dir(tl))
    assert {"hot_path", "nonfinite_origin"} <= set(dir(tl.debug))
    assert {"kernel_profile", "total_flops"} <= set(dir(tl.report))


def test_trace_signature_shows_no_private_parameters():
    params = inspect.signature(tl.trace).parameters
    assert not [name for name in params if name.startswith("_")]
    assert "root" in params


def test_a_forwards_keyword_given_to_trace_or_validate_is_refused_saying_where_it_goes():
    # tl.trace(model, ids, attention_mask=mask) was Python's bare "trace() got an unexpected keyword argument".
    model, x = MLP(), torch.randn(2, 16)
    with pytest.raises(TypeError, match=r"tl\.trace\(\) got an unexpected keyword argument 'attention_mask'; if "
                                        r"'attention_mask' is a keyword argument of the forward, give it in kwargs: "
                                        r"tl\.trace\(model, args, \{'attention_mask': \.\.\.\}\)"):
        tl.trace(model, x, attention_mask=None)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'grad'; closest: grads"):
        tl.trace(model, x, grad=True)
    with pytest.raises(TypeError, match=r"give it in kwargs: tl\.validate\(model, args, \{'use_cache': \.\.\.\}\)"):
        tl.validate(model, x, use_cache=True)
    assert "unknown" not in inspect.signature(tl.trace).parameters  # help() shows the options it takes


def test_log_validate_shows_its_one_option_and_refuses_others_in_its_own_name():
    # It took **kwargs: help() showed no option, and rtol= was refused by "validate_trace()", a name never called.
    assert list(inspect.signature(tl.Trace.validate).parameters) == ["self", "progress"]
    log = tl.trace(MLP(), torch.randn(2, 16))
    with pytest.raises(TypeError, match=r"Trace\.validate\(\) got an unexpected keyword argument 'rtol'"):
        log.validate(rtol=1e-3)
    assert log.validate(progress=False).passed


def test_help_on_the_record_classes_describes_their_own_fields():
    # help(tl.Param) showed operator.attrgetter's documentation for address, shape, dtype and requires_grad
    # (and for ModuleCall.call_index, Module.address, ...): the fields read straight from a record's row.
    import pydoc

    for record_class in (tl.Trace, tl.Op, tl.Layer, tl.ModuleCall, tl.Module, tl.Param, tl.Buffer):
        text = pydoc.render_doc(record_class, renderer=pydoc.plaintext)
        assert "attrgetter" not in text, record_class.__name__
    assert "address in the model" in inspect.getdoc(tl.Param.address)
    assert "Which call of its module" in inspect.getdoc(tl.ModuleCall.call_index)


def test_reference_names_for_rosters():
    log = tl.trace(MLP(), torch.randn(2, 16))
    assert log.layer_list == log.ops
    assert log.layer_labels == [layer.layer_label for layer in log.layers]
    assert len(set(log.layer_labels)) == len(log.layer_labels) < len(log.op_labels)
    assert log.op_labels == [op.label for op in log.ops]


def test_log_forward_pass_is_trace_under_the_reference_names():
    model, x = MLP(), torch.randn(2, 16)
    log = tl.log_forward_pass(model, x, layers_to_save=["head"], vis_opt="none")
    assert log["head"].has_activation and not log["linear_1_1"].has_activation
    with pytest.raises(TypeError, match="vis_opt= is a reference-library option.*log.render"):
        tl.log_forward_pass(model, x, vis_opt="rolled")
    # Given to tl.trace, a reference option was answered by spelling: layers_to_save by "closest: stop_after".
    with pytest.raises(TypeError, match=r"'layers_to_save'; layers_to_save= is a reference-library option torchlens "
                                        r"does not take: give save= the same selection$"):
        tl.trace(model, x, layers_to_save=["head"])
    with pytest.raises(TypeError, match="random_seed= is a reference-library option.*seed torch yourself"):
        tl.trace(model, x, random_seed=0)


class _Pair(nn.Module):
    """One parameter that takes a pair."""

    def forward(self, pair):
        return pair[0] * pair[1]


def test_log_forward_pass_reads_a_list_of_inputs_as_the_reference_does():
    torch.manual_seed(0)
    a, b = torch.randn(3, 4), torch.randn(3, 5)
    bilinear = nn.Bilinear(4, 5, 2)  # forward(input1, input2): the list holds the positional arguments
    for inputs in ([a, b], (a, b)):
        log = tl.log_forward_pass(bilinear, inputs)
        assert [op.io_path for op in log if op.is_input] == ["input.input1", "input.input2"]
        assert torch.equal(log.output, bilinear(a, b))
    c = torch.randn(3, 4)
    log = tl.log_forward_pass(_Pair(), [a, c])  # forward(pair): the list is that one argument
    assert [op.io_path for op in log if op.is_input] == ["input.pair.0", "input.pair.1"]
    assert torch.equal(log.output, a * c)


def test_log_forward_pass_saves_the_gradients_of_the_saved_layers_when_asked():
    model, x = MLP(), torch.randn(2, 16)
    log = tl.log_forward_pass(model, x, layers_to_save=["head"], save_gradients=True)
    log.output.sum().backward()
    expected = torch.ones_like(log.output)  # d(sum)/d(head's output)
    assert torch.equal(log["head"].grad, expected)
    assert log["linear_1_1"].grad is None  # not among the layers saved
    everything = tl.log_forward_pass(model, x, save_gradients=True)
    everything.output.sum().backward()
    assert all(op.grad is not None for op in everything.ops if op.kind == "op")
    # save_gradients="no" is true to Python: it kept the gradients it said not to.
    with pytest.raises(TypeError, match=r"log_forward_pass: save_gradients='no' is a str, not True or False"):
        tl.log_forward_pass(model, x, save_gradients="no")


WITHOUT_PANDAS = """
import sys
import torch, torch.nn as nn
import torchlens as tl

log = tl.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(3, 4))
print(str(log).splitlines()[0], log.summary()[0]["call"])
print("pandas imported:", "pandas" in sys.modules)
sys.modules["pandas"] = None  # what an environment without pandas gives: importing it raises ImportError
for name, table in [("ops", log), ("layers", log.layers), ("module_calls", log.module_calls),
                    ("modules", log.modules), ("params", log.params), ("summary", log.summary())]:
    try:
        table.to_pandas()
    except ImportError as error:
        print(name, error)
"""


def test_pandas_is_imported_only_by_to_pandas_and_its_absence_names_the_install():
    # Tracing, printing and the summary table need no pandas; every to_pandas() without it says what to install.
    done = subprocess.run([sys.executable, "-c", WITHOUT_PANDAS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[:2] == ["Trace of Sequential Sequential", "pandas imported: False"]
    assert lines[2:] == [f"{name} to_pandas() needs pandas: pip install pandas"
                         for name in ("ops", "layers", "module_calls", "modules", "params", "summary")]


def test_every_field_of_the_op_module_and_parameter_records_says_what_it_is():
    # help(op), and op.shape? in a notebook, showed no description for most fields (label, shape, children, ...).
    # The Trace's own fields too (buffers, layers, inputs, outputs, model, is_recurrent, ...).
    for record in (tl.Trace, tl.Op, tl.Layer, tl.ModuleCall, tl.Module, tl.Param, tl.Buffer):
        undocumented = [name for name, field in vars(record).items()
                        if not name.startswith("_") and isinstance(field, property) and not field.__doc__]
        assert not undocumented, f"{record.__name__}: {undocumented}"


def test_every_intervention_helper_says_what_its_at_option_does():
    # help(tl.zero_ablate) showed the signature (at=None) and "Replace the value with zeros.", nothing on at=.
    for helper in (tl.zero_ablate, tl.scale, tl.clamp, tl.noise, tl.steer, tl.mean_ablate, tl.patch_from):
        assert "at" in inspect.signature(helper).parameters
        assert "``at=``" in helper.__doc__, helper.__name__
