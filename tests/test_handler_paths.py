"""The capture handler's hot path and its cold paths: same records, exact copy-on-write, buffers by reference."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.bn(self.fc(x))
        parts = torch.split(h, 2, dim=1)  # several outputs
        y = torch.cat([parts[1], parts[0]], dim=1)  # a container argument
        z = y.clone()
        z.mul_(2.0)  # a predicted in-place write
        return F.softmax(z + y, dim=-1)


def _summary(trace):
    return [(op.label, op.type, op.parents, tuple(op.shape)) for op in trace.ops]


def test_hot_path_and_feature_path_record_the_same_graph():
    torch.manual_seed(0)
    model, x = _Net().eval(), torch.randn(3, 4)
    plain = tl.trace(model, x)
    featured = tl.trace(model, x, record_finite=True)  # finite flags send every op down the feature path
    assert _summary(plain) == _summary(featured)
    assert torch.equal(plain.output, featured.output)
    for a, b in zip(plain.ops, featured.ops):
        assert (a.activation is None) == (b.activation is None)
        if a.activation is not None:
            assert torch.equal(a.activation, b.activation), a.label


def test_copy_on_write_through_a_view_keeps_the_saved_value():
    def f(x):
        y = x * 2.0
        v = y.view(-1)
        v.add_(1.0)  # writes y's storage through a view: y's saved value must be copied first
        return y + 0.0

    x = torch.ones(2, 2)
    trace = tl.trace(f, x)
    assert torch.equal(trace["mul_1_1:1"].activation, torch.full((2, 2), 2.0))
    assert torch.equal(trace.output, torch.full((2, 2), 3.0))


def _buffer_op(trace, address):
    return next(op for op in trace.ops if op.is_buffer and op.io_path == address)


def test_eval_mode_running_statistics_are_held_by_reference_and_watched_through_the_batch_counter():
    # No copy: a later training-mode forward writes them in its kernel, where their own version counters
    # do not move, but it counts the batch (num_batches_tracked.add_), which does.
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    model[1].running_mean.add_(0.5)
    trace = tl.trace(model, torch.randn(3, 4))
    op = _buffer_op(trace, "1.running_mean")
    assert torch.equal(op.activation, model[1].running_mean)
    assert op.activation.untyped_storage().data_ptr() == model[1].running_mean.untyped_storage().data_ptr()
    model.eval()(torch.randn(3, 4))  # an eval forward writes nothing: the value stays
    assert torch.equal(op.activation, model[1].running_mean)
    model.train()(torch.randn(3, 4))
    with pytest.raises(tl.ActivationUnavailable, match="written in place after the trace ended"):
        op.activation


def test_running_statistics_read_in_eval_mode_never_show_a_later_training_forwards_values():
    # BatchNorm's kernel updates its running statistics without moving their version counters, so a
    # saved reference would silently show the statistics of a later training-mode forward: each is
    # dropped with the reason instead (its batch counter moved), and replay does not read it.
    from real_models import resnet

    model, (images,), _ = resnet()
    model.eval()
    as_traced = {name: b.clone() for name, b in model.named_buffers()}
    log = tl.trace(model, images)
    stats = [op for op in log if op.is_buffer and op.io_path.endswith(("running_mean", "running_var"))]
    assert stats and all(torch.equal(op.activation, as_traced[op.io_path]) for op in stats)
    model.train()
    model(images * 3 + 1)  # updates every running statistic in place, in the kernel
    assert not torch.equal(model.get_buffer(stats[0].io_path), as_traced[stats[0].io_path])
    for op in stats:
        with pytest.raises(tl.ActivationUnavailable, match="written in place after the trace ended"):
            op.activation
    result = log.validate()
    assert result.passed and not result.mismatched, str(result)


class _OwnStatistics(nn.Module):
    """Keeps running statistics of its own and normalises with them, as BatchNorm does, but counts no batch."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x):
        return F.batch_norm(x, self.mean, self.var, training=self.training, momentum=0.5)


