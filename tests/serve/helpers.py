"""A real ``ondeck serve`` process on a free port, a ``Server`` served by uvicorn on a
thread of the test process, and the tiny model folders they serve."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-0123456789"


def build_models(root: Path) -> dict[str, Path]:
    """Tiny folders: two Wan text-to-video models, an SD3 image model, and a Wan whose
    transformer weights are NaN (its every output is refused)."""
    sys.path.insert(0, str(ROOT / "tests" / "integrations"))
    import tiny_pipelines
    from safetensors.torch import load_file, save_file

    from ondeck.embedded import build_wan_folder

    models = {
        "wan": build_wan_folder(root / "wan", preset="tiny", vivid=True),
        "wan2": build_wan_folder(root / "wan2", preset="tiny", seed=1, vivid=True),
        "broken": build_wan_folder(root / "broken", preset="tiny", seed=2),
    }
    weights = root / "broken" / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = {name: t.fill_(float("nan")) for name, t in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    tiny_pipelines.build_sd3(root / "sd3")
    models["sd3"] = root / "sd3"
    return models


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m ondeck serve ...`` with this checkout on its path."""

    def __init__(
        self, models: dict[str, Path], *args: str, tmp: Path, api_key: str | None = API_KEY
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = tmp / f"server-{self.port}.log"
        command = [
            sys.executable,
            "-m",
            "ondeck",
            "serve",
            "--port",
            str(self.port),
            "--device",
            "cpu",
        ]
        for name, path in models.items():
            command += ["--model", f"{name}={path}"]
        command += ["--outputs", str(tmp / "outputs"), *args]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        env.pop("ONDECK_API_KEY", None)
        if api_key:
            env["ONDECK_API_KEY"] = api_key
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        kwargs.setdefault("timeout", 60)
        return httpx.Client(base_url=self.url, headers=self.headers, **kwargs)

    def _wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited ({self.process.returncode}):\n{self.output()}"
                )
            try:
                if (
                    httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=2).status_code
                    == 200
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not answer in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


class LiveServer:
    """A ``Server`` behind its ASGI app, served by uvicorn on a thread of this process:
    the test reaches into the server (its models, its ``submit``) while a client calls
    it over HTTP."""

    def __init__(self, server):
        import uvicorn

        from ondeck.serve.app import create_app

        self.server = server
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(server), host="127.0.0.1", port=self.port, log_level="warning",
            lifespan="off",
        )  # fmt: skip
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.uvicorn.started, 30, 0.02)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.server.stop()


def wait_for(predicate, timeout: float = 60, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"not true within {timeout}s: {predicate}")
