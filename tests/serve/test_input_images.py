"""A video request's input image: upright as its camera tagged it, refused as too large
(413) past the pixel limits, and taken as a form's data: URL up to the image limit."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from ondeck.serve.server import Limits, ServeConfig, Server

from .inprocess import call


@pytest.fixture
def server(models, tmp_path):
    """A served Wan taking an input image, its queue not started: jobs wait, and the
    test reads what they would run with."""

    def make(**limits):
        config = ServeConfig(
            models={"wan": str(models["wan"])},
            device="cpu",
            budget_bytes=2**30,
            outputs=tmp_path / "outputs",
            limits=Limits(**limits),
        )
        made = Server(config, say=lambda *_: None)
        made.models["wan"].takes_image = True
        servers.append(made)
        return made

    servers: list[Server] = []
    yield make
    for made in servers:
        for model in made.models.values():
            model.pipeline.close()


FIELDS = {"model": "wan", "prompt": "a fox", "size": "32x32", "frames": "5"}


def png(width: int, height: int, orientation: int | None = None, noise: bool = False) -> bytes:
    image = Image.new("RGB", (width, height), (200, 30, 30))
    if noise:
        image = Image.frombytes(
            "RGB", (width, height), bytes(range(256)) * (width * height * 3 // 256 + 1)
        )
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    out = io.BytesIO()
    image.save(out, format="PNG", exif=exif.tobytes())
    return out.getvalue()


def video(server: Server, image: bytes, as_form: bool = False):
    url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    if as_form:
        return call(
            server,
            "POST",
            "/v1/videos",
            data={**FIELDS, "input_reference": url},
            files={"unused": ("", b"")},
        )
    body = {**FIELDS, "frames": 5, "input_reference": {"image_url": url}}
    return call(server, "POST", "/v1/videos", json=body)


def test_an_input_photo_is_turned_upright_by_its_orientation_tag(server):
    served = server()
    answer = video(served, png(6, 2, orientation=6))  # stored sideways, shown turned 90°
    assert answer.status_code == 200, answer.text
    job = served.queue.jobs[answer.json()["id"]]
    assert job.input_image.size == (2, 6)


def test_an_image_past_pillows_own_pixel_limit_is_too_large_not_unreadable(server, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50)  # a bomb: more than twice this
    answer = video(server(image_pixels=10**6), png(20, 20))
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["code"] == "image_too_large"


def test_a_form_data_url_is_taken_up_to_the_image_limit(server):
    """Base64 is 4/3 of the image's bytes: an image within the limit, sent as a form's
    text field, is taken as the same image sent in JSON is."""
    image = png(40, 40, noise=True)
    served = server(image_bytes=len(image) + 16)
    assert len(base64.b64encode(image)) > len(image) + 16
    as_json, as_form = video(served, image), video(served, image, as_form=True)
    assert as_json.status_code == 200, as_json.text
    assert as_form.status_code == 200, as_form.text
    too_large = server(image_bytes=len(image) - 1)
    answer = video(too_large, image, as_form=True)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "image_too_large"


def test_the_image_url_form_of_a_form_field_is_taken(server):
    """openai-python sends a video request as a form: ``{"image_url": ...}`` given in its
    extra_body arrives as the field ``input_reference[image_url]``."""
    served = server()
    url = f"data:image/png;base64,{base64.b64encode(png(6, 2)).decode()}"
    answer = call(
        served,
        "POST",
        "/v1/videos",
        data={**FIELDS, "input_reference[image_url]": url},
        files={"unused": ("", b"")},
    )
    assert answer.status_code == 200, answer.text
    assert served.queue.jobs[answer.json()["id"]].input_image.size == (6, 2)


def test_a_model_whose_every_job_would_fail_is_refused_at_start(tmp_path):
    """Wan's image-to-video cleans each prompt with ftfy, which this host lacks: serving
    it is refused at start, naming the model and the package, not a 500 for every job."""
    import importlib.util

    from integrations.breadth_pipelines import ALL_FAMILIES

    from ondeck.errors import OndeckError

    if importlib.util.find_spec("ftfy") is not None:
        pytest.skip("ftfy is installed here")

    folder = tmp_path / "wan_i2v"
    ALL_FAMILIES["wan_i2v"].build(folder)
    config = ServeConfig(
        models={"i2v": str(folder)}, device="cpu", budget_bytes=2**30, outputs=tmp_path / "out"
    )
    with pytest.raises(OndeckError, match=r"model 'i2v' .*ftfy.*pip install ftfy"):
        Server(config, say=lambda *_: None)


def test_an_image_past_the_servers_pixel_limit_is_too_large(server):
    """Counted from the header, before the pixels are decoded."""
    answer = video(server(image_pixels=399), png(20, 20))
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["code"] == "image_too_large"
    assert "more than 399 pixels" in answer.json()["error"]["message"]
    assert video(server(image_pixels=400), png(20, 20)).status_code == 200


def test_a_file_under_another_name_is_refused_not_taken_as_the_image(server):
    """A mask (or any file) beside the input image is a 400 naming it: it never replaces
    the image."""
    url = f"data:image/png;base64,{base64.b64encode(png(6, 2)).decode()}"
    answer = call(
        server(),
        "POST",
        "/v1/videos",
        data={**FIELDS, "input_reference": url},
        files=[("mask", ("mask.png", png(4, 4), "image/png"))],
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "mask" and "unexpected file field 'mask'" in error["message"]
