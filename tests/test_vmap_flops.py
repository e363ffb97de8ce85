"""Ops inside ``torch.vmap``: capture is handed each per-example call, so the record carries one example's shape
while the kernels ran on the whole batch.  FLOPs counted from those shapes would read as a plausible total short by
the batch size: such ops are unknown, named in the summary and in ``flops_vs_dispatch``'s notes."""

import torch
import torch.nn as nn

import torchlens as tl
from torchlens.record.columns import per_example_ops
from torchlens.report import total_flops


class VmappedBlock(nn.Module):
    """fc, relu and a constant add run per example under vmap; the relu and mul after it run on the batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        per_example = torch.vmap(lambda row: self.fc(row).relu() + torch.ones(4))
        return per_example(x).relu() * 2


class GradOfVmap(nn.Module):
    """vmap over torch.func.grad: the per-example tensors are grad's wrappers around vmap's batched ones."""

    def forward(self, x):
        return torch.vmap(torch.func.grad(lambda row: (row.sin() * 3).sum()))(x) + 1


def _labels(trace, indices):
    return [trace.labels[i] for i in sorted(indices)]


def test_ops_inside_vmap_are_unknown_flops_and_the_ops_around_it_are_counted():
    model, x = VmappedBlock(), torch.randn(5, 3, 4)
    for save in ("none", "all"):
        trace = tl.trace(model, x, save=save)
        assert _labels(trace, per_example_ops(trace)) == ["linear_1_1:1", "relu_1_2:1", "add_1_4:1"]
        assert tuple(trace["linear_1_1:1"].shape) == (3, 4)  # one example's shape, as documented
        flops = total_flops(trace)
        assert list(flops.unknown) == ["linear_1_1:1", "relu_1_2:1", "add_1_4:1"]
        assert int(flops) == 2 * 5 * 3 * 4  # the relu and the mul after vmap, on the whole (5, 3, 4) batch
        assert "3 ops ran inside torch.vmap (linear_1_1:1, relu_1_2:1, add_1_4:1)" in str(trace)


def test_flops_vs_dispatch_names_the_ops_inside_vmap_instead_of_reading_short():
    comparison = tl.report.flops_vs_dispatch(VmappedBlock(), torch.randn(5, 3, 4))
    assert any("3 captured ops ran inside torch.vmap" in note for note in comparison.notes)
    assert comparison.torchlens_unknown == ("linear_1_1:1", "relu_1_2:1", "add_1_4:1")


def test_a_grad_wrapper_around_vmaps_batched_tensor_is_per_example_and_grad_alone_is_not():
    x = torch.randn(6, 5)
    trace = tl.trace(GradOfVmap(), x)
    inside = _labels(trace, per_example_ops(trace))
    assert inside and "add_1_" not in " ".join(inside)  # the add after the transform runs on the batch
    assert {trace[label].func_name for label in inside} >= {"sin", "mul", "sum"}
    plain = tl.trace(lambda row: torch.func.grad(lambda r: (r.sin() * 3).sum())(row) + 1, x)
    assert not per_example_ops(plain)  # grad's wrappers keep the real shape: counted (its backward has no formula)
    assert [plain[label].func_name for label in total_flops(plain).unknown] == ["grad"]


def test_a_saved_trace_keeps_which_ops_ran_inside_vmap(tmp_path):
    trace = tl.trace(VmappedBlock(), torch.randn(5, 3, 4))
    loaded = tl.load(trace.save(str(tmp_path / "vmapped")))
    assert _labels(loaded, per_example_ops(loaded)) == ["linear_1_1:1", "relu_1_2:1", "add_1_4:1"]
    assert "ran inside torch.vmap" in str(loaded)
