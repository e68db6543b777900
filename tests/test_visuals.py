"""Visuals: latent and example selection, drawing, the HTML page, and a real headless browser.

The browser checks use Debian's Chromium (``apt-get install chromium``; ``.ci/run`` installs
it). Without it they fail, never skip: a page nobody has rendered is not tested.
"""

from __future__ import annotations

import functools
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_runs import write_store

from actstore.errors import ConfigError, StoreNotFoundError
from actstore.runs import Run
from actstore.sae.sparse import SparseActs
from actstore.visuals import render_run
from actstore.visuals.images import patch_grid, render_example
from actstore.visuals.page import Section, index_html
from actstore.visuals.select import TokenRows, example_activations, top_examples, top_latents
from actstore.visuals.text import Context, TokenText, context_html, render_contexts

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
)

_CHECK_PAGE = """<!doctype html><html><head><meta charset="utf-8"></head><body>
<pre id="report">pending</pre>
<iframe id="page" src="site/{page}" width="1400" height="900"></iframe>
<script>
document.getElementById("page").addEventListener("load", (event) => {{
  const doc = event.target.contentDocument;
  const images = Array.from(doc.images).map((img) => ({{
    src: img.getAttribute("src"), complete: img.complete,
    width: img.naturalWidth, height: img.naturalHeight}}));
  document.getElementById("report").textContent = JSON.stringify({{
    title: doc.title, images: images,
    sections: doc.querySelectorAll("section").length,
    text: doc.body.innerText}});
}});
</script></body></html>
"""


