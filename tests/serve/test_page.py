"""The page at ``/`` in a real browser (Debian's chromium through Playwright): submit a
video job, watch it finish, see the video and its memory timeline; an image job step by
step; cancel."""

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


def open_page(browser, server, errors: list[str]):
    """The page, with the key typed as a person types it: the model list follows."""
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(server.url + "/")
    page.fill("#key", server.api_key)
    page.press("#key", "Tab")
    page.wait_for_selector("#model option[value=wan]", state="attached", timeout=10_000)
    return page


def screenshot(page, tmp_path: Path, name: str) -> Path:
    shot = Path(os.environ.get("ONDECK_UI_SCREENSHOTS", tmp_path)) / name
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 0
    return shot


def test_the_page_runs_a_video_job_and_shows_it_with_its_timeline(browser, server, tmp_path):
    errors: list[str] = []
    page = open_page(browser, server, errors)
    page.select_option("#model", "wan")
    page.fill("#size", "32x32")
    page.fill("#seconds", "0.25")
    page.fill("#steps", "2")
    page.click("#go")
    page.wait_for_selector(".job video[src^='blob:']", timeout=60_000)
    page.wait_for_selector(".job img.timeline[src^='blob:']", timeout=30_000)
    page.wait_for_function("document.querySelector('.job img.timeline').naturalWidth > 0")
    assert "completed" in page.inner_text(".job .state")
    screenshot(page, tmp_path, "page-video-done.png")
    assert errors == []


def test_the_page_shows_an_image_job_step_by_step_and_cancels_it(browser, server, tmp_path):
    errors: list[str] = []
    page = open_page(browser, server, errors)
    page.select_option("#model", "sd3")
    page.fill("#size", "32x32")
    page.fill("#steps", "2")
    page.click("#go")
    page.wait_for_selector(".job img.result[src^='blob:']", timeout=60_000)
    page.wait_for_selector(".job img.timeline[src^='blob:']", timeout=30_000)
    page.fill("#steps", "200")
    page.click("#go")
    # The newest card comes first: the running image job, with its step and a cancel.
    running = page.locator("#jobs .job").first
    page.wait_for_function(
        "/in_progress step [1-9]/.test(document.querySelector('#jobs .job .state').textContent)",
        timeout=60_000,
    )
    assert running.locator(".cancel").is_visible()
    page.wait_for_selector("#queue li progress", timeout=5_000)
    screenshot(page, tmp_path, "page-image-running.png")
    running.locator(".cancel").click()
    running.locator(".error").wait_for(timeout=30_000)
    assert "cancelled" in running.locator(".error").inner_text()
    assert page.locator("#jobs .job").count() == 2
    assert errors == []


def test_the_page_cancels_a_running_job(browser, server):
    page = open_page(browser, server, [])
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


def send_with_image(page, server, picture, route: str):
    """Submit the model chosen with ``picture`` as its input image at 32x32; the job
    queued through ``route``."""
    page.set_input_files("#image", str(picture))
    page.fill("#size", "32x32")
    with page.expect_response(route) as answered:
        page.click("#go")
    response = answered.value
    assert response.status == 200, response.text()
    return server.queue.jobs[response.json()["id"]]


def test_the_page_sends_the_input_image_of_a_model_that_takes_one(browser, models, tmp_path):
    """The image field shows for a video model that takes an image (here the tiny Wan,
    told it does) and not for an image model; the chosen file goes as input_reference.
    The server's queue is not started: the job waits, and the test reads its image."""
    from PIL import Image

    from ondeck.serve.server import ServeConfig, Server

    from .helpers import LiveServer

    names = ("wan", "sd3")
    config = ServeConfig(
        models={name: str(models[name]) for name in names}, device="cpu", steps=2,
        outputs=tmp_path / "outputs",
    )  # fmt: skip
    live = LiveServer(Server(config, say=lambda *_: None))
    live.server.models["wan"].takes_image = True
    picture = tmp_path / "cat.png"
    Image.new("RGB", (6, 2), (200, 30, 30)).save(picture)
    errors: list[str] = []
    try:
        page = browser.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(live.url + "/")
        page.wait_for_selector("#model option[value=sd3]", state="attached", timeout=10_000)
        page.select_option("#model", "sd3")
        assert not page.is_visible("#image")
        page.select_option("#model", "wan")
        assert page.is_visible("#image")
        page.fill("#seconds", "0.25")
        job = send_with_image(page, live.server, picture, "**/v1/videos")
        assert job.input_image is not None and job.input_image.size == (6, 2)
        # An image model whose call takes an image (an edit): its image goes as one.
        live.server.models["sd3"].takes_image = True
        page.reload()
        page.wait_for_selector("#model option[value=sd3]", state="attached", timeout=10_000)
        page.select_option("#model", "wan")
        page.select_option("#model", "sd3")
        assert page.is_visible("#image")
        job = send_with_image(page, live.server, picture, "**/v1/ondeck/images")
        assert job.input_image is not None and job.input_image.size == (6, 2)
        assert errors == []
    finally:
        live.uvicorn.should_exit = True
        live.thread.join(10)
        for model in live.server.models.values():  # never started: nothing else to stop
            model.pipeline.close()
