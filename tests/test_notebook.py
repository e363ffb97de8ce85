"""A trace displayed in a notebook: summary, module and op tables, and a viewer packed to open on demand."""

from __future__ import annotations

import base64
import gzip
import os
import re

import pytest
import torch

import torchlens as tl
from torchlens.viz import LayoutEngineMissing, find_engine
from zoo import LoopRNN

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _engine_or_skip():
    try:
        find_engine()
    except LayoutEngineMissing:
        pytest.skip("no layout engine")


def _packed_page(snippet: str) -> str:
    packed = re.search(r'<script type="application/octet-stream" id="tl-viewer-\d+">([^<]+)</script>', snippet)
    return gzip.decompress(base64.b64decode(packed.group(1))).decode("utf-8")


def test_a_12_layer_bert_displays_in_under_300_kb_with_the_viewer_on_demand():
    _engine_or_skip()
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=12, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100)
    log = tl.trace(transformers.BertModel(config).eval(), torch.randint(0, 100, (1, 8)))
    snippet = log._repr_html_()
    assert len(snippet.encode("utf-8")) < 300_000
    full = log.render(None, format="html")
    assert len(full) > 1_000_000  # what embedding the viewer itself would have cost
    assert _packed_page(snippet) == full  # the button opens exactly the viewer .show() would
    assert "Open the interactive viewer" in snippet and "<iframe" not in snippet
    assert "encoder.layer.11:1" in snippet  # the module table, two levels deep
    assert "embeddings:1" in snippet and "Trace of BertModel" in snippet
    assert f"{len(log) - 16} more ops" in snippet  # the compact op table


def test_the_op_table_lists_a_small_trace_whole():
    _engine_or_skip()
    log = tl.trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(1, 4))
    snippet = log._repr_html_()
    assert all(op.label in snippet for op in log.ops) and "more ops" not in snippet


def test_a_viewer_over_budget_points_at_show(monkeypatch):
    _engine_or_skip()
    from torchlens.viz import notebook

    monkeypatch.setattr(notebook, "BUDGET_BYTES", 100)
    snippet = tl.trace(LoopRNN(), torch.randn(2, 8))._repr_html_()
    assert "too large to keep in a notebook cell: call .show()" in snippet and "tlOpenViewer" not in snippet


def test_a_layout_engine_that_fails_leaves_the_tables_and_says_why(monkeypatch):
    """A notebook cell never raises for a drawing it cannot make: the summary and tables stay, with the reason."""
    from torchlens.viz import LayoutFailed, html

    def failing_layout(*args, **kwargs):
        raise LayoutFailed("dot failed (exit 1): syntax error in line 3")

    monkeypatch.setattr(html, "layout", failing_layout)
    snippet = tl.trace(LoopRNN(), torch.randn(2, 8))._repr_html_()
    assert "dot failed (exit 1): syntax error in line 3" in snippet and "tlOpenViewer" not in snippet
    assert "input_1:1" in snippet  # the op table is still there


def test_show_without_a_display_says_where_it_wrote(monkeypatch, capsys):
    _engine_or_skip()
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.setattr("webbrowser.open", lambda url: pytest.fail("no browser should be tried"))
    path = tl.trace(LoopRNN(), torch.randn(2, 8)).show()
    try:
        assert f"the viewer is at {path}" in capsys.readouterr().err and path.exists()
    finally:
        path.unlink()


