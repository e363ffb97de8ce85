"""The HTML viewer in a real browser: Debian's chromium, headless, driven by Playwright.

Checks what a user does: the page opens offline with no console errors, shows every op, search
highlights a label, a click shows the record, a collapsed module opens and closes.  Screenshots land in
artifacts/ (git-ignored).  `make browser` installs chromium where it is missing.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

import torchlens as tl

sys.path.insert(0, os.path.dirname(__file__))
from zoo import zoo  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
ARTIFACTS = pathlib.Path(__file__).resolve().parent.parent / "artifacts"

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is absent: run `make browser` (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def open_page(browser):
    """Open an HTML file; yields a function returning (page, console errors seen so far)."""
    contexts = []

    def opener(path):
        context = browser.new_context(viewport={"width": 1280, "height": 860}, offline=True)
        contexts.append(context)
        page = context.new_page()
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: errors.append(f"network request: {r.url}")
                if not r.url.startswith("file:") else None)
        page.goto(pathlib.Path(path).as_uri())
        page.wait_for_selector("html[data-tl-ready]", timeout=20000)
        return page, errors

    yield opener
    for context in contexts:
        context.close()


def trace_of(name):
    model, args, kwargs = zoo(0)[name]
    return tl.trace(model, args, kwargs)


def shot(page, name):
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"viz_{name}.png"
    page.screenshot(path=str(path))
    assert path.stat().st_size > 1000


def test_page_shows_every_op_searches_and_shows_records(open_page, tmp_path):
    log = trace_of("small_cnn")
    page, errors = open_page(log.render(tmp_path / "cnn.html"))
    assert page.locator("#tl-canvas g.node.tl-node").count() == len(log)
    target = log["relu_2_6"]
    page.fill("#tl-search", "relu_2_6")
    page.press("#tl-search", "Enter")
    hit = page.locator("#tl-canvas g.tl-hit")
    assert hit.count() == 1 and hit.get_attribute("id") == f"o{target.index}"
    assert "relu_2_6:1" in page.inner_text("#tl-panel")
    page.click("#tl-fit")
    page.locator(f"#o{log['conv2d_1_1'].index}").click(timeout=5000)
    panel = page.inner_text("#tl-panel")
    assert "conv2d_1_1:1" in panel and "2x8x8x8" in panel and "float32" in panel
    assert "features.0:1 (Conv2d)" in panel and "features.0.weight" in panel and "zoo.py" in panel
    assert "mean" in panel  # activation statistics of the saved output
    shot(page, "small_cnn")
    assert errors == []


def test_rolled_view_counts_layers(open_page, tmp_path):
    log = trace_of("loop_rnn")
    page, errors = open_page(log.render(tmp_path / "loop.html", view="rolled", color_by="duration"))
    assert page.locator("#tl-canvas g.node.tl-node").count() == len(log.layers)
    assert "\u00d716" in page.inner_text("#tl-canvas")
    assert "instrumented" in page.inner_text("#tl-legend")
    page.locator(f"#l{log['linear_1_2:1'].index}").click(timeout=5000)
    assert "linear_1_2:16" in page.inner_text("#tl-panel")
    shot(page, "loop_rnn_rolled")
    assert errors == []


def test_collapsed_modules_open_close_and_search_reaches_inside(open_page, tmp_path):
    log = trace_of("transformer_fastpath")
    page, errors = open_page(log.render(tmp_path / "tf.html", depth=0))
    views = page.evaluate("JSON.parse(document.getElementById('tl-data').textContent).views")
    assert sum(v["items"] for v in views) == len(log)  # every op drawn once, across the pictures
    assert page.locator("#tl-canvas g.node.tl-node:not(.tl-module)").count() == views[0]["items"]
    layer = log.module_calls[0]
    module = page.locator(f"#m{layer.index}")
    assert module.count() == 1
    module.dblclick(timeout=5000)
    page.wait_for_selector(f"#tl-crumbs >> text={layer.label}")
    inside = page.locator("#tl-canvas g.node.tl-node:not(.tl-ref)").count()
    assert inside > 1
    shot(page, "transformer_opened")
    page.click("#tl-up")
    assert page.locator(f"#m{layer.index}.tl-hit").count() == 1  # back out, the module is highlighted
    module.dblclick(timeout=5000)
    source = log.ops[layer._input_nodes[0]]
    page.click("#tl-fit")
    page.locator(f"#ro{source.index}").click(timeout=5000)  # a "from ..." note leads to the real node
    assert page.locator(f"#o{source.index}.tl-hit").count() == 1
    assert page.locator(f"#m{layer.index}").count() == 1
    module.dblclick(timeout=5000)
    page.click("#tl-crumbs a >> nth=0")
    assert page.locator(f"#m{layer.index}").count() == 1
    deep = log["linear_1_7"]
    page.fill("#tl-search", "linear_1_7")
    page.press("#tl-search", "Enter")
    assert page.locator(f"#o{deep.index}.tl-hit").count() == 1
    assert "linear_1_7:1" in page.inner_text("#tl-panel")
    assert errors == []


def _tall_bert():
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=12, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100)
    return tl.trace(transformers.BertModel(config).eval(), torch.randint(0, 100, (1, 8)))


_VIEW = """() => {
  const box = document.querySelector('#tl-canvas svg').getAttribute('viewBox').split(/[\\s,]+/).map(Number);
  const rect = document.getElementById('tl-canvas').getBoundingClientRect();
  return {scale: Math.max(box[2] / rect.width, box[3] / rect.height), x: box[0], y: box[1]};
}"""


def test_fit_on_a_tall_model_stays_readable(open_page, tmp_path):
    log = _tall_bert()
    page, errors = open_page(log.render(tmp_path / "bert.html", depth=10))  # everything expanded: very tall
    page.keyboard.press("w")
    assert page.evaluate(_VIEW)["scale"] > 1.5  # the whole picture would be an unreadable strip
    page.click("#tl-fit")
    fitted = page.evaluate(_VIEW)
    assert 1.0 <= fitted["scale"] <= 1.5 + 1e-6 and fitted["y"] <= 0  # readable, from the top
    shot(page, "bert_fit_width")
    assert errors == []


def test_left_to_right_layout_is_wide(open_page, tmp_path):
    log = _tall_bert()
    page, errors = open_page(log.render(tmp_path / "bert_lr.html", depth=10, direction="LR"))
    page.keyboard.press("w")
    size = page.evaluate("() => document.querySelector('#tl-canvas svg').getAttribute('viewBox')"
                         ".split(/[\\s,]+/).map(Number)")
    assert size[2] > size[3]  # data flows across the page
    page.click("#tl-fit")
    assert page.evaluate(_VIEW)["scale"] <= 1.5 + 1e-6
    shot(page, "bert_left_to_right")
    assert errors == []


def test_checked_finite_and_inputs_look_different(open_page, tmp_path):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    log = tl.trace(model, torch.randn(2, 4), record_finite=True)
    page, errors = open_page(log.render(tmp_path / "finite.html", color_by="nonfinite"))
    fills = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#tl-canvas g.tl-node')]
        .map(g => [g.id, g.querySelector('polygon, ellipse, path').getAttribute('fill')]))""")
    input_fill = fills[f"o{log.inputs[0].index}"]
    op_fill = fills[f"o{log['linear_1_1'].index}"]
    assert input_fill != op_fill
    shot(page, "checked_finite")
    assert errors == []


