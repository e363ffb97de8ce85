"""What tl.extract and tl.load_extracted are given, refused before the first batch when it cannot work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchlens as tl
from streams import batches
from test_extract import TwoLayer


@pytest.mark.parametrize("option, value, error, message", [
    # "64MB" failed inside int(), "1000" and -5 were taken (-5 as a shard per batch), True as one byte.
    ("shard_bytes", "64MB", TypeError, r"tl\.extract: shard_bytes='64MB' is a str; give the number of bytes"),
    ("shard_bytes", "1000", TypeError, r"shard_bytes='1000' is a str"),
    ("shard_bytes", -5, ValueError, r"shard_bytes=-5 is negative"),
    ("shard_bytes", True, TypeError, r"shard_bytes=True is a bool"),
    ("barrier_timeout", "30", TypeError, r"tl\.extract: barrier_timeout='30' is a str; give the seconds"),
    ("barrier_timeout", -1, ValueError, r"barrier_timeout=-1 is below 1"),
    # torch takes the wait as a timedelta, which overflowed at the first barrier with a bare OverflowError.
    ("barrier_timeout", 1e15, ValueError, r"barrier_timeout=1000000000000000\.0 is above 1e\+09"),
    ("progress", "no", TypeError, r"tl\.extract: progress='no' is a str, not True or False"),
    ("kwargs", [1], TypeError,
     r"tl\.extract: kwargs= is a dict of the keyword arguments every forward gets, got a list"),
    # grads="no" is true to Python, and extracted gradients; root="model" was dropped, naming no model to check.
    ("grads", "no", TypeError, r"tl\.extract: grads='no' is a str, not True or False"),
    ("root", "model", TypeError, r"tl\.extract: root= is the nn\.Module the callable runs, as for tl\.trace, not str"),
    # a loss_fn without grads=True was ignored without a word.
    ("loss_fn", lambda output, batch: output.sum(), ValueError, r"tl\.extract: loss_fn= is read only with grads=True"),
    # A keyword it does not take got Python's bare "extract() got an unexpected keyword argument", naming neither
    # the option meant nor where a forward's keyword goes.
    ("progres", False, TypeError, r"tl\.extract\(\) got an unexpected keyword argument 'progres'; closest: progress"),
    ("save", "all", TypeError, r"'save'; tl\.extract saves what layers names, and nothing else"),
    ("attention_mask", None, TypeError, r"give it in kwargs, for every batch: kwargs=\{'attention_mask': \.\.\.\}"),
])
def test_a_setting_that_cannot_work_is_refused_before_the_first_batch(tmp_path, option, value, error, message):
    # (inputs=3 and layers=3 failed on "'int' object is not iterable": checked below)
    model = TwoLayer().eval()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    options = {"progress": False, option: value}
    with pytest.raises(error, match=message):
        tl.extract(model, batches(2), ["head"], tmp_path / "out", **options)
    assert not forwards and not (tmp_path / "out").exists()
    with pytest.raises(TypeError,
                       match=r"inputs is an iterable of batches \(a list, a generator, a DataLoader\), got int"):
        tl.extract(model, 3, ["head"], tmp_path / "out", progress=False)
    with pytest.raises(TypeError, match=r"layers is a list of op labels or module addresses, .* got int"):
        tl.extract(model, batches(2), 3, tmp_path / "out", progress=False)


@pytest.mark.parametrize("options, message", [
    # loss_fn of the output alone failed after the first forward with Python's bare "<lambda>() takes 1 positional
    # argument but 2 were given", naming neither loss_fn nor how it is called.
    ({"grads": True, "loss_fn": lambda output: output.sum()},
     r"tl\.extract: loss_fn is called as loss_fn\(output, batch\).*cannot take those two arguments"),
    ({"args_of": lambda: 0}, r"tl\.extract: args_of is called as args_of\(batch\).*cannot take that argument"),
    ({"kwargs_of": lambda batch, extra: {}}, r"tl\.extract: kwargs_of is called as kwargs_of\(batch\)"),
])
def test_a_function_that_cannot_take_its_arguments_is_refused_before_the_first_batch(tmp_path, options, message):
    model = TwoLayer().eval()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.raises(TypeError, match=message):
        tl.extract(model, batches(2), ["head"], tmp_path / "out", progress=False, **options)
    assert not forwards and not (tmp_path / "out").exists()


def test_extraction_folders_refuse_flags_and_paths_of_the_wrong_kind(tmp_path):
    # as_torch="no" is true to Python: it gave torch tensors.
    out = tl.extract(TwoLayer().eval(), batches(2), ["head"], tmp_path / "out", progress=False)
    with pytest.raises(TypeError, match=r"load_extracted: as_torch='no' is a str, not True or False"):
        tl.load_extracted(out, as_torch="no")
    with pytest.raises(TypeError, match=r"load_extracted: verify=0 is an int, not True or False"):
        tl.load_extracted(out, verify=0)
    with pytest.raises(TypeError, match=r"load_extracted: path=None is a NoneType; give the folder tl\.extract wrote"):
        tl.load_extracted(None)
    with pytest.raises(TypeError, match=r"tl\.extract: out=None is a NoneType; give the folder to write"):
        tl.extract(TwoLayer().eval(), batches(2), ["head"], None, progress=False)
    assert isinstance(tl.load_extracted(out)["head"], np.ndarray)


def test_extraction_inside_a_transform_or_of_gradients_under_inference_mode_is_refused_first(tmp_path):
    # Inside torch.func.vmap it failed on "Cannot access data pointer"; under inference_mode, grads=True blamed
    # loss_fn for returning a loss that does not require grad, after the first forward.
    model = TwoLayer().eval()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    loss = lambda output, batch: output.sum()  # noqa: E731
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"grads=True\) needs gradients .* inference"):
        tl.extract(model, batches(2), ["head"], tmp_path / "a", grads=True, loss_fn=loss, progress=False)
    with torch.no_grad():  # lifted for the backward: extracted as outside it
        tl.extract(model, batches(2), ["head"], tmp_path / "b", grads=True, loss_fn=loss, progress=False)
    assert sorted(tl.load_extracted(tmp_path / "b")) == ["grad:head", "head"]
    forwards.clear()
    with pytest.raises(RuntimeError, match="tl.extract was called inside a torch.func transform"):
        torch.vmap(lambda row: tl.extract(model, [row], ["head"], tmp_path / "c", progress=False) and row)(
            torch.randn(3, 8))
    assert not forwards and not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_a_quantized_layer_is_refused_by_name_saying_which_layer_to_extract_instead(tmp_path):
    # The refusal named the layer's address alone and said nothing of what to do.
    def forward(x):
        return torch.quantize_per_tensor(x, 0.1, 0, torch.quint8).dequantize()

    x = torch.randn(4, 3)
    with pytest.raises(TypeError, match=r"quantizepertensor_1_1 \(quantizepertensor_1_1:1\): torch.quint8 .*"
                                        r"extract the layer that dequantizes it"):
        tl.extract(forward, [x], ["quantizepertensor_1_1"], tmp_path / "quantized", progress=False)
    out = tl.extract(forward, [x], ["dequantize_1_2"], tmp_path / "dequantized", progress=False)
    assert torch.equal(torch.as_tensor(tl.load_extracted(out)["dequantize_1_2"][:]), forward(x))


def test_an_error_of_args_of_or_kwargs_of_names_the_batch_it_was_given(tmp_path):
    # kwargs_of=dict on tensor batches raised "dictionary update sequence element #0 has length 8; 2 is required".
    with pytest.raises(ValueError) as raised:
        tl.extract(TwoLayer().eval(), batches(2), ["head"], tmp_path / "out", kwargs_of=dict, progress=False)
    assert raised.value.__notes__[0] == ("tl.extract: kwargs_of raised on batch 0 (counting from 0), a Tensor: "
                                         "kwargs_of=dict takes batches that are dicts")
    with pytest.raises(IndexError) as raised:
        tl.extract(TwoLayer().eval(), batches(2), ["head"], tmp_path / "out", args_of=lambda b: b[9], progress=False)
    assert raised.value.__notes__[0] == "tl.extract: args_of raised on batch 0 (counting from 0), a Tensor"


class _Streamed(torch.utils.data.IterableDataset):
    """A dataset read as a stream, with no length (as a streaming dataset is)."""

    def __iter__(self):
        return iter(torch.cat(batches(3)))


@pytest.mark.parametrize("progress", [False, True])
def test_a_dataloader_over_a_stream_without_a_length_is_extracted(tmp_path, progress, capsys):
    # The progress bar's total was len(inputs), which such a DataLoader raises TypeError for: the extraction
    # failed before its first batch, with progress=False too.
    model = TwoLayer().eval()
    tl.extract(model, torch.utils.data.DataLoader(_Streamed(), batch_size=5), ["head"], tmp_path / "f",
               progress=progress)
    with torch.no_grad():
        expected = torch.cat([model(rows) for rows in torch.cat(batches(3)).split(5)])
    assert np.array_equal(tl.load_extracted(tmp_path / "f")["head"], expected.numpy())
    assert ("extracting" in capsys.readouterr().err) is progress


def test_an_unbatched_dataloader_of_rows_is_refused_naming_batch_size(tmp_path):
    """batch_size=None yields a TensorDataset's rows one by one: the error said only that no dim of the layer had
    the batch's size (or, for nn.Linear(4, 4), stored 4 scalar rows per example)."""
    from torch.utils.data import DataLoader, TensorDataset

    for dataset in (torch.randn(6, 4), TensorDataset(torch.randn(6, 4))):
        with pytest.raises(ValueError, match=r"DataLoader made with batch_size=None over a (Tensor|TensorDataset), "
                                             r"so it yields the dataset's rows one at a time.*give the DataLoader a "
                                             r"batch_size"):
            tl.extract(torch.nn.Linear(4, 4), DataLoader(dataset, batch_size=None), ["linear_1_1"],
                       tmp_path / "out", progress=False)
        assert not (tmp_path / "out").exists()


