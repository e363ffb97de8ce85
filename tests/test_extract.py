"""Streaming extraction: exact activations, bounded shards, and what it refuses (resuming is
tests/test_extract_resume.py)."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import torchlens as tl
from torchlens.io import ResumeMismatchError, TraceFileError
from peak_memory import peak_growth_mib
from streams import batches, interrupted


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.act(self.fc(x)) + self.act(x))


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


def test_dataloader_batches_with_labels_and_a_partial_last_batch(tmp_path):
    model = TwoLayer().eval()
    x = torch.randn(10, 8)
    loader = DataLoader(TensorDataset(x, torch.arange(10)), batch_size=4)
    tl.extract(model, loader, ["head", "fc"], tmp_path / "x", args_of=lambda batch: batch[0], progress=False)
    got = tl.load_extracted(tmp_path / "x", as_torch=True)
    assert list(got) == ["head", "fc"]
    with torch.no_grad():  # batch by batch: a matmul over 10 rows may round differently than over 4
        assert torch.equal(got["head"], torch.cat([model(x[i:i + 4]) for i in range(0, 10, 4)]))
        assert torch.equal(got["fc"], torch.cat([model.fc(x[i:i + 4]) for i in range(0, 10, 4)]))
    assert isinstance(tl.load_extracted(tmp_path / "x")["fc"], np.memmap)
    # A tensor is a view of its file's memory map, not a copy: the data section is aligned to its element size.
    assert got["fc"].untyped_storage().nbytes() == os.path.getsize(tmp_path / "x" / "layer_001.safetensors")


def test_layer_names_must_pick_one_op_per_batch(tmp_path):
    model, data = TwoLayer().eval(), batches(2)
    with pytest.raises(ValueError, match="module act is called 2 times per forward; name one call: act:1, act:2"):
        tl.extract(model, data, ["act"], tmp_path / "a", progress=False)
    with pytest.raises(KeyError, match="batch 0: no op, layer, module call or module named 'hed'.*: layers= matched"):
        tl.extract(model, data, ["hed"], tmp_path / "b", progress=False)
    with pytest.raises(KeyError, match="named ':1'"):  # was "layers= entry '' names the model itself"
        tl.extract(model, data, [":1"], tmp_path / "b", progress=False)
    tl.extract(model, data, ["head"], tmp_path / "b", progress=False)  # a failed first batch left nothing behind
    assert tl.load_extracted(tmp_path / "b")["head"].shape == (8, 2)
    with pytest.raises(ValueError, match=r"module call lstm returns 3 tensors \(lstm_1_3:1, lstm_2_4:1"):
        tl.extract(LSTMNet(), [torch.randn(2, 3, 4)], ["lstm"], tmp_path / "d", progress=False)
    with pytest.raises(ValueError, match=r"batch 0: transpose_1_1 \(transpose_1_1:1\) has shape \(5, 2\), whose batch "
                                         r"dim 0 has 5 entries, but the batch has 2 rows"):
        tl.extract(lambda x: x.transpose(0, 1), [torch.randn(2, 5)], ["transpose_1_1"], tmp_path / "e", progress=False)
    tl.extract(model, data, ["act:2"], tmp_path / "c", progress=False)
    with torch.no_grad():
        np.testing.assert_array_equal(tl.load_extracted(tmp_path / "c")["act:2"],
                                      torch.cat([torch.relu(x) for x in data]).numpy())


def test_a_module_registered_under_two_names_is_extracted_by_either(tmp_path):
    class Aliased(nn.Module):  # one Linear at two addresses, as a model sharing a block registers it
        def __init__(self):
            super().__init__()
            self.encoder = nn.Linear(8, 8)
            self.shared = self.encoder
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(torch.relu(self.shared(x)))

    model, data = Aliased().eval(), batches(3)
    assert tl.trace(model, data[0])["shared"].label == tl.trace(model, data[0])["encoder"].label
    for name in ("shared", "encoder"):
        tl.extract(model, data, [name], tmp_path / name, progress=False)
        with torch.no_grad():
            assert torch.equal(tl.load_extracted(tmp_path / name, as_torch=True)[name],
                               torch.cat([model.encoder(x) for x in data]))



SHARD_MEMORY = textwrap.dedent('''
    import resource, sys
    import torch, torch.nn as nn
    import torchlens as tl

    class Double(nn.Module):
        def forward(self, x):
            return x * 2

    def batches():  # made on demand: only the extraction holds rows
        for _ in range(8):
            yield torch.ones(250, 12500)  # 12.5 MB in, 12.5 MB out

    tl.extract(Double(), [torch.ones(2, 12500)], ["mul_1_1"], sys.argv[1] + "/warm", progress=False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tl.extract(Double(), batches(), ["mul_1_1"], sys.argv[1] + "/big", shard_bytes=100 << 20, progress=False)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)  # MiB (Linux counts KiB)
''')


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
def test_a_shard_is_written_without_a_second_copy_in_memory(tmp_path):
    # The docs bound memory by one shard plus one batch: the 100 MiB of buffered rows are written as they
    # are, never first joined into a second 100 MiB tensor.
    growth = peak_growth_mib(SHARD_MEMORY, tmp_path)
    assert growth < 150, f"peak memory grew {growth:.0f} MiB for a 100 MiB shard of 12.5 MiB batches"
    rows = tl.load_extracted(tmp_path / "big")["mul_1_1"]
    assert rows.shape == (2000, 12500) and bool((rows == 2).all())


def test_a_layer_after_the_stop_site_is_refused_naming_the_stop(tmp_path):
    with pytest.raises(KeyError, match=r"named 'head'.*the forward stopped after fc:1, as stop_after= asked"):
        tl.extract(TwoLayer().eval(), batches(2), ["head"], tmp_path / "a", stop_after="fc", progress=False)


def test_a_nested_tensor_layer_is_refused_with_its_ragged_shape(tmp_path):
    """Eval ``nn.TransformerEncoder`` with a padding mask runs its layers on nested tensors, which have no
    single shape: refused by name, as other layouts safetensors cannot hold are, not with torch's error."""
    from real_models import build

    model, args, kwargs = build("transformer_encoder_padded")
    with pytest.raises(TypeError, match=r"layers\.0 \(\w+:1\) is a nested tensor of shape 2x\?x\d+"):
        tl.extract(model.eval(), [args, args], ["layers.0"], tmp_path / "x", kwargs=kwargs, progress=False)



