"""FLOPs of the ops of an exported program's module: aten operator overloads called directly (``linear.default``),
counted with the formula of their operator, as the same model's eager ops are."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl
from torchlens.report import flops


class Mixed(nn.Module):
    """Convolution, batch and group norm, pooling, a linear layer, an embedding, layer norm and attention."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.gn = nn.GroupNorm(2, 8)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 16)
        self.emb = nn.Embedding(10, 16)
        self.ln = nn.LayerNorm(16)

    def forward(self, x, ids, attend: bool = True):
        h = self.pool(F.relu(self.gn(self.bn(self.conv(x)))))
        h = self.ln(self.fc(h.flatten(1)).unsqueeze(1) + self.emb(ids))
        if attend:
            q = h.view(h.shape[0], h.shape[1], 2, 8).transpose(1, 2)
            h = F.scaled_dot_product_attention(q, q, q)
        return F.gelu(h).mean(dim=-1).sum() + torch.softmax(h, -1).amax()


def _inputs():
    torch.manual_seed(0)
    return torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2, 5))


def _by_family(log) -> dict:
    totals: dict = {}
    for column in flops.flops_column(log):
        for family, count in (column or {}).items():
            totals[family] = totals.get(family, 0) + count
    return totals


def test_an_exported_programs_ops_count_as_the_eager_ops_do():
    model, args = Mixed().eval(), _inputs()
    eager = tl.trace(model, args)
    exported = tl.trace(torch.export.export(model, args).module(), args)
    assert any("." in op.func_name for op in exported.ops)  # its ops are operator overloads (linear.default)
    assert exported.flops.complete and eager.flops.complete
    assert int(exported.flops) == int(eager.flops) > 0
    assert _by_family(exported) == _by_family(eager)


def test_a_decomposed_program_counts_its_core_operators():
    # run_decompositions() calls convolution, _native_batch_norm_legit_no_training, native_group_norm,
    # native_layer_norm, addmm and _softmax: each counted as the eager function it stands for.
    model, args = Mixed().eval(), _inputs()
    args_plain = (*args, False)
    eager = tl.trace(model, args_plain)
    program = torch.export.export(model, args_plain).run_decompositions()
    decomposed = tl.trace(program.module(), args_plain)
    names = {op.func_name.partition(".")[0] for op in decomposed.ops}
    assert {"convolution", "_native_batch_norm_legit_no_training", "native_group_norm", "native_layer_norm",
            "_softmax"} <= names
    assert decomposed.flops.complete
    assert int(decomposed.flops) == int(eager.flops)


def test_aten_batch_norm_reads_its_own_argument_order():
    # aten's batch_norm takes (input, weight, bias, running_mean, running_var, training, ...), F.batch_norm
    # (input, running_mean, running_var, weight, bias, training, ...): without affine weights, in eval mode,
    # both normalise with the running statistics (2 FLOPs per element).
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.zeros(4))
            self.register_buffer("var", torch.ones(4))

        def forward(self, x):
            return F.batch_norm(x, self.mean, self.var)

    class Aten(Functional):
        def forward(self, x):
            return torch.ops.aten.batch_norm.default(x, None, None, self.mean, self.var, False, 0.1, 1e-5, False)

    x = torch.randn(3, 4, 5)
    expected = tl.trace(Functional(), x).flops
    assert int(expected) == 2 * x.numel()
    assert int(tl.trace(Aten(), x).flops) == int(expected)


def test_an_operator_of_another_namespace_is_not_counted_by_its_name():
    @torch.library.custom_op("torchlens_test::linear", mutates_args=())
    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.t()

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 6))

        def forward(self, x):
            return linear(x, self.w)

    log = tl.trace(Custom(), torch.randn(2, 6))
    op = next(op for op in log.ops if op.func_name == "linear.default")
    assert tl.report.op_flops(op) is None
    assert op.label in log.flops.unknown


def test_flops_vs_dispatch_compares_an_exported_programs_module_as_the_eager_model():
    # Its ops are overloads on both sides: the witness pairs them, and the notes read as the eager model's.
    model, args = Mixed().eval(), _inputs()
    eager = tl.report.flops_vs_dispatch(model, args)
    exported = tl.report.flops_vs_dispatch(torch.export.export(model, args).module(), args)
    assert (exported.torchlens_total, exported.native_total, exported.families) == \
        (eager.torchlens_total, eager.native_total, eager.families)
    assert [note.split(" (here")[0] for note in exported.notes] == [note.split(" (here")[0] for note in eager.notes]
