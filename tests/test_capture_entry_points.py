"""Entry points without the protocol (docs/capture_honesty.md): calls torch never hands to
``__torch_function__``, so no op made their result.  Each test shows the call reaching no mode, and what the
trace says about the tensor it made instead of an op.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import torchlens as tl
from test_capture_honesty import FunctionLevelCalls, op_types


def test_from_numpy_and_set_never_reach_capture():
    def f():
        t = torch.from_numpy(np.ones(3, dtype=np.float32))
        t.set_(torch.zeros(3))
        return t + 1

    log = tl.trace(f, ())
    assert op_types(log) == ["zeros", "add"]
    with FunctionLevelCalls() as plain_mode:
        f()
    assert "from_numpy" not in plain_mode.names and "set_" not in plain_mode.names


def test_set_on_a_recorded_tensor_names_the_op_whose_memory_it_took_and_drops_its_value():
    """set_ never reaches capture, and its result is the tensor it was called on: the page said its result
    enters as a tensor of unknown origin, which holds only for a tensor capture did not record.  Its readers
    name the op whose memory it took (tests/test_capture_set.py); on memory no op made, its own producer."""
    import io

    def rebinds(x):
        t = torch.zeros(3)
        t.set_(x * 2)
        return t + 1

    with pytest.warns(UserWarning, match="zeros_1_1:1"):
        log = tl.trace(rebinds, torch.randn(5))
    assert log["add_1_3:1"].parents == ["mul_1_2:1"] and log["zeros_1_1:1"].shape == (3,)
    assert "write capture could not see" in log["zeros_1_1:1"].dropped_reason
    saved = io.BytesIO()
    torch.save(torch.arange(4.0), saved)

    def loads(x):  # torch.load rebuilds a tensor as torch.empty((0,)).set_(storage, ...)
        saved.seek(0)
        return x + torch.load(saved)

    with pytest.warns(UserWarning, match="empty_1_1:1"):
        log = tl.trace(loads, torch.randn(4))
    assert log["add_1_2:1"].parents == ["input_1:1", "empty_1_1:1"] and log["empty_1_1:1"].shape == (0,)


def test_as_subclass_never_reaches_capture():
    """Wrapping a tensor as a subclass (or unwrapping one) is no op: the result enters as a tensor of
    unknown origin, and the op reading it is named as such."""

    class Tagged(torch.Tensor):
        pass

    def f(x):
        wrapped = (x * 2).as_subclass(Tagged)
        return torch.Tensor._make_subclass(Tagged, wrapped.as_subclass(torch.Tensor)) + wrapped

    log = tl.trace(f, torch.randn(3))
    assert op_types(log) == ["mul", "add"]
    assert log["add_1_2:1"].parents == [] and log.unattributed == 2
    assert "read by add_1_2:1" in str(log)
    with FunctionLevelCalls() as plain_mode:
        f(torch.randn(3))
    assert not {"as_subclass", "_make_subclass"} & set(plain_mode.names)


def test_a_masked_tensor_made_in_the_forward_enters_as_a_tensor_of_unknown_origin():
    """``torch.masked.masked_tensor(data, mask)`` wraps its tensors as a subclass without an op: the op reading it
    has no parent there, and the trace counts it among the tensors of unknown origin, as docs/capture_honesty.md
    says of such wrappers."""
    import warnings

    from torch.masked import masked_tensor

    def f(x):
        return (masked_tensor(x * 2, x > 0) + 1).get_data() * 3

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notice that MaskedTensor is a prototype
        x = torch.randn(4)
        log = tl.trace(f, x)
        expected = f(x)
    added = next(op for op in log.ops if op.type == "add")
    assert added.parents == [] and log.unattributed >= 1 and "read by " + added.label in str(log)
    assert torch.equal(log.output, expected)


class LegacyConstructor(nn.Module):
    """Builds a tensor with a legacy type constructor inside the forward, as VITS's WaveNet makes its channel
    count (``torch.IntTensor([self.hidden_size])``, then reads element 0)."""

    def forward(self, x):
        channels = torch.IntTensor([2])
        return x[:, :channels[0]] * 2


def test_a_legacy_constructor_never_reaches_capture_and_is_named_where_its_tensor_is_read():
    # The printed trace named only "before the forward, on another thread, or inside a TorchScript or
    # torch.compile'd function": none of them, for a tensor the forward itself made.
    model, x = LegacyConstructor(), torch.randn(3, 4)
    log = tl.trace(model, x)
    assert torch.equal(log.output, model(x))
    assert op_types(log) == ["getitem", "getitem", "mul"]
    assert log.unattributed == 1 and log["getitem_1_1:1"].unattributed_args == 1
    assert "a legacy constructor such as torch.IntTensor([n])" in str(log)
    with FunctionLevelCalls() as plain_mode:
        model(x)
    assert plain_mode.names[0] == "__getitem__"  # the constructor itself reached no mode


def test_vits_wavenet_channel_count_is_read_from_a_legacy_constructor():
    transformers = pytest.importorskip("transformers")
    config = transformers.VitsConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32, vocab_size=99, flow_size=8,
        spectrogram_bins=17, upsample_initial_channel=16, upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4],
        resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]], prior_encoder_num_flows=1,
        prior_encoder_num_wavenet_layers=1, posterior_encoder_num_wavenet_layers=1, duration_predictor_num_flows=1,
        duration_predictor_filter_channels=16, depth_separable_num_layers=1, window_size=2)
    torch.manual_seed(0)
    model = transformers.VitsModel(config).eval()
    ids = torch.randint(0, 99, (1, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(1)
    expected = model(input_ids=ids).waveform
    torch.manual_seed(1)
    log = tl.trace(model, (), {"input_ids": ids})
    assert torch.equal(log.output["waveform"], expected)
    readers = [op for op in log.ops if op.kind == "op" and op.unattributed_args]
    assert [(op.func_name, op.module_address) for op in readers] == [("__getitem__", "flow.flows.0.wavenet")]
    assert "a legacy constructor such as torch.IntTensor([n])" in str(log)