def test_inputs_of_another_length_are_refused_saying_to_pad_them(tmp_path):
    """Probe features over short prompts of varying length: a block's rows have another shape in each batch, which
    one array cannot hold; the refusal says what to do (pad, a pooled layer, one run per length)."""
    pytest.importorskip("transformers")
    from real_models import build

    model, _, kwargs = build("bert")
    ids = kwargs["input_ids"]
    with pytest.raises(ValueError, match=r"batch 1: bert.encoder.layer.0 .* rows of \[6, 32\], but earlier batches "
                                         r"gave .* rows of \[8, 32\].*pad every input to one length"):
        tl.extract(model.eval(), [ids, ids[:, :6]], ["bert.encoder.layer.0"], tmp_path / "x", progress=False)


def test_tensors_without_values_are_refused_by_name(tmp_path):
    """A meta or fake input, or a layer whose activation is a meta tensor, has no values to store: refused
    saying so, not with torch's "Cannot copy out of meta tensor" or ".numpy() is not supported"."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake_model, fake_x = nn.Linear(4, 2), torch.randn(3, 4)
    for model, x, kind in ((nn.Linear(4, 2).to("meta"), torch.randn(3, 4, device="meta"), "meta"),
                           (fake_model, fake_x, "fake")):
        with pytest.raises(TypeError, match=f"input args.0 is a {kind}.*no values"):
            tl.extract(model, [x], ["linear_1_1"], tmp_path / kind, progress=False)
    with pytest.raises(TypeError, match=r"to_1_2 \(to_1_2:1\) is a meta tensor.*no values"):
        tl.extract(lambda x: (x * 2).to("meta"), [torch.randn(3, 4)], ["to_1_2"], tmp_path / "out", progress=False)


def test_an_extraction_under_fake_tensor_mode_is_refused_naming_the_mode(tmp_path):
    """A model with real weights extracted under FakeTensorMode(allow_non_fake_inputs=True) failed inside torch
    (".numpy() is not supported for tensor subclasses") as its weights were read for the resume check."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = nn.Linear(4, 2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(TypeError, match="tl.extract stores activations' values, and it is called under "
                                            "FakeTensorMode.*call tl.extract outside the FakeTensorMode block"):
            tl.extract(model, [torch.randn(3, 4)], ["linear_1_1"], tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


def test_dtypes_numpy_lacks_load_as_torch(tmp_path):
    model = nn.Linear(8, 4).to(torch.bfloat16)
    data = [x.to(torch.bfloat16) for x in batches(3)]
    tl.extract(model, data, ["linear_1_1"], tmp_path / "x", progress=False)
    with pytest.raises(TypeError, match="as_torch=True"):
        tl.load_extracted(tmp_path / "x")
    with torch.no_grad():
        assert torch.equal(tl.load_extracted(tmp_path / "x", as_torch=True)["linear_1_1"],
                           torch.cat([model(x) for x in data]))


def test_channels_last_and_permuted_activations_are_written_in_row_order(tmp_path):
    # A channels-last conv output, and a permute (ConvNeXt's NHWC layer norm path): concatenating a shard's
    # batches keeps their memory format, which the file cannot hold as it is.
    class NHWC(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)

        def forward(self, x):
            return self.conv(x).relu().permute(0, 2, 3, 1)

    model = NHWC()
    data = [torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last) for _ in range(3)]
    tl.extract(model, data, ["conv", "permute_1_3"], tmp_path / "x", progress=False)
    got = tl.load_extracted(tmp_path / "x", as_torch=True)
    with torch.no_grad():
        assert torch.equal(got["conv"], torch.cat([model.conv(x) for x in data]))
        assert torch.equal(got["permute_1_3"], torch.cat([model(x) for x in data]))



