"""What ``ondeck serve`` checks and says as it starts: a model no request could run is
refused naming it, a ``--steps`` past what a request may ask for is the flag's error, and
the address it listens on is the one bound (``--port 0``'s, an IPv6 host in brackets)."""

from __future__ import annotations

import argparse
import base64
import io
import re
import socket
import threading

import pytest
from PIL import Image

from ondeck.errors import OndeckError
from ondeck.serve.server import Limits, ServeConfig, Server
from tests.cli.helpers import run

from .helpers import LiveServer, wait_for
from .inprocess import call, make_server
from .test_input_images import png


def test_an_image_model_that_needs_an_input_image_takes_it_as_an_edit(tmp_path):
    """A ControlNet's every call needs its control image: /v1/images/edits gives it (as
    openai-python's ``images.edit`` sends it), and /v1/images/generations, which takes
    none, says where to send it instead of running a job that would fail."""
    import openai

    from tests.integrations.breadth_pipelines import ALL_FAMILIES

    folder = tmp_path / "controlnet"
    ALL_FAMILIES["sd_controlnet"].build(folder)
    live = LiveServer(make_server({"cn": folder}, tmp_path, names=("cn",), budget_bytes=2**30))
    server = live.server
    fields = {"model": "cn", "prompt": "a fox", "size": "32x32", "steps": "1"}
    try:
        listed = call(server, "GET", "/v1/models").json()["data"]
        refused = call(server, "POST", "/v1/images/generations", json=fields)
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        edit = client.images.edit(
            model="cn", image=("edge.png", png(40, 24), "image/png"), prompt="a fox",
            size="32x32", extra_body={"steps": 1},
        )  # fmt: skip
        without = call(server, "POST", "/v1/images/edits", data=fields)
        kept = server.queue.get(edit.ondeck_job)
    finally:
        live.stop()
    assert listed[0]["takes_image"] is True
    assert refused.status_code == 400 and "/v1/images/edits" in refused.text
    (image,) = edit.data
    assert Image.open(io.BytesIO(base64.b64decode(image.b64_json))).size == (32, 32)
    assert kept.status == "completed"
    assert without.status_code == 400 and without.json()["error"]["param"] == "image"


def test_an_edit_of_a_model_that_takes_no_image_is_refused(models, tmp_path):
    server = make_server(models, tmp_path, names=("sd3",))
    fields = {"model": "sd3", "prompt": "a fox", "size": "32x32"}
    try:
        listed = call(server, "GET", "/v1/models").json()["data"]
        edit = call(
            server, "POST", "/v1/images/edits", data=fields,
            files={"image": ("a.png", png(8, 8), "image/png")},
        )  # fmt: skip
        masked = call(server, "POST", "/v1/images/edits", data={**fields, "mask": "x"})
    finally:
        server.stop()
    assert listed[0]["takes_image"] is False
    assert edit.status_code == 400 and "takes no input image" in edit.text
    assert masked.status_code == 400 and masked.json()["error"]["param"] == "mask"
    assert not server.queue.jobs


def test_steps_past_a_requests_limit_are_refused_at_start(capsys, models, tmp_path):
    """Every request naming no steps would be refused with them: the flag is the error."""
    base = ["serve", "--model", f"sd3={models['sd3']}", "--device", "cpu", "--plan"]
    code, _, err = run(capsys, *base, "--steps", str(Limits.steps + 1))
    assert code == 2, err
    assert f"argument --steps: at most {Limits.steps}" in err
    code, _, err = run(capsys, *base, "--steps", str(Limits.steps))
    assert code == 0, err
    config = ServeConfig(models={}, device="cpu", steps=Limits.steps + 1, outputs=tmp_path)
    with pytest.raises(OndeckError, match=f"steps must be from 1 to {Limits.steps}"):
        Server(config, say=lambda *_: None)


class _Stub:
    """What the listener reads of a server: its shutdown grace."""

    class config:
        shutdown_grace_seconds = 0.0


async def _app(scope, receive, send):  # never called: the test only starts listening
    raise AssertionError("no request is made")


def listening_port(capsys, host: str) -> tuple[int, int]:
    """The port ``ondeck serve``'s listener says it listens on, started on ``host`` port 0,
    and the port its socket is bound to; fails where the line does not write ``host`` as
    a URL does."""
    import uvicorn

    from ondeck.serve.cli import _listener

    listener = _listener(uvicorn, _Stub, _app, argparse.Namespace(host=host, port=0))
    thread = threading.Thread(target=listener.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: listener.started, 30, 0.02)
        (bound,) = {s.getsockname()[1] for each in listener.servers for s in each.sockets}
    finally:
        listener.should_exit = True
        thread.join(10)
    shown = f"[{host}]" if ":" in host else host
    said = re.findall(rf"^ondeck: listening on http://{re.escape(shown)}:([0-9]+)/$",
                      capsys.readouterr().out, flags=re.M)  # fmt: skip
    assert len(said) == 1, said
    return int(said[0]), bound


def test_port_0_says_the_port_bound(capsys):
    said, bound = listening_port(capsys, "127.0.0.1")
    assert said == bound != 0


def test_an_ipv6_host_is_said_in_brackets(capsys):
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("this host cannot listen on ::1")
    said, bound = listening_port(capsys, "::1")
    assert said == bound != 0
