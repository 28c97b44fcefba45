"""The playground page and /docs in a real headless browser: Debian's chromium, driven by
Playwright, against a real server on 127.0.0.1 serving the bundled demo model.

The page must stream one prompt into both tiers' panes with their figures (TTFT, tokens/s,
tokens, cost) and fill the lanes panel, loading nothing from anywhere but the server. With
EXPRESSLANE_SCREENSHOT=1 the test saves docs/playground.png, which the README shows (elsewhere
the screenshot goes to a temporary folder, so a test run leaves the checkout as it was).
/docs must render Swagger UI from the server's own files. Skipped where chromium or playwright
is missing (`.ci/run` installs both)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from expresslane.demo import TARGET_DIR
from expresslane.server.app import create_app
from expresslane.server.settings import ServerSettings

from .conftest import ServerThread

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "playground.png"
PROMPT = "Write a Python function `fibonacci(n)` that returns the n-th Fibonacci number."

pytestmark = [
    pytest.mark.skipif(
        not Path(CHROMIUM).is_file(),
        reason="no chromium browser: `apt-get install chromium` (.ci/run installs it)",
    ),
    pytest.mark.skipif(
        not (TARGET_DIR / "model.safetensors").is_file(), reason="demo weights not bundled"
    ),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")


@pytest.fixture(scope="module")
def demo_server():
    from expresslane.config import EngineConfig
    from expresslane.engine.async_engine import AsyncEngine
    from expresslane.engine.engine import LLMEngine

    config = EngineConfig(dtype="float32", calibrate=False, num_kv_blocks=512, seed=0)
    engine = AsyncEngine(LLMEngine(config))
    try:
        with ServerThread(create_app(engine, ServerSettings(store_path=":memory:"))) as s:
            yield s
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, demo_server):
    """A page that records every URL it asks for."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.requested = []
    page.on("request", lambda r: page.requested.append(r.url))
    yield page
    context.close()


def _figures(page, index: int) -> dict[str, str]:
    pane = page.locator(f'.pane[data-pane="{index}"]')
    names = ("output", "ttft", "tps", "tokens", "cost", "served", "tier")
    figures = {name: pane.locator("." + name).first for name in names}
    out = {k: v.inner_text() for k, v in figures.items() if k != "tier"}
    out["tier"] = figures["tier"].input_value()
    out["chunks"] = pane.get_attribute("data-chunks")
    return out


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_playground_streams_one_prompt_into_two_tiers(page, demo_server, api, tmp_path):
    page.goto(demo_server.url + "/")
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    page.select_option("#api", api)
    page.fill("#prompt", PROMPT)
    page.click("#send")
    page.wait_for_function(
        "document.querySelector('#status').textContent === 'done'", timeout=120_000
    )
    panes = [_figures(page, i) for i in (0, 1)]
    assert [p["tier"] for p in panes] == ["ultrafast", "flex"]
    for p in panes:
        assert p["output"].strip(), p
        assert int(p["chunks"]) > 1, p  # streamed in pieces, not set at once
        assert re.fullmatch(r"\d+\.\d{3} s", p["ttft"]), p
        assert float(p["tps"]) > 0, p
        assert re.fullmatch(r"\d+ in / \d+ out", p["tokens"]), p
        assert p["cost"].startswith("$"), p
        assert p["served"] == "served by " + p["tier"], p
    # greedy decoding: both tiers write the same text, at their own speed
    assert panes[0]["output"] == panes[1]["output"]
    page.wait_for_function("document.querySelectorAll('#lane-rows tr').length === 3")
    tiers = page.locator("#lane-rows tr td:first-child").all_inner_texts()
    assert tiers == ["ultrafast", "default", "flex"]
    assert re.fullmatch(r"\d+\.\d%", page.inner_text("#kv"))
    assert all(u.startswith(demo_server.url) for u in page.requested), page.requested
    if api == "responses":
        shot = SCREENSHOT if os.environ.get("EXPRESSLANE_SCREENSHOT") else tmp_path / "shot.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000


def test_docs_render_without_a_network(page, demo_server):
    page.goto(demo_server.url + "/docs")
    page.wait_for_selector(".swagger-ui .info .title", timeout=30_000)
    assert "expresslane" in page.inner_text(".swagger-ui .info .title")
    page.get_by_text("/v1/responses", exact=True).first.wait_for(timeout=30_000)
    assert all(u.startswith(demo_server.url) for u in page.requested), page.requested