def test_conjugate_and_negative_views_are_written_as_their_values(tmp_path):
    # x.conj() and torch._neg_view return views whose bytes are not their values: a shard holds the values.
    data = [torch.randn(2, 3, dtype=torch.complex64) for _ in range(3)]
    tl.extract(lambda z: torch._neg_view(z.conj().imag), data, ["conj_1_1", "negview_1_3"], tmp_path / "x",
               progress=False)
    got = tl.load_extracted(tmp_path / "x", as_torch=True)
    assert torch.equal(got["conj_1_1"], torch.cat([torch.complex(z.real, -z.imag) for z in data]))
    assert torch.equal(got["negview_1_3"], torch.cat([z.imag for z in data]))



def test_conjugate_view_inputs_are_extracted_and_resumed(tmp_path):
    # A batch that is a conjugate view is hashed by its values (for the resume check), as any other batch.
    data = [torch.randn(2, 3, dtype=torch.complex64).conj() for _ in range(4)]
    with pytest.raises(KeyboardInterrupt):
        tl.extract(lambda z: z * 2, interrupted(data, 3), ["mul_1_1"], tmp_path / "x", shard_bytes=1,
                   progress=False)
    tl.extract(lambda z: z * 2, data, ["mul_1_1"], tmp_path / "x", shard_bytes=1, progress=False)
    assert torch.equal(tl.load_extracted(tmp_path / "x", as_torch=True)["mul_1_1"], torch.cat(data) * 2)
    changed = [z.resolve_conj() for z in data]
    changed[2] = changed[2].conj()  # the batch at the resume boundary now holds other values
    with pytest.raises(KeyboardInterrupt):
        tl.extract(lambda z: z * 2, interrupted(data, 3), ["mul_1_1"], tmp_path / "y", shard_bytes=1,
                   progress=False)
    with pytest.raises(ResumeMismatchError, match="input batch 2 differs"):
        tl.extract(lambda z: z * 2, changed, ["mul_1_1"], tmp_path / "y", shard_bytes=1, progress=False)


def test_a_damaged_layer_file_is_refused(tmp_path):
    tl.extract(TwoLayer().eval(), batches(3), ["fc"], tmp_path / "x", progress=False)
    path = tmp_path / "x" / "layer_000.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(TraceFileError, match="content hash does not match"):
        tl.load_extracted(tmp_path / "x")
    assert tl.load_extracted(tmp_path / "x", verify=False)["fc"].shape == (12, 8)  # sizes still checked


