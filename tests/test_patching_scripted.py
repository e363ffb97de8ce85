"""Patching tables name why a module call has no output op to patch: a TorchScript module's output is made in
TorchScript's interpreter, where no op holds it, while another such call returns no tensor at all."""

import pytest
import torch
import torch.nn as nn

import torchlens as tl

# Each run of a table warns that the scripted module's interior is unseen (tested in test_capture_torchscript.py).
pytestmark = [pytest.mark.filterwarnings("ignore:TorchScript modules"), pytest.mark.filterwarnings("ignore:`torch.jit")]


class _Counter(nn.Module):
    """Returns no tensor: a step count."""

    def forward(self, x):
        return x.shape[0]


class _ScriptedMiddle(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.inner = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
        self.count = _Counter()
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        return self.b(self.inner(self.a(x))) * self.count(x)


@pytest.fixture(scope="module")
def experiment():
    torch.manual_seed(0)
    return _ScriptedMiddle(), torch.randn(3, 4), torch.randn(3, 4), lambda out: out[0, 0] - out[1, 1]


def test_activation_patching_says_a_torchscript_call_runs_where_no_op_holds_its_output(experiment):
    model, clean, corrupt, metric = experiment
    rows = tl.report.activation_patching(model, clean, corrupt, metric, sites="modules", progress=False)
    errors = rows.set_index("site").error
    assert "runs in TorchScript's interpreter" in errors["inner:1"] and "returns no tensor" not in errors["inner:1"]
    assert "returns no tensor" in errors["count:1"]
    assert errors["a:1"] == errors["b:1"] == ""


def test_attribution_patching_notes_why_a_call_without_output_ops_has_no_estimate(experiment):
    model, clean, corrupt, metric = experiment
    rows = tl.report.attribution_patching(model, clean, corrupt, metric).set_index("site")
    assert rows.estimate[["inner:1", "count:1"]].isna().all()
    assert "runs in TorchScript's interpreter" in rows.note["inner:1"]
    assert "returns no tensor" in rows.note["count:1"]
    assert not rows.estimate[["a:1", "b:1"]].isna().any()


def test_by_position_a_call_without_output_ops_has_one_row_saying_why(experiment):
    # It used to fail the whole table, reading the shape of the call record as if it were an op.
    model, clean, corrupt, metric = experiment
    rows = tl.report.activation_patching(model, clean, corrupt, metric, sites="modules", positions=1, progress=False)
    unindexed = rows[rows.position.isna()].set_index("site").error
    assert sorted(unindexed.index) == ["count:1", "inner:1"]
    assert "TorchScript" in unindexed["inner:1"] and "returns no tensor" in unindexed["count:1"]
    assert rows[rows.site == "b:1"].position.tolist() == [0, 1]


def test_a_module_whose_calls_return_no_tensor_has_a_row_saying_so_not_a_patch_that_changed_nothing(experiment):
    # Its row used to hold the corrupted baseline (normalized 0.0), as if the patch had been made and had no effect.
    model, clean, corrupt, metric = experiment
    whole = tl.report.activation_patching(model, clean, corrupt, metric, sites=["count", "b"], progress=False)
    assert whole.normalized.isna().tolist() == [True, False] and "no tensor" in whole.error[0]
    by_position = tl.report.activation_patching(model, clean, corrupt, metric, sites=["count", "inner"], positions=1,
                                                progress=False).set_index("site")
    assert by_position.position.isna().all() and "no tensor" in by_position.error["count"]
    assert "TorchScript" in by_position.error["inner"]
