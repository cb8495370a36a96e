"""What ``ondeck serve`` checks and says as it starts: a model no request could run is
refused naming it, a ``--steps`` past what a request may ask for is the flag's error, and
the address it listens on is the one bound (``--port 0``'s, an IPv6 host in brackets)."""

from __future__ import annotations

import argparse
import re
import socket
import threading

import pytest

from ondeck.errors import OndeckError
from ondeck.serve.server import Limits, ServeConfig, Server
from tests.cli.helpers import run

from .helpers import wait_for
from .inprocess import call, make_server


def test_an_image_model_that_needs_an_input_image_is_refused_at_start(tmp_path):
    """A ControlNet's every call needs its control image, which the images route takes
    none of: serving it is refused, naming the model and why, not a 400 for every job."""
    from tests.integrations.breadth_pipelines import ALL_FAMILIES

    folder = tmp_path / "controlnet"
    ALL_FAMILIES["sd_controlnet"].build(folder)
    config = ServeConfig(
        models={"cn": str(folder)}, device="cpu", budget_bytes=2**30, outputs=tmp_path / "out"
    )
    with pytest.raises(OndeckError) as refused:
        Server(config, say=lambda *_: None)
    message = str(refused.value)
    assert message.startswith("model 'cn' (")
    assert "StableDiffusionControlNetPipeline needs an input image" in message
    assert "images route takes none" in message and "\n" not in message


def test_an_image_model_is_listed_as_taking_no_input_image(models, tmp_path):
    """An image model whose call takes an optional image (Flux Kontext's) is served, but
    no request to it can give one: /v1/models says it takes none."""
    server = make_server(models, tmp_path, names=("sd3", "wan"))
    try:
        server.models["sd3"].takes_image = True  # as Kontext's call takes one
        server.models["wan"].takes_image = True  # image-to-video: input_reference gives it
        listed = call(server, "GET", "/v1/models").json()["data"]
    finally:
        server.stop()
    assert {model["id"]: model["takes_image"] for model in listed} == {"sd3": False, "wan": True}


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
