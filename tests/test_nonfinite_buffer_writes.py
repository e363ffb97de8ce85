"""``nonfinite_origin`` on running statistics that a kernel writes (BatchNorm in training mode): the trace on
which a statistic goes non-finite names the op whose kernel wrote it, not only the next trace."""

from __future__ import annotations

import torch
import torch.nn as nn

import torchlens as tl


def _overflowing_norm():
    """Inputs of magnitude 1e20: their variance (1e40) overflows float32 inside batch_norm's kernel, whose
    output (normalised) stays finite while ``running_var`` (momentum 1: the batch's variance) becomes Inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=1.0)).train()
    return model, torch.randn(8, 4) * 1e20


def test_running_var_overflow_is_named_on_the_trace_where_it_happens():
    model, x = _overflowing_norm()
    log = tl.trace(model, x)
    assert torch.isinf(model[1].running_var).all() and torch.isfinite(log[-1].activation).all()
    report = tl.debug.nonfinite_origin(log)
    assert report.found and report.origin_kind == "buffer_write" and report.certain
    assert report.origin.func_name == "batch_norm" and report.kind == "inf"
    assert report.buffers_written == ((report.origin_label, "1.running_var", "inf"),)
    assert "left INF in buffer 1.running_var" in str(report)
    later = tl.debug.nonfinite_origin(tl.trace(model, torch.randn(8, 4)))  # the next trace: already present
    assert later.origin_kind == "buffer" and later.origin.io_path == "1.running_var"


def test_flags_alone_still_name_the_write_after_cleanup():
    model, x = _overflowing_norm()
    log = tl.trace(model, x, record_finite=True)
    log.cleanup()
    report = tl.debug.nonfinite_origin(log)
    assert report.origin_kind == "buffer_write" and report.origin.func_name == "batch_norm"


def test_eval_mode_and_finite_training_report_no_write():
    model, x = _overflowing_norm()
    assert not tl.debug.nonfinite_origin(tl.trace(model, torch.randn(8, 4))).buffers_written
    model.eval()
    assert not tl.debug.nonfinite_origin(tl.trace(model, x)).found  # eval: statistics read, never written


def test_an_earlier_op_origin_keeps_the_write_among_further_origins():
    model, x = _overflowing_norm()
    log = tl.trace(lambda t: (model(t), torch.log(-t.abs() - 1)), x, root=model)
    report = tl.debug.nonfinite_origin(log)
    assert report.origin_kind == "op" and report.origin.func_name == "log"  # born in an output: named first
    assert report.buffers_written[0][0] in report.other_origins
    assert "running statistics left non-finite inside a kernel: 1.running_var (INF" in str(report)


class Twice(nn.Module):
    """One BatchNorm run on two inputs: the first overflows its running_var, the second only carries the Inf on."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x, y):
        return self.bn(x) + self.bn(y)


def test_a_statistic_written_by_several_calls_is_no_certain_origin_of_the_last():
    model = Twice().train()
    log = tl.trace(model, (torch.randn(8, 4) * 1e20, torch.randn(8, 4)))
    report = tl.debug.nonfinite_origin(log)
    first, last = (op.label for op in log.ops if op.func_name == "batch_norm")
    assert report.origin_kind == "buffer_write" and report.origin_label == last and not report.certain
    assert report.possible_origins == (first,) and f"the origin may be among {first}" in str(report)


def test_a_saved_trace_keeps_the_write(tmp_path):
    model, x = _overflowing_norm()
    log = tl.trace(model, x)
    live = tl.debug.nonfinite_origin(log)
    loaded = tl.debug.nonfinite_origin(tl.load(log.save(tmp_path / "t")))
    assert (loaded.origin_kind, loaded.origin_label, loaded.buffers_written) == \
        (live.origin_kind, live.origin_label, live.buffers_written) == \
        ("buffer_write", live.origin_label, ((live.origin_label, "1.running_var", "inf"),))


def test_statistics_from_outside_the_trace_are_said_to_be_unexamined():
    """A BatchNorm called by a function traced with no root: its statistics are no buffers of the trace, so
    nothing examines what its kernel wrote, and the report said only that no NaN or Inf was found."""
    model, x = _overflowing_norm()
    norm = model[1]
    report = tl.debug.nonfinite_origin(tl.trace(lambda t: norm(t), x))
    assert torch.isinf(norm.running_var).all() and not report.found
    (label,) = report.stats_unexamined
    assert label.startswith("batchnorm") and f"kernels of {label} were not examined" in str(report)
    model, x = _overflowing_norm()
    assert not tl.debug.nonfinite_origin(tl.trace(model, x)).stats_unexamined  # its buffers: examined


def test_a_saved_trace_keeps_the_statistics_it_could_not_examine(tmp_path):
    """The loaded report said nothing of them, as if the statistics had been examined and found finite."""
    model, x = _overflowing_norm()
    norm = model[1]
    log = tl.trace(lambda t: norm(t), x)
    live = tl.debug.nonfinite_origin(log)
    loaded = tl.debug.nonfinite_origin(tl.load(log.save(tmp_path / "t")))
    assert loaded.stats_unexamined == live.stats_unexamined and len(live.stats_unexamined) == 1
    assert f"kernels of {live.stats_unexamined[0]} were not examined" in str(loaded)
