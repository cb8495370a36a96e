"""What a request may ask for (``Limits``) and the values a field takes: a larger ask or a
value out of range is a 400 naming the field, before anything is queued or loaded."""

from __future__ import annotations

import pytest

from .inprocess import call, make_server

IMAGES, VIDEOS = "/v1/images/generations", "/v1/videos"
IMAGE = {"model": "sd3", "prompt": "a fox", "size": "32x32"}
VIDEO = {"model": "wan", "prompt": "a fox", "size": "32x32", "frames": 5}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    served = make_server(models, tmp_path_factory.mktemp("limits"), names=("wan", "sd3"))
    yield served
    served.stop()


@pytest.mark.parametrize(
    ("route", "body", "param", "says"),
    [
        (IMAGES, {**IMAGE, "size": "4096x4096"}, "size", "from 1 to 2048 pixels, got 4096x4096"),
        (VIDEOS, {**VIDEO, "size": "2049x32"}, "size", "from 1 to 2048 pixels"),
        (IMAGES, {**IMAGE, "steps": 201}, "steps", "steps must be at most 200"),
        (VIDEOS, {**VIDEO, "steps": 201}, "steps", "steps must be at most 200"),
        (IMAGES, {**IMAGE, "n": 5}, "n", "n must be at most 4"),
        (VIDEOS, {**VIDEO, "frames": 242}, "frames", "frames must be at most 241"),
        (VIDEOS, {**VIDEO, "frames": None, "seconds": "abc"}, "seconds", "not a number"),
        (IMAGES, {**IMAGE, "response_format": "url"}, "response_format", "b64_json"),
        (IMAGES, {**IMAGE, "seed": 2**64}, "seed", "less than or equal to"),
        (IMAGES, {**IMAGE, "prompt": ""}, "prompt", "at least 1 character"),
        (
            VIDEOS,
            {**VIDEO, "input_reference": {"image_url": "http://host/a;base64,AAAA"}},
            "input_reference",
            "base64 data: URL",
        ),
    ],
)
def test_an_ask_beyond_the_limits_is_a_400_naming_the_field(server, route, body, param, says):
    videos = len(call(server, "GET", VIDEOS).json()["data"])
    response = call(server, "POST", route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_value", param)
    assert says in error["message"]
    assert len(call(server, "GET", VIDEOS).json()["data"]) == videos  # nothing was queued


def test_the_limits_themselves_are_served(server):
    """The most images and the largest seed are taken: the refusals above are of what
    lies beyond a limit, not of everything."""
    body = {**IMAGE, "size": "16x16", "n": 4, "steps": 1, "seed": 2**64 - 1}
    response = call(server, "POST", IMAGES, json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 4
