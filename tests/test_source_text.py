"""``op.source.code``, the text of an op's line, is the line of the code that ran, or '' when the file no longer
holds it: a module edited on disk and imported again (a notebook cell run again after an edit), code made from a
string under a file's name.  The ground truth is the file read afresh (``linecache.checkcache``)."""

from __future__ import annotations

import importlib.util
import linecache
import pickle

import torch

import torchlens as tl

_BEFORE = '''import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu()  # before the edit

    def extra_repr(self):
        return "edited"
'''
# Two lines added above the class: the forward's line moves down two, onto the old text's ``def extra_repr``;
# its old line number holds a blank line.
_AFTER = '''import torch.nn as nn
# a comment added
# and another


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).sigmoid()  # after the edit
'''


def _import(path, name="edited_net"):
    """The module at ``path``, imported afresh (as running a notebook cell that imports it again does)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _texts(log) -> list:
    return [(op.source.line, op.source.code) for op in log.ops if op.kind == "op"]


def _fresh(path, line: int) -> str:
    linecache.checkcache(str(path))
    return linecache.getline(str(path), line).strip()


def test_a_module_edited_and_imported_again_shows_its_new_lines(tmp_path):
    path = tmp_path / "edited_net.py"
    path.write_text(_BEFORE)
    x = torch.randn(2, 4)
    before = tl.trace(_import(path).Net(), x)
    assert [code for _, code in _texts(before)] == ["return self.fc(x).relu()  # before the edit"] * 2
    path.write_text(_AFTER)
    after = tl.trace(_import(path).Net(), x)
    assert [(line, code) for line, code in _texts(after)] == [(12, "return self.fc(x).sigmoid()  # after the edit")] * 2
    assert all(code == _fresh(path, line) for line, code in _texts(after))
    # The first trace's code is no longer in the file: its line there is another line, so none is shown.
    assert [code for _, code in _texts(before)] == ["", ""]
    assert str(before.ops[1].source) == f"{path}:10 in Net.forward"  # where it ran is still known
    assert pickle.loads(pickle.dumps(before.ops[1].source)) == before.ops[1].source


def test_code_compiled_from_a_string_under_a_files_name_shows_no_line_of_that_file(tmp_path):
    path = tmp_path / "named.py"
    path.write_text(_BEFORE)
    namespace: dict = {}
    exec(compile(_AFTER, str(path), "exec"), namespace)  # the text that ran is not the file's
    log = tl.trace(namespace["Net"](), torch.randn(2, 4))
    assert _fresh(path, 12) == "def extra_repr(self):"  # the file's line 12, not the line that ran
    assert _texts(log) == [(12, "")] * 2
    exec(compile(_BEFORE, str(path), "exec"), namespace)  # the file's own text: its lines are shown
    log = tl.trace(namespace["Net"](), torch.randn(2, 4))
    assert _texts(log) == [(10, "return self.fc(x).relu()  # before the edit")] * 2
