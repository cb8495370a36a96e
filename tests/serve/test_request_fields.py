"""A request's fields as OpenAI's clients send them: a null is the field's default (what
many clients send for a field the caller left unset), and a seed is any that a local
run takes."""

from __future__ import annotations

import base64

from .inprocess import call, make_server

IMAGES = "/v1/images/generations"


def post(models, tmp_path, model, route, body):
    """``body`` posted to ``route`` of a server of ``model`` alone; its response."""
    server = make_server(models, tmp_path, names=(model,))
    try:
        return call(server, "POST", route, json={"model": model, "prompt": "a fox", **body})
    finally:
        server.stop()


def test_an_image_request_with_null_n_and_response_format_is_served(models, tmp_path):
    nulls = dict.fromkeys(("n", "response_format", "quality", "style", "user"))
    response = post(models, tmp_path, "sd3", IMAGES, {"size": "32x32", **nulls})
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 1


def test_an_image_request_with_null_seed_and_negative_prompt_is_served(models, tmp_path):
    nulls = dict.fromkeys(("seed", "negative_prompt"))
    response = post(models, tmp_path, "sd3", IMAGES, {"size": "32x32", **nulls})
    assert response.status_code == 200, response.text


def test_a_video_request_with_null_optional_fields_is_queued(models, tmp_path):
    nulls = dict.fromkeys(("seconds", "seed", "negative_prompt", "input_reference"))
    response = post(models, tmp_path, "wan", "/v1/videos", {"size": "32x32", "frames": 5, **nulls})
    assert response.status_code == 200, response.text
    assert response.json()["seconds"] == "0.25"  # 5 frames at Wan's 16 a second


def test_the_largest_seed_makes_every_image_of_the_request(models, tmp_path):
    """2**64 - 1, the largest seed torch takes (and `ondeck generate --seed` takes): the
    next image's seed goes round to 0."""
    body = {"size": "32x32", "n": 2, "seed": 2**64 - 1}
    response = post(models, tmp_path, "sd3", IMAGES, body)
    assert response.status_code == 200, response.text
    first, second = (image["b64_json"] for image in response.json()["data"])
    assert first != second


def test_a_video_field_in_an_image_request_is_refused(models, tmp_path):
    """As ``ondeck generate --frames`` is for an image model: not ignored."""
    for field, value in (("frames", 5), ("seconds", "2")):
        response = post(models, tmp_path, "sd3", IMAGES, {"size": "32x32", field: value})
        assert response.status_code == 400, response.text
        assert f"{field} is a video request's field" in response.json()["error"]["message"]


def test_an_output_format_other_than_png_is_refused_naming_the_field(models, tmp_path):
    """ondeck writes PNG: a request for JPEG is a 400, not PNG bytes it did not ask for."""
    response = post(models, tmp_path, "sd3", IMAGES, {"size": "32x32", "output_format": "jpeg"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "output_format" and "must be png" in error["message"]


def test_a_boolean_for_a_number_field_is_refused(models, tmp_path):
    """pydantic would take true as 1: a boolean where a number goes is a 400."""
    for route, model, field in (
        (IMAGES, "sd3", "n"),
        (IMAGES, "sd3", "seed"),
        (IMAGES, "sd3", "guidance_scale"),
        ("/v1/videos", "wan", "frames"),
        ("/v1/videos", "wan", "steps"),
        ("/v1/videos", "wan", "seconds"),
    ):
        response = post(models, tmp_path, model, route, {"size": "32x32", field: True})
        assert response.status_code == 400, (field, response.text)
        error = response.json()["error"]
        assert error["param"] == field and "not true" in error["message"], error


def test_an_image_edit_model_makes_the_size_asked(tmp_path):
    """Flux Kontext makes a megapixel (its max_area) at the shape of the size it is
    given unless the area is passed too: a request's size is its output's. The call a
    queued job would make is read first (a megapixel would take minutes here), then the
    job runs."""
    import io

    from PIL import Image

    from ondeck.serve.server import ServeConfig, Server, asked_beyond_defaults
    from tests.integrations.breadth_pipelines import ALL_FAMILIES

    ALL_FAMILIES["flux_kontext"].build(tmp_path / "kontext")
    waiting = Server(
        ServeConfig(models={"kontext": str(tmp_path / "kontext")}, device="cpu", steps=2),
        say=lambda *_: None,
    )
    body = {"model": "kontext", "prompt": "a fox", "size": "32x16"}
    queued = call(waiting, "POST", "/v1/ondeck/images", json=body)
    job = waiting.queue.jobs[queued.json()["id"]]
    assert asked_beyond_defaults(job, waiting.models["kontext"])["max_area"] == 32 * 16
    waiting.models["kontext"].pipeline.close()  # never started: nothing else to stop
    server = make_server({"kontext": tmp_path / "kontext"}, tmp_path, names=("kontext",))
    try:
        response = call(server, "POST", IMAGES, json=body)
    finally:
        server.stop()
    assert response.status_code == 200, response.text
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == (32, 16)


def test_a_model_whose_own_size_it_cannot_take_says_the_size_was_its_own(models, tmp_path):
    """The tiny Wan's call defaults to 480x832, past its 32 rotary positions a side: a
    request that named no size is told the size was the model's own."""
    response = post(models, tmp_path, "wan", "/v1/videos", {"frames": 5})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "too large" in message and message.endswith("(wan's own size: ask for another)")
    named = post(models, tmp_path, "wan", "/v1/videos", {"frames": 5, "size": "832x480"})
    assert named.status_code == 400 and "own size" not in named.json()["error"]["message"]


def test_a_frame_count_refused_is_not_said_to_be_the_models_own_size(models, tmp_path):
    import dataclasses

    server = make_server(models, tmp_path, names=("wan",))
    try:
        model = server.models["wan"]
        model.own_shape = dataclasses.replace(model.own_shape, height=32, width=32)
        body = {"model": "wan", "prompt": "a fox", "frames": 8}
        response = call(server, "POST", "/v1/videos", json=body)
    finally:
        server.stop()
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "4k+1" in message and "own size" not in message
