"""Bodies a real `ondeck serve` process answers in OpenAI's error shape with the right
status: too large without a declared length, nested too deep, and an image given as a
form's text field."""

from __future__ import annotations

import pytest

from .helpers import ServerProcess


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    process = ServerProcess(
        {"wan": models["wan"]},
        "--steps",
        "2",
        "--max-body",
        "64KiB",
        tmp=tmp_path_factory.mktemp("serve-http"),
    )
    yield process
    process.stop()


def _chunks(total: int, size: int = 8192):
    for _ in range(total // size):
        yield b" " * size


def test_a_body_over_the_limit_sent_without_a_length_is_a_413(server):
    """A client that streams its body (Transfer-Encoding: chunked, no Content-Length)
    past --max-body gets the 413 request_too_large a declared length gets, not a
    text/plain 500 from the framework's own error handler."""
    with server.client() as http:
        response = http.post(
            "/v1/videos", content=_chunks(256 * 1024), headers={"content-type": "application/json"}
        )
    assert response.status_code == 413, (response.status_code, response.text[:200])
    assert response.json()["error"]["code"] == "request_too_large"


def test_json_nested_deeper_than_python_parses_is_a_400(server):
    """A small body of deeply nested JSON ("[[[[...]]]]", 40 KB, within --max-body), on
    which Python's parser gives up (RecursionError), is invalid_json like any body that
    is not JSON."""
    depth = 20000
    with server.client() as http:
        response = http.post(
            "/v1/videos",
            content=b"[" * depth + b"]" * depth,
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 400, (response.status_code, response.text[:200])
    assert response.json()["error"]["code"] == "invalid_json"


def test_an_input_reference_sent_as_a_form_text_field_is_taken_as_in_json(server):
    """In the multipart form, input_reference given as a text field (a data: URL, as the
    JSON body takes it) is the input image, as in JSON: for a model that takes no image
    both are refused 400 (the form's used to be dropped without a word)."""
    pixel = (
        "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4"
        "z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg=="
    )
    fields = {"model": "wan", "prompt": "a fox", "size": "32x32", "frames": "5"}
    with server.client() as http:
        as_json = http.post(
            "/v1/videos", json={**fields, "frames": 5, "input_reference": {"image_url": pixel}}
        )
        as_form = http.post(
            "/v1/videos", data={**fields, "input_reference": pixel}, files={"unused": ("", b"")}
        )
    assert as_json.status_code == 400
    assert as_form.status_code == 400, as_form.text


@pytest.mark.parametrize(
    ("body", "status", "code", "param", "says"),
    [
        ([{"model": "wan"}], 400, "invalid_json", None, "a JSON list, not an object"),
        (
            {"model": "wan", "prompt": "a", "size": "32x32", "height": 32},
            400,
            "invalid_value",
            "size",
            "give size, or height and width, not both",
        ),
        (
            {"model": "wan", "prompt": "a", "negative_prompt": "n" * 5000},
            413,
            "prompt_too_long",
            "negative_prompt",
            "at most 4000 characters",
        ),
    ],
)
def test_a_refused_body_names_the_field_it_is_refused_for(server, body, status, code, param, says):
    with server.client() as http:
        response = http.post("/v1/videos", json=body)
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (status, code, param)
    assert says in error["message"]
