"""A trace and its records as Python objects, as a notebook or a script meets them: what tab completion offers
(``dir``), and that every name it offers reads, or refuses in torchlens's own words."""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
from real_models import small_gpt2_lm
from zoo import MLP


@pytest.fixture(scope="module")
def decoded():
    """A trace of GPT-2's ``generate()``: each decoding step runs the model's layers again, on a key/value cache
    that grows, so its layers have several passes, some of one shape and some of a shape that grows."""
    model = small_gpt2_lm()
    ids = torch.randint(1, 64, (1, 4), generator=torch.Generator().manual_seed(0))
    return tl.trace(model.generate, (ids,), {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0})


def _unreadable(record) -> dict:
    """The names ``dir(record)`` offers that raise an AttributeError when read (a TorchlensError is a refusal
    that says what to do instead: an op without a gradient, a value not saved)."""
    failed = {}
    for name in dir(record):
        try:
            getattr(record, name)
        except tl.TorchlensError:
            pass
        except AttributeError as error:
            failed[name] = str(error)
    return failed


def test_a_layer_offers_the_op_fields_it_answers_and_none_that_raises(decoded):
    # dir(layer) listed the layer's own attributes alone: tab completion offered no shape, activation or func_name,
    # which a layer answers from its passes.
    single = next(layer for layer in decoded.layers if layer.num_passes == 1 and layer.first.kind == "op")
    assert {"activation", "shape", "func_name", "parents", "source"} <= set(dir(single))
    grown = next(layer for layer in decoded.layers if len({op.shape for op in layer.ops}) > 1)
    same = next(layer for layer in decoded.layers if layer.num_passes > 1 and len({op.shape for op in layer.ops}) == 1)
    for layer in (grown, same):
        offered = set(dir(layer))
        assert {"func_name", "dtype", "ops", "num_passes"} <= offered and not {"activation", "parents"} & offered
    assert "shape" in dir(same) and same.shape == same.ops[0].shape and "shape" not in dir(grown)
    for layer in decoded.layers:
        assert not _unreadable(layer), layer


def test_a_name_no_record_has_is_refused_as_the_layers(decoded):
    # A layer of one pass refused it as "'Op' object has no attribute", naming the first pass, not what was read.
    layer = next(layer for layer in decoded.layers if layer.num_passes == 1)
    for name in ("shap", "_shape"):
        with pytest.raises(AttributeError, match=f"'Layer' object has no attribute '{name}'") as refused:
            getattr(layer, name)
        assert refused.value.obj is layer and refused.value.name == name  # Python suggests the names dir() lists


def test_a_long_record_list_prints_its_first_and_last_records_and_counts_the_rest(decoded):
    # repr(log.ops) listed every op: a real model's thousands printed page after page in a notebook.
    ops, text = decoded.ops, repr(decoded.ops)
    assert text.startswith(f"[{ops[0]!r}, {ops[1]!r}") and text.endswith(f"{ops[-2]!r}, {ops[-1]!r}]")
    assert f"... {len(ops) - 12} more Op records (of {len(ops)}) ..." in text and text.count("<Op ") == 12
    assert len(decoded.params) > 12 and f"more Param records (of {len(decoded.params)})" in repr(decoded.params)
    few = tl.trace(MLP(), torch.randn(2, 16)).module_calls
    assert 1 < len(few) <= 12 and repr(few) == repr(list(few))  # a short list prints whole, as a list does


def test_a_tensor_is_refused_by_in_rather_than_answered_false(decoded):
    # `tensor in log` was False even for the trace's own output: the keys are names and records, never values.
    for tensor in (decoded.output, decoded.ops[-2].activation, torch.tensor(0)):
        with pytest.raises(TypeError, match=r"not by tensor: the tensors are the ops' values, compared with log\["):
            tensor in decoded
    assert decoded.ops[-2] in decoded and decoded.labels[-2] in decoded and 0 in decoded


def test_a_cleaned_up_trace_still_names_the_packed_weights_its_ops_read():
    # After cleanup, op.packed_params raised TraceCleanedUp on an op of the root forward (an input), and answered ()
    # on every op inside a module: the quantized Linears' ops said they had read no packed weight.
    import warnings

    from real_models import build

    model, args, kwargs = build("bert")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notices for its quantized modules
        quantized = torch.ao.quantization.quantize_dynamic(model.eval(), {torch.nn.Linear}, dtype=torch.qint8)
        log = tl.trace(quantized, args, kwargs)
    before = [op.packed_params for op in log.ops]
    log.cleanup()
    assert [op.packed_params for op in log.ops] == before and sum(map(bool, before)) >= 12


def test_an_intervention_shows_a_tensor_argument_by_its_shape(tmp_path):
    # scale(k) with a tensor k printed every element of k in log.interventions, in the saved trace and in each
    # refusal naming the helper (a page of numbers for a (6, 32) factor), where replace_with showed its shape.
    model, site = small_gpt2_lm(), "transformer.h.0.mlp"
    ids, factor = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(0)), torch.rand(6, 32)
    log = tl.trace(model, ids, intervene={site: tl.scale(factor)})
    assert repr(log.interventions[0].action) == "scale(tensor(6, 32))"
    assert repr(tl.load(log.save(tmp_path / "t")).interventions[0].action) == "scale(tensor(6, 32))"
    with pytest.raises(tl.errors.ReplacementMismatch, match=r"^scale\(tensor\(7, 32\)\) at ") as refused:
        tl.trace(model, ids, intervene={site: tl.scale(torch.rand(7, 32))})
    assert "tensor([" not in str(refused.value)
    shown = repr(tl.clamp(min=-factor, max=factor, at=(slice(None), torch.arange(12))))
    assert shown == "clamp(min=tensor(6, 32), max=tensor(6, 32), at=(slice(None, None, None), tensor(12,)))"
    assert repr(tl.noise(std=factor)) == "noise(std=tensor(6, 32))"
    assert repr(tl.scale(2.0, at=torch.tensor([1, 3]))) == "scale(2.0, at=tensor([1, 3]))"  # a few elements, as given


def test_a_module_record_read_for_an_attribute_of_its_module_says_it_is_the_record(decoded):
    # log['transformer.h.0.attn.c_attn'].weight said "'Module' object has no attribute 'weight'", as if GPT-2's
    # module had no weight: the record of a module is not the module.
    record = decoded["transformer.h.0.attn.c_attn"]
    assert isinstance(record, tl.Module) and record.num_calls == 3
    with pytest.raises(AttributeError, match=r"no attribute 'weight': this is the trace's record of the Conv1D \(its "
                                             r"calls, .*, not the module; the module is model\.get_submodule\("
                                             r"'transformer\.h\.0\.attn\.c_attn'\)$"):
        record.weight
    with pytest.raises(AttributeError, match=r"^'Module' object has no attribute 'wieght'$"):  # no module has it
        record.wieght
