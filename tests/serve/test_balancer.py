"""Several servers behind one balancer, on one machine: each names itself in its job ids
(``--instance``), and the balancer's one rule (the README's nginx ``map``) sends a job's
later requests to the server that holds it and any other request to the next server."""

from __future__ import annotations

import itertools
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from .helpers import ServerProcess

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

JOB_IN_PATH = re.compile(r"/(?:video|img)_([A-Za-z0-9.-]+)-[0-9a-f]{32}")
PASSED_HEADERS = ("content-type", "openai-poll-after-ms")


class Balancer:
    """A request naming a job goes to the server in the job's id; any other goes to the
    next server in turn."""

    def __init__(self, servers: dict[str, str]):
        self.servers = servers
        self.sent: list[tuple[str, str, str]] = []
        turns = itertools.cycle(sorted(servers))
        lock = threading.Lock()
        balancer = self

        class Handler(BaseHTTPRequestHandler):
            def forward(self) -> None:
                found = JOB_IN_PATH.search(self.path)
                with lock:
                    name = found.group(1) if found else next(turns)
                balancer.sent.append((self.command, self.path, name))
                length = int(self.headers.get("content-length") or 0)
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("host", "content-length")
                }
                answer = httpx.request(
                    self.command,
                    balancer.servers[name] + self.path,
                    content=self.rfile.read(length),
                    headers=headers,
                    timeout=60,
                )
                self.send_response(answer.status_code)
                for key in PASSED_HEADERS:
                    if key in answer.headers:
                        self.send_header(key, answer.headers[key])
                self.send_header("content-length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = do_DELETE = forward

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_two_servers_behind_a_balancer_each_answer_for_their_own_jobs(models, tmp_path):
    servers = {}
    try:
        for name in ("gpu0", "gpu1"):
            (tmp_path / name).mkdir()
            servers[name] = ServerProcess(
                {"wan": models["wan"]}, "--instance", name, "--steps", "2", tmp=tmp_path / name
            )
        balancer = Balancer({name: server.url for name, server in servers.items()})
        try:
            client = openai.OpenAI(
                base_url=f"{balancer.url}/v1", api_key=servers["gpu0"].api_key, max_retries=0
            )
            videos = [
                client.videos.create(
                    model="wan",
                    prompt="a fox",
                    size="32x32",
                    seconds="0.25",
                    extra_body={"steps": 2},
                )
                for _ in range(2)
            ]
            assert sorted(v.id.split("-")[0] for v in videos) == ["video_gpu0", "video_gpu1"]
            done = [client.videos.poll(v.id, poll_interval_ms=100) for v in videos]
            assert [v.status for v in done] == ["completed", "completed"]
            contents = [client.videos.download_content(v.id).read() for v in videos]
            assert contents[0] == contents[1] and contents[0][4:8] == b"ftyp"
        finally:
            balancer.close()
        for name, server in servers.items():
            state = httpx.get(f"{server.url}/v1/ondeck/status", headers=server.headers).json()
            assert state["jobs_run"] == 1, name  # each ran the job it took, no other
        follow_ups = [(path, name) for method, path, name in balancer.sent if "video_" in path]
        assert follow_ups and all(f"video_{name}-" in path for path, name in follow_ups)
    finally:
        for server in servers.values():
            assert server.stop() == 0, server.output()
