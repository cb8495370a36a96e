"""A request's fields as OpenAI's clients send them: a null is the field's default (what
many clients send for a field the caller left unset), and a seed is any that a local
run takes."""

from __future__ import annotations

from .inprocess import call, make_server


def test_an_image_request_with_null_n_and_response_format_is_served(models, tmp_path):
    server = make_server(models, tmp_path, names=("sd3",))
    try:
        response = call(
            server,
            "POST",
            "/v1/images/generations",
            json={
                "model": "sd3",
                "prompt": "a fox",
                "size": "32x32",
                "n": None,
                "response_format": None,
                "quality": None,
                "style": None,
                "user": None,
            },
        )
    finally:
        server.stop()
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 1


def test_an_image_request_with_null_seed_and_negative_prompt_is_served(models, tmp_path):
    server = make_server(models, tmp_path, names=("sd3",))
    try:
        response = call(
            server,
            "POST",
            "/v1/images/generations",
            json={
                "model": "sd3",
                "prompt": "a fox",
                "size": "32x32",
                "seed": None,
                "negative_prompt": None,
            },
        )
    finally:
        server.stop()
    assert response.status_code == 200, response.text


def test_a_video_request_with_null_optional_fields_is_queued(models, tmp_path):
    server = make_server(models, tmp_path, names=("wan",))
    try:
        response = call(
            server,
            "POST",
            "/v1/videos",
            json={
                "model": "wan",
                "prompt": "a fox",
                "size": "32x32",
                "frames": 5,
                "seconds": None,
                "seed": None,
                "negative_prompt": None,
                "input_reference": None,
            },
        )
    finally:
        server.stop()
    assert response.status_code == 200, response.text
    assert response.json()["seconds"] == "0.25"  # 5 frames at Wan's 16 a second


def test_the_largest_seed_makes_every_image_of_the_request(models, tmp_path):
    """2**64 - 1, the largest seed torch takes (and `ondeck generate --seed` takes): the
    next image's seed goes round to 0."""
    server = make_server(models, tmp_path, names=("sd3",))
    try:
        response = call(
            server,
            "POST",
            "/v1/images/generations",
            json={"model": "sd3", "prompt": "a fox", "size": "32x32", "n": 2, "seed": 2**64 - 1},
        )
    finally:
        server.stop()
    assert response.status_code == 200, response.text
    first, second = (image["b64_json"] for image in response.json()["data"])
    assert first != second