def find_chromium() -> str:
    """The Chromium binary, or a test failure saying how to install it."""
    candidates = [
        os.environ.get("ACTSTORE_CHROMIUM"),
        "chromium",
        "chromium-browser",
        "google-chrome",
    ]
    for name in candidates:
        if name and (path := shutil.which(name)):
            return path
    pytest.fail(
        "the visuals browser test needs Chromium: install Debian's package with "
        "`apt-get install -y chromium` (.ci/run does) or set ACTSTORE_CHROMIUM"
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def browser_report(site: Path, tmp_path: Path, page: str = "index.html") -> dict:
    """Load ``site/page`` in headless Chromium (served on 127.0.0.1) and report, from inside
    the browser, every <img> with its decoded size, the title and the visible text."""
    chromium = find_chromium()
    root = tmp_path / "browser-root"
    root.mkdir()
    (root / "site").symlink_to(site)
    (root / "check.html").write_text(_CHECK_PAGE.format(page=page), encoding="utf-8")
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/check.html"
        proc = subprocess.run(
            [
                chromium,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={tmp_path / 'chromium-profile'}",
                "--virtual-time-budget=10000",
                "--dump-dom",
                url,
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.shutdown()
        server.server_close()
    match = re.search(r'<pre id="report">(.*?)</pre>', proc.stdout, re.DOTALL)
    assert proc.returncode == 0 and match, f"chromium failed: {proc.stderr[-2000:]}"
    assert match.group(1) != "pending", "the page never finished loading"
    return json.loads(html.unescape(match.group(1)))


def assert_page_images_load(site: Path, tmp_path: Path) -> dict:
    """Every image of ``site/index.html`` decodes in the browser at the PNG's own size."""
    report = browser_report(site, tmp_path)
    assert report["images"], "the page shows no images"
    for image in report["images"]:
        assert image["complete"] and image["width"] > 0, f"{image['src']} did not load"
        with Image.open(site / image["src"]) as png:
            assert (image["width"], image["height"]) == png.size
    return report


# ---------------------------------------------------------------------------- the checker


def test_browser_check_catches_a_broken_image(tmp_path):
    """Negative control: the browser check really sees a missing and a corrupt PNG."""
    site = tmp_path / "site"
    site.mkdir()
    Image.new("RGB", (30, 20), "red").save(site / "good.png")
    (site / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    sections = [
        Section(latent=i, stats="", png=name, png_size=(30, 20))
        for i, name in enumerate(["good.png", "missing.png", "corrupt.png"])
    ]
    (site / "index.html").write_text(index_html("t", [], sections), encoding="utf-8")
    report = browser_report(site, tmp_path)
    widths = {img["src"]: img["width"] for img in report["images"]}
    assert widths == {"good.png": 30, "missing.png": 0, "corrupt.png": 0}
    assert report["sections"] == 3 and report["title"] == "t"


# ---------------------------------------------------------------------------- selection


def random_acts(seed=0, n_examples=12, rows_per_example=5, d_sae=9):
    rng = np.random.default_rng(seed)
    dense = rng.random((n_examples * rows_per_example, d_sae)).astype(np.float32)
    dense[dense < 0.75] = 0
    dense[:, 4] = 0  # a latent that never fires
    return dense, SparseActs.from_dense(dense)


@pytest.mark.parametrize("skip", [(), (0,)])
def test_selection_matches_brute_force(skip):
    dense, acts = random_acts()
    rows = TokenRows(rows_per_example=5, first_token=0, n_examples=12, skip_tokens=skip)
    keep = ~np.isin(np.arange(60) % 5, skip)
    totals = dense[keep].sum(0)
    chosen = [s.latent for s in top_latents(acts, rows, 20)]
    want = [int(i) for i in np.argsort(-totals, kind="stable") if totals[i] > 0]
    assert chosen == want and 4 not in chosen
    for latent in want[:3]:
        per_example = np.where(keep, dense[:, latent], 0).reshape(12, 5)
        peaks = per_example.max(1)
        order = [int(e) for e in np.argsort(-peaks, kind="stable") if peaks[e] > 0][:4]
        got = top_examples(acts, latent, rows, 4)
        assert [e.example for e in got] == order
        for e in got:
            assert e.value == per_example[e.example].max()
            assert per_example[e.example, e.token] == e.value
            np.testing.assert_array_equal(
                example_activations(acts, latent, rows, e.example),
                dense[e.example * 5 : e.example * 5 + 5, latent],
            )


# ---------------------------------------------------------------------------- drawing


def test_render_example_tints_active_patches_only():
    image = Image.new("RGB", (40, 40), (128, 128, 128))
    heat = np.zeros(16, dtype=np.float32)
    heat[6] = 2.0  # row 1, column 2 of a 4x4 grid
    heat[9] = 1.0
    tile = np.asarray(render_example(image, heat, scale_max=2.0, size=80, caption="#1"))
    assert tile.shape == (80 + 80 + 2 + 18, 80, 3)
    top, bottom = tile[:80].astype(int), tile[82:162].astype(int)
    assert (top == 128).all()  # the plain view is untouched
    peak, weaker, cold = bottom[30, 50], bottom[50, 30], bottom[10, 10]
    assert tuple(cold) == (128, 128, 128)
    assert peak[0] > weaker[0] > 128 and peak[2] < weaker[2] < 128  # redder where stronger
    assert tuple(bottom[20, 45]) == (255, 230, 0)  # the peak patch is outlined
    with pytest.raises(ConfigError, match="square grid"):
        patch_grid(15)


def test_text_pieces_round_trip_and_html_is_escaped(model_dir):
    text = TokenText.load(str(model_dir("gpt2")))
    ids = text.tokenizer("def f(x):\n    return x < 3", add_special_tokens=False)["input_ids"]
    pieces = text.pieces(ids)
    assert "".join(pieces) == "def f(x):⏎    return x < 3"
    context = Context(
        example=3,
        peak_token=11,
        pieces=["<script>", "a&b", " ok"],
        values=np.array([0.0, 2.0, 1.0]),
        start=10,
    )
    markup = context_html(context, scale_max=2.0)
    assert "<script>" not in markup and "&lt;script&gt;" in markup and "a&amp;b" in markup
    assert '<span class="peak" style="background:rgba(255,140,0,1.00)"' in markup
    assert "rgba(255,140,0,0.50)" in markup and "rgba(255,140,0,0.00)" in markup
    png = render_contexts([context], scale_max=2.0, width=300)
    assert png.width == 300 and png.height > 20
    # without a tokenizer, token ids are shown instead of failing
    assert TokenText(None).pieces([5, 7]) == ["<5>", "<7>"]


def test_visuals_need_inference_first(tmp_path):
    train = write_store(tmp_path / "scratch", seed=0, dataset=str(tmp_path))
    val = write_store(tmp_path / "scratch", seed=1, dataset=str(tmp_path))
    run = Run.create(train_shards=train, val_shards=val, run_id="r", root=tmp_path / "runs")
    with pytest.raises(StoreNotFoundError, match="no inference for .*actstore inference --run"):
        render_run(run, "val", progress=False)