def test_an_unbatched_dataloader_that_fails_says_batch_size_none(tmp_path):
    from torch.utils.data import DataLoader

    examples = [(torch.randn(4),) for _ in range(3)]  # single examples, a list the loader passes on unbatched
    with pytest.raises(TypeError) as caught:
        tl.extract(torch.nn.Linear(4, 4), DataLoader(examples, batch_size=None), ["linear_1_1"], tmp_path / "out",
                   progress=False)
    assert any("DataLoader made with batch_size=None" in note for note in caught.value.__notes__)
    batched = tl.extract(torch.nn.Linear(4, 4), DataLoader([torch.randn(2, 4)] * 2, batch_size=None),
                         ["linear_1_1"], tmp_path / "batches", progress=False)  # items that are batches: taken
    assert tl.load_extracted(batched, as_torch=True)["linear_1_1"].shape == (4, 4)


def test_gradients_of_a_forward_that_computes_without_grad_say_so_not_that_loss_fn_is_wrong(tmp_path):
    """generate() runs under its own torch.no_grad(), so no tensor of it requires grad: grads=True blamed loss_fn,
    "returned Tensor that does not require grad; it must return a tensor computed from the model's output", though
    it did; the refusal now says what no backward can reach, and why."""
    pytest.importorskip("transformers")
    import real_models

    model = real_models.small_gpt2_lm()
    prompts = [torch.tensor([[5, 9, 13]]), torch.tensor([[7, 3, 2]])]
    generate = {"max_new_tokens": 2, "do_sample": False, "pad_token_id": 0}
    with pytest.raises(ValueError, match=r"batch 0: grads=True, but no tensor of this forward requires grad, .*"
                                         r"an evaluation function decorated with one") as refused:
        tl.extract(model.generate, prompts, ["lm_head:2"], tmp_path / "out", kwargs=generate, grads=True,
                   loss_fn=lambda output, batch: output.float().sum(), progress=False)
    assert "loss_fn returned" not in str(refused.value)
    # A forward that computes with grad, and a loss_fn that drops it (argmax), is still the loss_fn's doing.
    with pytest.raises(ValueError, match=r"batch 0: loss_fn returned Tensor that does not require grad"):
        tl.extract(model, prompts, ["lm_head"], tmp_path / "argmax", grads=True,
                   loss_fn=lambda output, batch: output.logits.argmax(-1).float().sum(), progress=False)