def test_a_layer_file_edited_or_grown_is_refused_unverified(tmp_path):
    # An edit of the same length keeps the file's size: unverified, only the header's own check finds it.
    tl.extract(TwoLayer().eval(), batches(3), ["fc"], tmp_path / "x", progress=False)
    path = tmp_path / "x" / "layer_000.safetensors"
    data = path.read_bytes()
    assert data.count(b'"shape":[12,8]') == 1
    path.write_bytes(data.replace(b'"shape":[12,8]', b'"shape":[11,8]'))
    for as_torch in (True, False):
        with pytest.raises(TraceFileError, match=r"claims bytes \[0, 384\) for shape \[11, 8\]"):
            tl.load_extracted(tmp_path / "x", verify=False, as_torch=as_torch)
    # Two negative dimensions whose product is the byte count: refused by the header check, not by torch.
    header = json.dumps({"activations": {"dtype": "F32", "shape": [-12, -8], "data_offsets": [0, 384]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + data[-384:])
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    manifest["files"]["layer_000.safetensors"]["bytes"] = path.stat().st_size
    (tmp_path / "x" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceFileError, match=r"claims bytes \[0, 384\) for shape \[-12, -8\]"):
        tl.load_extracted(tmp_path / "x", verify=False)
    manifest["files"]["layer_000.safetensors"]["bytes"] = len(data)
    # A manifest naming another shape than the file holds (a folder put together from two extractions).
    path.write_bytes(data)
    manifest["layers"][0]["shape"] = [11, 8]
    (tmp_path / "x" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceFileError, match=r"holds shape \[12, 8\], the manifest says \[11, 8\]"):
        tl.load_extracted(tmp_path / "x", verify=False)
    # A dtype of the same size edited into the header (or a manifest naming another): the values would read as
    # integers, with no error, where the manifest still says F32.
    manifest["layers"][0]["shape"] = [12, 8]
    (tmp_path / "x" / "manifest.json").write_text(json.dumps(manifest))
    path.write_bytes(data.replace(b'"dtype":"F32"', b'"dtype":"I32"'))
    for as_torch in (True, False):
        with pytest.raises(TraceFileError, match="holds dtype I32, the manifest says F32"):
            tl.load_extracted(tmp_path / "x", verify=False, as_torch=as_torch)
    # Bytes added after the data change no header: the file's size against the manifest's finds them.
    path.write_bytes(data + b"\0" * 8)
    with pytest.raises(TraceFileError, match=r"layer_000.safetensors: \d+ bytes, the manifest says \d+"):
        tl.load_extracted(tmp_path / "x", verify=False)


@pytest.mark.parametrize("file", [["layer_000.safetensors"], {"name": 1}, 7, "elsewhere.safetensors"])
def test_a_layer_entry_naming_no_listed_file_is_refused(tmp_path, file):
    tl.extract(TwoLayer().eval(), batches(1), ["fc"], tmp_path / "x", progress=False)
    manifest_path = tmp_path / "x" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["layers"][0]["file"] = file
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(TraceFileError, match="layer entry .* names no listed file"):
        tl.load_extracted(tmp_path / "x")


def test_foreign_folders_and_empty_inputs_are_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(TraceFileError, match="not empty and holds no extraction"):
        tl.extract(TwoLayer(), batches(1), ["fc"], tmp_path / "mine", progress=False)
    with pytest.raises(ValueError, match="no batches"):
        tl.extract(TwoLayer(), [], ["fc"], tmp_path / "none", progress=False)


def test_a_file_in_the_way_of_the_folder_and_an_empty_path_are_refused_by_name(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for out in ("notes.txt", "notes.txt/features"):
        with pytest.raises(TraceFileError, match=f"cannot extract to .*{out}: .*notes.txt is a file, not a folder; "
                                                 "choose another path"):
            tl.extract(TwoLayer(), batches(1), ["fc"], tmp_path / out, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(TraceFileError, match="out is an empty path; give the folder"):
        tl.extract(TwoLayer(), batches(1), ["fc"], "", progress=False)


def test_a_trace_and_an_extraction_given_to_each_others_reader_name_the_right_one(tmp_path):
    tl.extract(TwoLayer().eval(), batches(2), ["fc"], tmp_path / "x", progress=False)
    tl.trace(TwoLayer().eval(), batches(1)[0]).save(tmp_path / "t")
    with pytest.raises(TraceFileError, match="expected 'torchlens-trace': a torchlens-extraction folder is read with "
                                             "tl.load_extracted"):
        tl.load(tmp_path / "x")
    with pytest.raises(TraceFileError, match=r"expected 'torchlens-extraction': a torchlens-trace folder is read with "
                                             r"tl.load \(or torchlens show\)"):
        tl.load_extracted(tmp_path / "t")


def _token_batches(n=5, rows=2, seq=8, vocab=99, seed=4):
    """Dict batches as a tokenized ``transformers`` dataset yields them, the model called as ``model(**batch)``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mask = torch.ones(rows, seq, dtype=torch.int64)
        mask[0, -2:] = 0
        out.append({"input_ids": torch.randint(0, vocab, (rows, seq), generator=g), "attention_mask": mask})
    return out


def test_dict_batches_are_keyword_arguments_with_kwargs_of(tmp_path):
    pytest.importorskip("transformers")
    import real_models

    model, _, _ = real_models.bert()
    model.eval()
    data = _token_batches()
    layers = ["bert.encoder.layer.0", "classifier"]
    with pytest.raises(KeyboardInterrupt):  # one shard committed, then a resume reads the boundary batch's keywords
        tl.extract(model, interrupted(data, 3), layers, tmp_path / "x", kwargs_of=dict, shard_bytes=1, progress=False)
    tl.extract(model, data, layers, tmp_path / "x", kwargs_of=dict, shard_bytes=1, progress=False)
    got = tl.load_extracted(tmp_path / "x", as_torch=True)
    with torch.no_grad():
        expected = [tl.trace(model, (), batch, save=layers) for batch in data]
        assert torch.equal(got["classifier"], torch.cat([log["classifier"].activation for log in expected]))
        assert torch.equal(got["bert.encoder.layer.0"],
                           torch.cat([log["bert.encoder.layer.0"].activation for log in expected]))
    # The resume compares the keyword tensors too: other token ids at the boundary are refused.
    other = _token_batches(seed=5)
    with pytest.raises(KeyboardInterrupt):
        tl.extract(model, interrupted(data, 3), layers, tmp_path / "y", kwargs_of=dict, shard_bytes=1, progress=False)
    with pytest.raises(ValueError, match="differs from the one the interrupted run committed"):
        tl.extract(model, other, layers, tmp_path / "y", kwargs_of=dict, shard_bytes=1, progress=False)


def test_kwargs_of_must_give_a_mapping_that_kwargs_does_not_repeat(tmp_path):
    model, data = TwoLayer().eval(), batches(2)
    with pytest.raises(TypeError, match=r"batch 0: kwargs_of returned Tensor; it returns a dict"):
        tl.extract(model, data, ["fc"], tmp_path / "a", kwargs_of=lambda b: b, progress=False)
    with pytest.raises(ValueError, match="batch 0: kwargs_of and kwargs both give x"):
        tl.extract(model, data, ["fc"], tmp_path / "b", kwargs_of=lambda b: {"x": b}, kwargs={"x": data[0]},
                   progress=False)
    tl.extract(model, data, ["fc"], tmp_path / "c", kwargs_of=lambda b: {"x": b}, progress=False)
    with torch.no_grad():
        expected = torch.cat([model.fc(x) for x in data])
    assert torch.equal(tl.load_extracted(tmp_path / "c", as_torch=True)["fc"], expected)


def test_one_tensor_or_one_dict_as_inputs_is_refused_not_iterated(tmp_path):
    """A tensor of images passed as ``inputs`` was iterated image by image: a convolution runs an unbatched image,
    and the 10 feature maps of shape (3, 8, 8) were stacked as 30 rows of (8, 8), with no error."""
    torch.manual_seed(0)
    model, images = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.ReLU()).eval(), torch.randn(10, 3, 8, 8)
    with pytest.raises(TypeError, match=r"one tensor of shape \(10, 3, 8, 8\).*pass \[x\] for one batch"):
        tl.extract(model, images, ["1"], tmp_path / "x", progress=False)
    with pytest.raises(TypeError, match=r"given a dict, whose iteration gives its keys: pass \[batch\]"):
        tl.extract(model, {"x": images}, ["1"], tmp_path / "y", kwargs_of=dict, progress=False)
    assert not (tmp_path / "x").exists()
    tl.extract(model, images.split(4), ["1"], tmp_path / "z", progress=False)
    with torch.no_grad():
        assert torch.equal(torch.from_numpy(tl.load_extracted(tmp_path / "z")["1"][:]), model(images))


def test_a_layers_entry_that_is_no_name_is_refused_naming_it(tmp_path):
    # A predicate or an empty name among the layers was refused as "layers must be a non-empty list", of a list
    # that was not empty, naming neither the entry nor why.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    with pytest.raises(TypeError, match=r"^layers lists a function \(<function .*\); each entry names one op per "
                                        r"batch by its label or module address"):
        tl.extract(model, [torch.randn(2, 4)], ["0", lambda op: True], tmp_path / "x", progress=False)
    with pytest.raises(ValueError, match=r"^layers lists an empty name; each entry names one op per batch"):
        tl.extract(model, [torch.randn(2, 4)], ["0", ""], tmp_path / "x", progress=False)
    with pytest.raises(ValueError, match=r"^layers must be a non-empty list"):
        tl.extract(model, [torch.randn(2, 4)], [], tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


def test_an_input_of_one_row_broadcast_over_the_batch_does_not_set_the_batch_size(tmp_path):
    # position_ids of shape (1, S) listed before input_ids of shape (B, S) gave "ln_f has 3 rows along dim 0, but
    # the batch has 1": the batch size was dim 0 of the first input tensor, whatever it was.
    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    gpt2 = small_gpt2_lm()
    ids = [torch.randint(0, 64, (3, 5)), torch.randint(0, 64, (2, 5))]
    data = [{"position_ids": torch.arange(5)[None], "input_ids": batch} for batch in ids]
    tl.extract(gpt2, data, ["transformer.ln_f"], tmp_path / "gpt2", kwargs_of=dict, progress=False)
    got = tl.load_extracted(tmp_path / "gpt2", as_torch=True)["transformer.ln_f"]
    with torch.no_grad():
        expected = torch.cat([gpt2.transformer(**batch).last_hidden_state for batch in data])
    assert torch.equal(got, expected)
    # A layer that is not batch-first is still refused, naming the input the batch size was read from.
    with pytest.raises(ValueError, match=r"whose batch dim 0 has 5 entries, but the batch has 3 rows \(dim 0 of the "
                                         r"input kwargs\.input_ids, the first input whose dim 0 is not 1\)"):
        tl.extract(lambda position_ids, input_ids: input_ids.t() + position_ids.t(), data, ["t_2_2"],
                   tmp_path / "t", kwargs_of=dict, progress=False)


def test_an_input_path_is_a_layer_to_extract(tmp_path):
    # layers=["input.attention_mask"] raised UnmatchedSelection, though log["input.attention_mask"] finds it.
    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    data = [{"input_ids": torch.randint(0, 64, (2, 5)), "attention_mask": torch.randint(0, 2, (2, 5))}
            for _ in range(2)]
    tl.extract(small_gpt2_lm(), data, ["input.attention_mask", "transformer.ln_f"], tmp_path / "io", kwargs_of=dict,
               progress=False)
    got = tl.load_extracted(tmp_path / "io", as_torch=True)
    assert torch.equal(got["input.attention_mask"], torch.cat([batch["attention_mask"] for batch in data]))
    assert got["transformer.ln_f"].shape == (4, 5, 32)


def test_an_op_type_as_a_layer_and_a_batch_reader_that_is_no_function_say_what_to_give(tmp_path):
    # layers=["layernorm"] gave a KeyError that did not say layers= takes no op types; args_of=torch.ones(1)
    # failed on the first batch with "'Tensor' object is not callable".
    pytest.importorskip("transformers")
    from real_models import small_gpt2_lm

    gpt2, data = small_gpt2_lm(), [torch.randint(0, 64, (2, 5))]
    with pytest.raises(KeyError, match=r"layers= takes no op types: 'layernorm' is the type of 5 op\(s\) "
                                       r"\(layernorm_1_\d+:1, .* and 2 more\)"):
        tl.extract(gpt2, data, ["layernorm"], tmp_path / "a", progress=False)
    for option in ("args_of", "kwargs_of"):
        with pytest.raises(TypeError, match=rf"{option}= takes a function of a batch .* got Tensor"):
            tl.extract(gpt2, data, ["transformer.ln_f"], tmp_path / "b", progress=False, **{option: torch.ones(1)})
    assert not (tmp_path / "b").exists()
    tl.extract(gpt2, data, ["transformer.ln_f"], tmp_path / "b", progress=False, args_of=lambda batch: batch)
    assert tl.load_extracted(tmp_path / "b")["transformer.ln_f"].shape == (2, 5, 32)


def test_many_layers_are_resolved_without_scanning_the_module_calls_per_layer(tmp_path, monkeypatch):
    # Each layer name was looked for among the module calls by scanning them all, per batch: extracting n
    # layers of an n-module model was n * n reads a batch (2,000 layers of a 2,000-block model: 159 s, 21x
    # the 500-layer one).  The calls are now named once per batch.
    from zoo import MLP
    from torchlens.record.modules import ModuleCall

    model, data = MLP(width=8, depth=40).eval(), [torch.randn(3, 8) for _ in range(2)]
    log = tl.trace(model, data[0], save="none")
    layers = [op.label for op in log.ops if op.type in ("linear", "relu")] + ["layers.7", "head:1"]
    reads = []
    real_label = ModuleCall.label

    monkeypatch.setattr(ModuleCall, "label", property(lambda call: reads.append(1) or real_label.fget(call)))
    tl.extract(model, data, layers, tmp_path / "x", progress=False)
    assert len(reads) <= 4 * len(data) * len(log.module_calls)
    got = tl.load_extracted(tmp_path / "x", as_torch=True)
    with torch.no_grad():
        assert torch.equal(got["layers.7"], torch.cat([log_output(model, x, "layers.7") for x in data]))
        assert torch.equal(got["head:1"], torch.cat([model(x) for x in data]))


def log_output(model, x, name):
    return tl.trace(model, x)[name].activation


class CachedAttention(nn.Module):
    """The key/value cache of Meta's reference LLaMA attention: preallocated tensors, plain attributes, that
    each forward fills in place (``self.cache_k[:bsz, start_pos:start_pos + seqlen] = xk``) and reads back."""

    def __init__(self, dim=8, max_batch=2, max_seq=3):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.cache_k = torch.zeros(max_batch, max_seq, dim)
        self.cache_v = torch.zeros(max_batch, max_seq, dim)

    def forward(self, x, start_pos=0):
        bsz, seqlen, dim = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        self.cache_k[:bsz, start_pos:start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos:start_pos + seqlen] = xv
        keys, values = self.cache_k[:bsz, :start_pos + seqlen], self.cache_v[:bsz, :start_pos + seqlen]
        scores = torch.softmax(xq @ keys.transpose(1, 2) / dim ** 0.5, dim=-1)
        return scores @ values


def test_an_activation_held_by_the_model_keeps_its_own_batchs_rows(tmp_path):
    # The cache write's output is the cache itself, which the next batch's forward writes again before the
    # shard holding the first batch's rows is written: those rows must be the first batch's keys.
    torch.manual_seed(0)
    model, batches = CachedAttention(), [torch.randn(2, 3, 8), torch.randn(2, 3, 8)]
    write = next(op.label for op in tl.trace(model, batches[0]).ops if op.func_name == "__setitem__")
    expected = [tl.trace(model, b)[write].activation.clone() for b in batches]
    folder = tl.extract(model, batches, layers=[write], out=tmp_path / "feats", progress=False)
    assert torch.equal(tl.load_extracted(folder, as_torch=True)[write], torch.cat(expected))


def test_a_torchscript_layer_is_refused_naming_the_layers_option(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Tanh())))
    for layer, where in (("1", "is a TorchScript module"), ("1.0", "is inside '1', a TorchScript module")):
        with pytest.raises(ValueError) as raised:
            tl.extract(model, [torch.randn(2, 4)], layers=[layer], out=str(tmp_path / layer), progress=False)
        message = str(raised.value)
        assert message.startswith(f"layers= entry {layer!r} {where}") and "nothing would be kept" in message
