"""``ondeck generate --server URL``: the job runs on a server; the output folder is the
one a local run writes (report.json, timeline.png, then video.mp4 or image.png)."""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import OndeckError
from ..output import atomic_path, check_writable_folder, holding_folder, write_json

OUTPUT_NAMES = ("report.json", "timeline.png", "video.mp4", "image.png")


class ServerError(OndeckError):
    """The server refused the job or the job failed there."""


def _check(response: Any) -> Any:
    """``response``, or the server's error: a shape the model cannot take as the usage
    error a local run gives it (the flag named, exit 2), anything else a ``ServerError``."""
    from ..cli.commands import FLAGS  # the flag of each argument a refusal names first
    from ..cli.options import UsageError

    if response.status_code < 400:
        return response
    try:
        error = response.json()["error"]
        text = str(error.get("message"))
        message = f"{text} ({error.get('code')}, HTTP {response.status_code})"
    except (ValueError, KeyError, TypeError, AttributeError):
        message = f"HTTP {response.status_code}: {response.text[:200]}"
    else:
        argument, _, problem = text.partition(": ")
        if response.status_code == 400 and argument in FLAGS and problem:
            raise UsageError(f"argument {FLAGS[argument]}: {problem}")
    raise ServerError(f"the server says: {message}")


def _write_bytes(path: Path, data: bytes) -> Path:
    with atomic_path(path) as temporary:
        temporary.write_bytes(data)
    return path


# What a local run offers that a server's job does not take: the server loads its
# models as it was started, so the flags that choose weights, memory and devices are
# refused rather than dropped.
LOCAL_ONLY = {
    "--images": "images", "--fps": "fps", "--image": "image", "--lora": "lora",
    "--transformer": "transformer", "--component": "component", "--weights": "weights",
    "--budget": "budget", "--device": "device", "--dtype": "dtype",
    "--host-cache": "host_cache", "--host-memory": "host_memory", "--shard": "shard",
    "--context-parallel": "context_parallel", "--parallel": "parallel",
    "--library": "library", "--no-prefetch": "no_prefetch", "--true-cfg": "true_cfg",
}  # fmt: skip


def generate_remote(args: argparse.Namespace) -> int:
    """The run as a job on a server, its files written as a local run writes them, the
    output folder held meanwhile."""
    from ..cli.options import UsageError

    given = [
        flag
        for flag, name in LOCAL_ONLY.items()
        if getattr(args, name, None) not in (None, [], False)
    ]
    given += ["--runs"] if getattr(args, "runs", 1) != 1 else []
    given += ["--policy"] if getattr(args, "policy", "auto") != "auto" else []
    if given:
        raise UsageError(f"{', '.join(given)} cannot be used with --server; run locally instead")
    out = Path(args.output)
    check_writable_folder(out, OUTPUT_NAMES)
    with holding_folder(out):
        return _generate_remote(args, out)


def _generate_remote(args: argparse.Namespace, out: Path) -> int:
    import httpx

    from ..cli.options import UsageError

    base = args.server.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    key = getattr(args, "api_key", None) or os.environ.get("ONDECK_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(
        base_url=base, headers=headers, timeout=httpx.Timeout(30.0, read=None)
    ) as http:
        try:
            models = _check(http.get("/models")).json()["data"]
        except httpx.HTTPError as error:
            raise ServerError(f"cannot reach {args.server}: {error}") from None
        names = {m["id"]: m for m in models}
        name = args.model_dir
        if name is None:
            if len(names) != 1:
                raise ServerError(f"name the model to run; the server serves {sorted(names)}")
            name = next(iter(names))
        if name not in names:
            raise ServerError(f"the server does not serve {name!r}; it serves {sorted(names)}")
        body: dict[str, Any] = {
            "model": name,
            "prompt": args.prompt,
            "negative_prompt": args.negative_prompt,
            "seed": args.seed,
        }
        if args.steps is not None:
            body["steps"] = args.steps
        if args.guidance is not None:  # else the model's own, as a local run takes it
            body["guidance_scale"] = args.guidance
        if args.height is not None and args.width is not None:
            body["size"] = f"{args.width}x{args.height}"
        elif args.height is not None or args.width is not None:  # the other is the model's
            body.update({"height": args.height, "width": args.width})
        if names[name].get("kind") == "image":
            if args.frames is not None:  # as a local run refuses it
                raise UsageError(f"argument --frames: {name} makes images, not a video")
            job = _check(http.post("/images/generations", json=body)).json()
            job_id = job["ondeck_job"]
            media = {"image.png": base64.b64decode(job["data"][0]["b64_json"])}
        else:
            if args.frames is not None:
                body["frames"] = args.frames
            video = _check(http.post("/videos", json=body)).json()
            job_id = video["id"]
            try:
                video = _wait(http, job_id)
            except ServerError:  # the job failed there: nothing to stop
                raise
            except BaseException:  # Ctrl-C, or a lost connection: the job is not wanted
                _cancel(http, job_id)
                raise
            media = {"video.mp4": _check(http.get(f"/videos/{job_id}/content")).content}
        report = _check(http.get(f"/ondeck/jobs/{job_id}/report")).json()
        timeline = _check(http.get(f"/ondeck/jobs/{job_id}/timeline")).content
    report["server"] = args.server
    report["job_id"] = job_id
    written = [
        write_json(out / "report.json", report),
        _write_bytes(out / "timeline.png", timeline),
    ]
    for filename, data in media.items():
        written.append(_write_bytes(out / filename, data))
    print(
        f"ondeck: wrote {', '.join(str(p) for p in reversed(written))} (job {job_id} on {args.server})"
    )
    return 0


def _cancel(http: Any, job_id: str) -> None:
    """Ask the server to stop a job this client no longer waits for (best effort: the
    server may be gone, and the caller raises its own error)."""
    try:
        http.delete(f"/ondeck/jobs/{job_id}", timeout=5.0)
    except Exception:
        pass


def _wait(http: Any, job_id: str) -> dict:
    shown = -1
    while True:
        video = _check(http.get(f"/videos/{job_id}")).json()
        if video["progress"] != shown and os.environ.get("ONDECK_PROGRESS") != "0":
            shown = video["progress"]
            print(f"ondeck: {job_id} {video['status']} {shown}%", file=sys.stderr, flush=True)
        if video["status"] == "completed":
            return video
        if video["status"] == "failed":
            error = video.get("error") or {}
            raise ServerError(
                f"the job failed on the server: {error.get('message')} ({error.get('code')})"
            )
        time.sleep(0.2)


__all__ = ["generate_remote"]