def test_show_refused_leaves_no_file_and_never_opens_another_format(monkeypatch, tmp_path):
    """show made its temporary page before rendering: a refused argument left an empty file behind each time,
    and format='dot' wrote DOT text into the .html page it then opened as the viewer."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr("webbrowser.open", lambda url: pytest.fail("nothing should be opened"))
    log = tl.trace(LoopRNN(), torch.randn(2, 8))
    with pytest.raises(ValueError, match="view must be one of"):
        log.show(view="sideways")
    with pytest.raises(ValueError, match=r"render: depth=-1 is negative"):
        log.show(depth=-1)
    for other in ("dot", "svg"):
        with pytest.raises(ValueError, match=rf"show opens the interactive HTML viewer, not format='{other}'; write "
                                             r"that format with render\(path, format=\.\.\.\)"):
            log.show(format=other)
    with pytest.raises(TypeError, match=r"show\(\) got an unexpected keyword argument 'dept'; it takes render's "
                                        r"options \(view, depth, .*\) and max_ops in a notebook; closest: depth"):
        log.show(dept=2)  # was refused as render's keyword, a function the user did not call
    assert list(tmp_path.iterdir()) == []


def test_show_takes_format_html_or_none_inline_and_in_a_browser(monkeypatch, tmp_path):
    """show's format= may only say HTML, on both of its ways: in a notebook it failed with render's "multiple
    values for keyword argument 'format'" (html as well as dot), and in a browser format=None was refused."""
    _engine_or_skip()
    displayed = []
    monkeypatch.setattr("IPython.display.display", displayed.append)
    monkeypatch.setattr("torchlens.viz._in_notebook", lambda: True)
    log = tl.trace(LoopRNN(), torch.randn(2, 8))
    assert log.show(format="html") is None and "tlOpenViewer" in displayed[-1].data
    with pytest.raises(ValueError, match="show opens the interactive HTML viewer, not format='dot'"):
        log.show(format="dot")
    monkeypatch.setattr("torchlens.viz._in_notebook", lambda: False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr("webbrowser.open", lambda url: True)
    monkeypatch.setattr("torchlens.viz._has_display", lambda: True)
    assert log.show(format=None).read_text().startswith("<!DOCTYPE html>")
    assert log.show(max_ops=3).read_text().startswith("<!DOCTYPE html>")  # a notebook's limit: the page draws all



def test_notebook_html_takes_renders_options_in_its_own_name():
    """notebook_html passed render's options on beside its own format="html": format="html" (or any format) failed
    with render's "got multiple values for keyword argument 'format'", and an option render does not take was
    refused in the name of render, a function the user did not call."""
    _engine_or_skip()
    log = tl.trace(LoopRNN(), torch.randn(2, 8))
    page = _packed_page(tl.viz.notebook_html(log, format="html", view="rolled"))
    assert page == log.render(None, format="html", view="rolled")
    for other in ("dot", "svg"):
        with pytest.raises(ValueError, match=rf"notebook_html packs the interactive HTML viewer, not format='{other}'"):
            tl.viz.notebook_html(log, format=other)
    with pytest.raises(TypeError, match=r"notebook_html\(\) got an unexpected keyword argument 'dept'; it takes "
                                        r"max_ops and render's options \(view, depth, .*\); closest: depth"):
        tl.viz.notebook_html(log, dept=2)
    with pytest.raises(TypeError, match=r"notebook_html\(\) got an unexpected keyword argument 'path'"):
        tl.viz.notebook_html(log, path="graph.html")

class ScoredHead(torch.nn.Module):
    """A linear head (a FLOPs formula) and a cross-entropy loss (none): the loss call's count is a lower bound."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 3)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, target):
        return self.loss(self.head(x), target)


def test_the_module_table_marks_flops_that_are_a_lower_bound_as_print_does():
    log = tl.trace(ScoredHead(), (torch.randn(2, 4), torch.tensor([0, 2])))
    rows = {row["call"]: row for row in log.summary().rows}
    assert rows["loss:1"]["flops_complete"] is False and rows["head:1"]["flops_complete"] is True
    module_table = re.search(r"<table.*?</table>", tl.viz.notebook_html(log, max_ops=0)).group(0)
    cells = [re.findall(r"<td[^>]*>([^<]*)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", module_table)]
    flops = {row[0]: row[4] for row in cells if row}  # call, class, params, ops, FLOPs
    assert set(flops) == set(rows)
    assert flops["loss:1"].endswith("+") and not flops["head:1"].endswith("+")
    assert flops[log.model_name] == f"{rows[log.model_name]['flops']}+"
    assert "a lower bound" in tl.viz.notebook_html(log, max_ops=0)


def test_the_module_table_says_how_many_deeper_calls_it_leaves_out_and_where_they_are():
    """The table lists two levels: BERT's encoder.layer.0.attention.self (four levels down) was simply missing,
    as if the model had no deeper modules; a line now counts the calls left out and names log.summary()."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=50)
    log = tl.trace(transformers.BertModel(config).eval(), torch.randint(0, 50, (1, 4)))
    snippet = tl.viz.notebook_html(log, max_ops=0)
    listed_calls = set(re.findall(r"<tr><td[^>]*>([^<]*)</td>", snippet))
    deeper = [mc for mc in log.module_calls if mc.label not in listed_calls]
    assert "encoder.layer.0.attention.self:1" in {mc.label for mc in deeper}
    assert f"{len(deeper)} deeper module calls (down to level {max(mc.depth for mc in deeper) + 1}) not listed: " \
           "log.summary() lists every call" in snippet
    assert {mc.label for mc in deeper} <= {row["call"] for row in log.summary().rows}


def test_a_module_table_that_lists_every_call_adds_no_line_about_deeper_ones():
    snippet = tl.viz.notebook_html(tl.trace(torch.nn.Sequential(torch.nn.Linear(3, 3)), torch.randn(1, 3)), max_ops=0)
    assert "deeper module call" not in snippet and "0:1" in snippet
