"""A KeyboardInterrupt at every line of a save that replaces a trace (tests/interrupts.py): afterwards the
folder holds one whole trace, the old or the new, the user's other files in it are kept, and nothing is left
beside it (the old trace, moved aside while the new one is put in place, in a hidden folder)."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from interrupts import interrupt_every_line
from torchlens.io.save import __file__ as SAVE_PY

# The steps from the check of what the folder holds to the deletion of the old trace's files.
REPLACING = {"_replace_saved", "_uninterrupted", "_rename_in", "_swap_in", "_swap_folders",
             "_swap_trace_files", "_swap_files", "_move_all", "_discard_retired", "_remove_files"}


def in_the_swap(code) -> bool:
    return code.co_filename == SAVE_PY and code.co_name in REPLACING


@pytest.fixture(autouse=True)
def no_flush_to_disk(monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # only a power loss needs it; most of a save's time here


@pytest.fixture(scope="module")
def traces():
    torch.manual_seed(0)
    x = torch.randn(1, 3)
    return tl.trace(nn.Linear(3, 3), x), tl.trace(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), x)


@pytest.mark.parametrize("foreign", [False, True], ids=["trace-only", "with-other-files"])
def test_an_interrupt_at_any_line_of_a_save_over_a_trace_leaves_one_trace_and_nothing_beside_it(tmp_path, traces,
                                                                                                 foreign):
    old, new = traces
    template = old.save(tmp_path / "template" / "t", activations=False)  # fewer files, fewer lines to run
    if foreign:
        with open(os.path.join(template, "notes.txt"), "w") as f:
            f.write("keep me")
    folders = []

    def save_over_a_copy():
        folders.append(tmp_path / f"run{len(folders)}" / "t")
        shutil.copytree(template, folders[-1])
        new.save(folders[-1], activations=False, overwrite=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning naming the kept notes.txt
        landed = interrupt_every_line(save_over_a_copy, in_the_swap)
    assert landed > 30, f"only {landed} interrupts landed in the save"
    lengths = set()
    for folder in folders:
        assert os.listdir(folder.parent) == ["t"], f"{folder}: left beside it: {os.listdir(folder.parent)}"
        lengths.add(len(tl.load(folder)))
        assert not foreign or (folder / "notes.txt").read_text() == "keep me"
    assert lengths == {len(old), len(new)}  # interrupts landed both before and after the new trace was in place


def test_an_interrupt_at_any_line_of_a_first_save_leaves_the_trace_or_nothing(tmp_path, traces):
    folders = []

    def save_into_an_empty_folder():
        folders.append(tmp_path / f"run{len(folders)}" / "t")
        os.makedirs(folders[-1])
        traces[1].save(folders[-1], activations=False)

    landed = interrupt_every_line(save_into_an_empty_folder, in_the_swap)
    assert landed > 5, f"only {landed} interrupts landed in the save"
    for folder in folders:
        assert os.listdir(folder.parent) == ["t"], f"{folder}: left beside it: {os.listdir(folder.parent)}"
        assert os.listdir(folder) == [] or len(tl.load(folder)) == len(traces[1])