def test_running_statistics_of_a_module_without_a_batch_counter_are_copied_once_the_forward_ends():
    # No counter tells of a later training-mode call, so the values as the forward read them are copied
    # when it ends (not per op).
    model = _OwnStatistics().eval()
    trace = tl.trace(model, torch.randn(3, 4))
    op = _buffer_op(trace, "mean")
    before = model.mean.clone()
    model.train()(torch.randn(3, 4) * 5 + 2)
    assert not torch.equal(model.mean, before)
    assert torch.equal(op.activation, before)


class _MixedStatistics(nn.Module):
    """A stock BatchNorm's statistics passed to F.batch_norm with keywords beside them, then a module that
    keeps statistics of its own and counts no batch."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.own = _OwnStatistics()

    def forward(self, x):
        bn = self.bn
        x = F.batch_norm(x, bn.running_mean, bn.running_var, weight=bn.weight, bias=bn.bias,
                         training=bn.training, momentum=0.5, eps=bn.eps)
        if bn.training:
            bn.num_batches_tracked.add_(1)  # as BatchNorm's own forward counts a batch
        return self.own(x)


def test_one_trace_watches_a_batchnorms_statistics_and_copies_those_of_a_module_without_a_counter():
    model = _MixedStatistics().eval()
    model.bn.running_mean.add_(0.5)
    trace = tl.trace(model, torch.randn(3, 4))
    watched, copied = _buffer_op(trace, "bn.running_mean"), _buffer_op(trace, "own.mean")
    assert watched.activation.data_ptr() == model.bn.running_mean.data_ptr()  # held, not copied
    assert copied.activation.data_ptr() != model.own.mean.data_ptr()
    before = model.own.mean.clone()
    model.train()(torch.randn(3, 4) * 5 + 2)
    with pytest.raises(tl.ActivationUnavailable, match="written in place after the trace ended"):
        watched.activation
    assert torch.equal(copied.activation, before)


class _Functional(nn.Module):
    """Running statistics passed to the functions directly, positionally and by keyword."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))
        self.register_buffer("imean", torch.zeros(4))
        self.register_buffer("ivar", torch.ones(4))

    def forward(self, x):
        x = torch.batch_norm(x, None, None, self.mean, self.var, True, 0.5, 1e-5, False)
        y = F.instance_norm(x.t().unsqueeze(0), running_mean=self.imean, running_var=self.ivar, use_input_stats=True,
                            momentum=0.5)
        return y.squeeze(0).t()


def test_running_statistics_written_in_a_kernel_keep_the_value_as_read():
    torch.manual_seed(0)
    model = _Functional()
    before = {name: b.clone() for name, b in model.named_buffers()}
    trace = tl.trace(model, torch.randn(3, 4) * 3 + 1)
    for name, value in before.items():
        assert not torch.equal(getattr(model, name), value), name  # the kernels did update them
        assert torch.equal(_buffer_op(trace, name).activation, value), name  # saved as they were read


def test_the_output_node_of_a_returned_tensor_written_after_the_trace_reads_as_dropped():
    # The output node shows its producer's saved tensor, the very tensor returned: written after the trace,
    # both read as dropped, never the later value.
    model = nn.Linear(4, 4)
    trace = tl.trace(model, torch.randn(2, 4))
    trace.output.add_(1)
    for label in ("linear_1_1", "output_1"):
        with pytest.raises(tl.ActivationUnavailable, match="written in place after the trace ended"):
            trace[label].activation


def test_the_outputs_of_a_call_returning_several_tensors_are_saved_detached():
    # Several outputs take the general recording path, not the hot path's one-tensor case: each is saved
    # detached, a reference to the output's memory, holding no graph.
    model = nn.Linear(3, 4)
    log = tl.trace(lambda x: [p * 2 for p in model(x).split(2, dim=1)], torch.randn(2, 3), root=model)
    parts = [op for op in log if op.func_name == "split"]
    assert len(parts) == 2
    for op in parts:
        assert not op.activation.requires_grad and op.activation.grad_fn is None and op.activation.shape == (2, 2)
