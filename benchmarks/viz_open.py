"""How fast the interactive HTML view of a ~5,000-op trace opens in headless Chromium.

Builds a staged transformer (8 stages x 30 blocks, hand-written attention) whose forward is about 5,000
ops, renders the HTML viewer, then loads it in Debian's chromium driven by Playwright and reports:
render seconds (Python: records, DOT, Graphviz layout), file size, and the milliseconds from navigation
to the viewer being interactive (its script finished wiring the first picture), plus a search and a
click round trip.  Run: ``.venv/bin/python benchmarks/viz_open.py``.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchlens as tl

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        weights = F.softmax(q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5, dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class StagedTransformer(nn.Module):
    def __init__(self, stages=8, blocks=30, width=16, heads=2):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.stages = nn.ModuleList(nn.Sequential(*(Block(width, heads) for _ in range(blocks)))
                                    for _ in range(stages))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        x = self.embed(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean(1))


def main():
    from playwright.sync_api import sync_playwright

    model = StagedTransformer().eval()
    log = tl.trace(model, torch.randn(2, 6, 8), save="none")
    out = pathlib.Path(tempfile.mkdtemp()) / "staged.html"
    t0 = time.perf_counter()
    log.render(out)
    render_s = time.perf_counter() - t0
    print(f"trace: {len(log)} ops, {len(log.module_calls)} module calls")
    print(f"render to HTML: {render_s:.2f} s, {out.stat().st_size / 2**20:.1f} MiB")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        for attempt in range(3):
            t0 = time.perf_counter()
            page.goto(out.as_uri())
            page.wait_for_selector("html[data-tl-ready]")
            wall = (time.perf_counter() - t0) * 1e3
            ready = page.evaluate("Number(document.documentElement.dataset.tlReady)")
            nodes = page.locator("#tl-canvas g.node").count()
            print(f"load {attempt + 1}: interactive {ready} ms after navigation start "
                  f"(goto to ready {wall:.0f} ms), first picture {nodes} nodes")
        shots = pathlib.Path(__file__).resolve().parent.parent / "artifacts"
        shots.mkdir(exist_ok=True)
        page.screenshot(path=str(shots / "viz_5000_first_picture.png"))
        t0 = time.perf_counter()
        page.fill("#tl-search", "linear_100")
        page.press("#tl-search", "Enter")
        page.wait_for_selector("#tl-canvas g.tl-hit")
        print(f"search + jump to a collapsed op: {(time.perf_counter() - t0) * 1e3:.0f} ms")
        page.screenshot(path=str(shots / "viz_5000_search.png"))
        browser.close()
    if errors:
        print("page errors:", errors)
        sys.exit(1)


if __name__ == "__main__":
    main()