def test_notebook_button_opens_the_viewer(browser, tmp_path):
    page_file = tmp_path / "cell.html"
    log = trace_of("small_cnn")
    page_file.write_text(f"<!DOCTYPE html><html><body>{log._repr_html_()}</body></html>", encoding="utf-8")
    context = browser.new_context(viewport={"width": 1280, "height": 900}, offline=True)
    try:
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(page_file.as_uri())
        assert page.locator("iframe").count() == 0  # nothing heavy until asked
        page.click("button.tl-open-viewer")
        frame = page.frame_locator("iframe")
        frame.locator("html[data-tl-ready]").wait_for(timeout=20000)
        assert frame.locator("#tl-canvas g.node.tl-node").count() == len(log)
        shot(page, "notebook_opened")
        assert errors == []
    finally:
        context.close()


def test_an_intervened_op_shows_what_changed_it(open_page, tmp_path):
    model, args, kwargs = zoo(0)["small_cnn"]
    log = tl.trace(model, args, kwargs, intervene={"features.0": tl.zero_ablate()})
    (applied,) = log.interventions
    page, errors = open_page(log.render(tmp_path / "ablated.html", depth=None))
    page.fill("#tl-search", applied.label.split(":")[0])
    page.press("#tl-search", "Enter")
    panel = page.inner_text("#tl-panel")
    assert "changed by" in panel and "zero_ablate() at features.0" in panel and "original" in panel
    assert errors == []
