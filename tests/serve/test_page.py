"""The page at ``/`` in a real browser (Debian's chromium through Playwright): submit a
video job, watch it finish, see the video and its memory timeline, cancel another."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("ONDECK_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("no Playwright: `make test-ui` installs it and Debian's chromium")
    if not Path(CHROMIUM).is_file():
        pytest.skip(
            f"no chromium at {CHROMIUM}: `make test-ui` installs it (apt-get install chromium)"
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield browser
        browser.close()


def test_the_page_runs_a_video_job_and_shows_it_with_its_timeline(browser, server, tmp_path):
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(server.url + "/")
    page.fill("#key", server.api_key)
    page.evaluate("loadModels()")  # the list needs the key, typed after the page loaded
    page.wait_for_selector("#model option[value=wan]", state="attached")
    page.select_option("#model", "wan")
    page.fill("#size", "32x32")
    page.fill("#seconds", "0.25")
    page.fill("#steps", "2")
    page.click("#go")
    page.wait_for_selector(".job video[src^='blob:']", timeout=60_000)
    page.wait_for_selector(".job img.timeline[src^='blob:']", timeout=30_000)
    page.wait_for_function("document.querySelector('.job img.timeline').naturalWidth > 0")
    assert "completed" in page.inner_text(".job .state")
    shot = Path(os.environ.get("ONDECK_UI_SCREENSHOTS", tmp_path)) / "page-video-done.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 0
    assert errors == []


def test_the_page_cancels_a_running_job(browser, server):
    page = browser.new_page()
    page.goto(server.url + "/")
    page.fill("#key", server.api_key)
    page.evaluate("loadModels()")
    page.wait_for_selector("#model option[value=wan2]", state="attached")
    page.select_option("#model", "wan2")
    page.fill("#size", "32x32")
    page.fill("#seconds", "0.25")
    page.fill("#steps", "200")
    page.click("#go")
    page.wait_for_function(
        "(document.querySelector('.job .state') || {}).textContent?.includes('step')",
        timeout=60_000,
    )
    page.click(".job .cancel")
    page.wait_for_selector(".job .error", timeout=30_000)
    assert "cancelled" in page.inner_text(".job .error")
