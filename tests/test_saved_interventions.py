"""Saved intervened traces: ``op.intervention`` and ``op.original`` come back from ``tl.load``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from torchlens.io import TraceFileError


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)).eval()


def test_a_loaded_intervened_trace_keeps_what_was_applied_and_the_original_values(tmp_path):
    model, x = _model(), torch.randn(4, 8)
    plain = tl.trace(model, x)
    log = tl.trace(model, x, intervene={"2": tl.zero_ablate(), "relu_2_4:1": tl.scale(2.0)}, reference=plain)
    log.save(tmp_path / "t")
    loaded = tl.load(tmp_path / "t")
    assert [repr(a) for a in loaded.interventions] == [repr(a) for a in log.interventions]
    assert [a.label for a in loaded.interventions] == ["linear_2_3:1", "relu_2_4:1"]
    for op in log:
        back = loaded[op.label]
        assert (back.intervention is None) == (op.intervention is None), op.label
        if op.original is not None:
            assert torch.equal(back.original, op.original), op.label
        else:
            assert back.original is None, op.label
    assert torch.equal(loaded["2"].original, plain["2"].activation)
    assert torch.equal(loaded["2"].activation, torch.zeros(4, 16))
    assert repr(loaded["2"].intervention.action) == "zero_ablate()"

    # Without tensors the record of what was applied stays; the originals, like activations, do not.
    log.save(tmp_path / "meta", activations=False)
    meta = tl.load(tmp_path / "meta")
    assert meta["2"].intervention is not None
    says = r"linear_2_3:1: the value before the intervention .*saved with activations=False"
    with pytest.raises(tl.ActivationUnavailable, match=says):
        meta["2"].original  # was None, as if the live trace had kept no original there
    assert meta["relu_1_2:1"].original is None  # no intervention there: none to have
    # A plain trace loads with none.
    plain.save(tmp_path / "plain")
    reread = tl.load(tmp_path / "plain")
    assert not reread.interventions and all(op.intervention is None for op in reread)


def _another_originals_key(originals):
    """Point the first original at the second's tensor (of another shape): else loaded as the first op's."""
    originals[0][1] = originals[1][1]


@pytest.mark.parametrize("edit, message", [
    (lambda record: record["applied"][0].__setitem__(0, 10 ** 6), "interventions"),
    (lambda record: _another_originals_key(record["originals"]), r"original '.*' is missing or does not match op #"),
])
def test_a_damaged_interventions_record_is_refused(tmp_path, edit, message):
    import json

    model, x = _model(), torch.randn(4, 8)
    tl.trace(model, x, intervene={"2": tl.zero_ablate(), "4": tl.scale(2.0)}).save(tmp_path / "t")
    path = tmp_path / "t" / "trace.json"
    record = json.loads(path.read_text())
    edit(record["interventions"])
    path.write_text(json.dumps(record))
    from torchlens.io.format import sha256_of

    manifest_path = tmp_path / "t" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["trace.json"] = {"bytes": path.stat().st_size, "sha256": sha256_of(str(path))}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(TraceFileError, match=message):
        tl.load(tmp_path / "t")


def test_a_channels_last_original_loads_laid_out_as_it_was(tmp_path):
    # Activations and gradients kept their layout through a save; the values an intervention replaced loaded
    # row-major.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    log = tl.trace(model, x, intervene={"0": lambda value, op: value * 2})
    assert log["0"].original.is_contiguous(memory_format=torch.channels_last)
    loaded = tl.load(log.save(tmp_path / "a"))
    again = tl.load(loaded.save(tmp_path / "b"))
    for trace in (loaded, again):
        kept = trace["0"].original
        assert kept.stride() == log["0"].original.stride() and torch.equal(kept, log["0"].original)


def test_an_original_no_file_can_hold_says_why_it_is_missing(tmp_path):
    # A complex128 original was left out of the folder, and the loaded op.original read None beside an
    # op.activation that said why it was missing.
    log = tl.trace(lambda x: (x * 2).to(torch.complex128).abs() + 1, torch.randn(3),
                   intervene={"to_1_2:1": tl.scale(2.0)})
    assert log["to_1_2:1"].original.dtype == torch.complex128
    log.save(tmp_path / "t")
    loaded = tl.load(tmp_path / "t")
    with pytest.raises(tl.ActivationUnavailable, match=r"to_1_2:1: the value before the intervention was dropped: "
                                                       r"not saved: safetensors cannot store complex128"):
        loaded["to_1_2:1"].original
    assert loaded["to_1_2:1"].intervention is not None and loaded["mul_1_1:1"].original is None
    loaded.render(tmp_path / "view.html")  # the viewer shows the op without its original
