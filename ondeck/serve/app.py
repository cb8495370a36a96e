"""The HTTP app: OpenAI's images and videos routes, ondeck's status, and the page."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import logging
import secrets
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .jobs import Job, JobFailed, QueueFull, new_job_id
from .schemas import ImageRequest, VideoRequest, parse_size
from .server import Server, seconds_of

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}
# Paths served without the key: the page carries no data and asks for the key itself.
OPEN_PATHS = ("/", "/favicon.ico")
# How long DELETE /v1/videos/{id} waits for a running job to stop at its next step.
DELETE_WAIT_SECONDS = 30.0


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int, message: str, code: str | None, param: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status)


def failure_response(error: JobFailed) -> JSONResponse:
    return error_response(error.status, error.message, error.code, error.param)


class GuardMiddleware:
    """Refuses a request before any route sees it: without the API key (401), or with
    a body over the limit (413), whether the length is declared or not."""

    def __init__(self, app: Any, *, api_key: str | None, body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.body_bytes = body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), self.api_key.encode()):
                message = (
                    "missing API key: send Authorization: Bearer KEY"
                    if not given
                    else "incorrect API key"
                )
                await error_response(401, message, "invalid_api_key")(scope, receive, send)
                return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.body_bytes:
            await self._too_large(scope, receive, send)
            return
        seen = 0
        limit = self.body_bytes

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except BodyTooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        response = error_response(
            413, f"the request body is larger than {self.body_bytes} bytes", "request_too_large"
        )
        await response(scope, receive, send)


class BodyTooLarge(Exception):
    pass


def create_app(server: Server) -> Any:
    """The ASGI app over ``server``: the FastAPI routes behind the key and size guard."""
    limits = server.config.limits
    app = FastAPI(title="ondeck serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    api = _Api(server)
    for add in (_error_handlers, _model_routes, _image_routes, _video_routes, _ondeck_routes):
        add(app, server, api)
    return GuardMiddleware(app, api_key=server.config.api_key, body_bytes=limits.body_bytes)


class _Api:
    """What the routes share: the model and job objects they answer with, a request's
    checks, and submitting a job."""

    def __init__(self, server: Server):
        self.server = server
        self.limits = server.config.limits

    def model_object(self, name: str) -> dict:
        model = self.server.models[name]
        return {
            "id": name,
            "object": "model",
            "created": int(self.server.started_at),
            "owned_by": "ondeck",
            "kind": model.kind,
            # A video's input_reference, an image model's /v1/images/edits.
            "takes_image": model.takes_image,
            **({"fps": model.fps} if model.kind == "video" else {}),
        }

    def served_model(self, name: str, kind: str) -> Any:
        model = self.server.models.get(name)
        if model is None:
            served = ", ".join(sorted(self.server.models))
            raise JobFailed(
                404,
                "model_not_found",
                f"the model {name!r} is not served here (served: {served})",
                "model",
            )
        if model.kind != kind:
            route = "/v1/images/generations" if model.kind == "image" else "/v1/videos"
            article = "an" if model.kind == "image" else "a"
            raise JobFailed(
                400,
                "invalid_value",
                f"{name!r} is {article} {model.kind} model; use {route}",
                "model",
            )
        return model

    def job_from(
        self, body: ImageRequest | VideoRequest, kind: str, image: bytes | None = None
    ) -> Job:
        """The job a request asks for, checked; ``image``: its input image's bytes (a
        video's ``input_reference``, an image edit's ``image``), opened once all else is
        checked."""
        model = self.served_model(body.model, kind)
        _check_image(body.model, model, kind, image)
        for field in ("prompt", "negative_prompt"):
            if len(getattr(body, field)) > self.limits.prompt_chars:
                raise JobFailed(
                    413,
                    "prompt_too_long",
                    f"a prompt may hold at most {self.limits.prompt_chars} characters",
                    field,
                )
        own = model.own_shape  # what a local run of the model asks where no flag says
        if body.size and (body.height is not None or body.width is not None):
            raise JobFailed(
                400, "invalid_value", "give size, or height and width, not both", "size"
            )
        if body.size:
            width, height = parse_size(body.size)
        else:
            width = own.width if body.width is None else body.width
            height = own.height if body.height is None else body.height
        if any(side is not None and not 0 < side <= self.limits.side for side in (width, height)):
            named = body.size or (body.width is not None and body.height is not None)
            given = "" if named else f", {body.model}'s own size: ask for a smaller one"
            raise JobFailed(
                400,
                "invalid_value",
                f"each side must be from 1 to {self.limits.side} pixels, got "
                f"{width}x{height}{given}",
                "size",
            )
        steps = body.step_count or self.server.default_steps(model)
        if steps is not None and steps > self.limits.steps:
            raise JobFailed(
                400, "invalid_value", f"steps must be at most {self.limits.steps}", "steps"
            )
        job = Job(
            id=new_job_id(kind, self.server.config.instance),
            kind=kind,
            model=body.model,
            prompt=body.prompt,
            width=width,
            height=height,
            steps=steps,
            guidance=body.guidance_scale,
            seed=body.seed,
            negative_prompt=body.negative_prompt,
        )
        if kind == "image":
            if body.n > self.limits.images_per_request:
                raise JobFailed(
                    400, "invalid_value", f"n must be at most {self.limits.images_per_request}", "n"
                )
            job.n = body.n
        else:
            if body.frames is not None and body.frames > self.limits.frames:
                raise JobFailed(
                    400, "invalid_value", f"frames must be at most {self.limits.frames}", "frames"
                )
            job.frames = self.server.frames_for(model, body.seconds, body.frames)
            # The length of the video it makes, not the request's words: the frames asked
            # for, or the seconds fitted to the frame counts the model takes.
            job.seconds = seconds_of(job.frames, model.fps)
        unnamed = not body.size and body.height is None and body.width is None
        self.server.check_shape(model, job, own_size=unnamed)
        if image is not None:
            job.input_image = _open_image(image, self.limits, IMAGE_FIELDS[kind])
        return job

    def submit(self, job: Job) -> Job:
        try:
            return self.server.submit(job)
        except QueueFull as error:
            raise JobFailed(503, error.code, str(error)) from None

    def video_object(self, job: Job) -> dict:
        error = None
        if job.error is not None:
            error = {"code": job.error.code, "message": job.error.message}
        return {
            "id": job.id,
            "object": "video",
            "model": job.model,
            "status": job.status,
            "progress": job.progress,
            "created_at": job.created_at,
            "completed_at": job.completed_at,
            "expires_at": None,
            "prompt": job.prompt,
            "seconds": job.seconds,
            # None until a pipeline that computes its own size has made it.
            "size": f"{job.width}x{job.height}" if job.width and job.height else None,
            "error": error,
            "remixed_from_video_id": None,
        }

    def job_object(self, job: Job) -> dict:
        """ondeck's view of any job, image or video: its progress, error and files."""
        from .server import job_summary

        summary = job_summary(job)
        summary["error"] = self.video_object(job)["error"]
        summary["files"] = sorted(job.files)
        return summary

    def find_job(self, job_id: str, kind: str | None = None) -> Job:
        """The job ``job_id``; with ``kind``, only a job of that kind (the videos API's
        routes find no image job)."""
        job = self.server.queue.get(job_id)
        if job is None or (kind is not None and job.kind != kind):
            what = f"{kind} job" if kind else "job"
            param = f"{kind}_id" if kind else "job_id"
            raise JobFailed(404, f"{kind or 'job'}_not_found", f"no {what} {job_id!r} here", param)
        return job

    def content_of(self, job: Job, role: str, media_type: str) -> Any:
        if job.error is not None:  # a request about a job in a state with no content
            raise JobFailed(409, job.error.code, f"the job has no {role}: {job.error.message}")
        if job.status != "completed":
            raise JobFailed(
                409,
                "not_ready",
                f"the job is {job.status} ({job.progress}%); its {role} is not ready",
            )
        path = job.files.get(role)
        gone = JobFailed(
            404, "content_gone", f"the job's {role} was removed (the outputs folder's size cap)"
        )
        if path is None:
            # A timeline is drawn when first asked for: its folder may have gone before.
            if role == "timeline" and not any(Path(p).is_file() for p in job.files.values()):
                raise gone
            raise JobFailed(404, "no_content", f"the job {job.id!r} made no {role}")
        if not Path(path).is_file():
            raise gone
        return FileResponse(path, media_type=media_type)


def _error_handlers(app: FastAPI, server: Server, api: _Api) -> None:
    """Errors in OpenAI's shape."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        return error_response(
            400, first.get("msg", "invalid request"), "invalid_value", ".".join(where) or None
        )

    @app.exception_handler(ValidationError)
    async def _invalid_body(request: Request, error: ValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        return error_response(
            400, f"{where}: {message}" if where else message, "invalid_value", where
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), None)

    @app.exception_handler(JobFailed)
    async def _failed(request: Request, error: JobFailed) -> JSONResponse:
        return failure_response(error)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, error: BodyTooLarge) -> JSONResponse:
        # A body sent without its length, past the limit while a route reads it.
        limit = server.config.limits.body_bytes
        return error_response(
            413, f"the request body is larger than {limit} bytes", "request_too_large"
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        # Anything a route did not foresee: still in OpenAI's shape (and logged).
        logger.exception("answering %s %s failed", request.method, request.url.path)
        return error_response(500, f"{type(error).__name__}: {error}", "server_error")


def _model_routes(app: FastAPI, server: Server, api: _Api) -> None:
    """``/v1/models``."""
    model_object = api.model_object

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_object(name) for name in server.models]}

    @app.get("/v1/models/{name}")
    async def get_model(name: str) -> dict:
        if name not in server.models:
            raise JobFailed(
                404, "model_not_found", f"the model {name!r} is not served here", "model"
            )
        return model_object(name)


def _image_routes(app: FastAPI, server: Server, api: _Api) -> None:
    """``/v1/images/generations`` and ``/v1/images/edits`` (an image model's input
    image, as openai-python's ``images.edit`` sends it)."""
    job_from = api.job_from
    submit = api.submit
    limits = server.config.limits

    @app.post("/v1/images/generations")
    async def generate_images(request: Request) -> Any:
        body = ImageRequest.model_validate(await _json(request))
        return await answer_images(request, submit(job_from(body, "image")))

    @app.post("/v1/images/edits")
    async def edit_images(request: Request) -> Any:
        data, image = await _image_fields(request, limits)
        body = ImageRequest.model_validate(data)
        if image is None:
            raise JobFailed(400, "invalid_value", "an edit needs its image", "image")
        return await answer_images(request, submit(job_from(body, "image", image)))

    async def answer_images(request: Request, job: Job) -> Any:
        """The images of ``job`` once it ends, as OpenAI's images API answers."""
        # A waiting call: a client that leaves stops its job at the next step.
        while not job.done_event.is_set():
            if await request.is_disconnected():
                job.cancel("abandoned by its client")
                return Response(status_code=499)
            if server.grace_over.is_set():  # stopped, at its next step: answered now
                return failure_response(
                    JobFailed(503, "server_shutdown", "the server shut down before the job ended")
                )
            await asyncio.sleep(0.05)
        if job.error is not None:
            return failure_response(job.error)
        images = []
        for role, path in job.files.items():  # in the order written: image-1, image-2 ...
            if role.startswith("image"):
                try:
                    data = Path(path).read_bytes()
                except FileNotFoundError:
                    return failure_response(
                        JobFailed(
                            404,
                            "content_gone",
                            f"the job's {role} was removed (the outputs folder's size cap)",
                        )
                    )
                images.append({"b64_json": base64.b64encode(data).decode(), "revised_prompt": None})
        return {"created": job.created_at, "data": images, "ondeck_job": job.id}


def _video_routes(app: FastAPI, server: Server, api: _Api) -> None:
    """The videos API: create, list, read, content, cancel."""
    limits = server.config.limits
    job_from = api.job_from
    submit = api.submit
    video_object = api.video_object
    find_job = api.find_job
    content_of = api.content_of

    @app.post("/v1/videos")
    async def create_video(request: Request) -> dict:
        data, image = await _request_fields(request, limits)
        return video_object(submit(job_from(VideoRequest.model_validate(data), "video", image)))

    @app.get("/v1/videos")
    async def list_videos() -> dict:
        videos = [video_object(j) for j in server.queue.jobs.values() if j.kind == "video"]
        return {
            "object": "list",
            "data": videos[::-1],
            "has_more": False,
            "first_id": videos[-1]["id"] if videos else None,
            "last_id": videos[0]["id"] if videos else None,
        }

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str) -> JSONResponse:
        job = find_job(video_id, "video")
        # openai-python's poll() waits this long between its reads.
        return JSONResponse(video_object(job), headers={"openai-poll-after-ms": "200"})

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video") -> Any:
        job = find_job(video_id, "video")
        if variant != "video":
            raise JobFailed(400, "invalid_value", "only the video variant is served", "variant")
        return content_of(job, "video", "video/mp4")

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str) -> dict:
        # An unfinished job is cancelled and, once it stops (a running one at its next
        # step, waited for a while), goes with its files; until then it is not deleted.
        job = find_job(video_id, "video")
        if job.cancel("cancelled"):
            waited = 0.0
            while not job.finished and waited < DELETE_WAIT_SECONDS:
                await asyncio.sleep(0.05)  # no thread of the pool held meanwhile
                waited += 0.05
        if not job.finished:
            return {"id": job.id, "object": "video.deleted", "deleted": False}
        server.queue.remove(job.id)
        server.outputs.remove(job.id)
        return {"id": job.id, "object": "video.deleted", "deleted": True}


def _ondeck_routes(app: FastAPI, server: Server, api: _Api) -> None:
    """ondeck's own status and job routes, and the page."""
    find_job = api.find_job
    content_of = api.content_of

    @app.get("/v1/ondeck/status")
    async def status() -> dict:
        return server.status()

    @app.post("/v1/ondeck/images")
    async def queue_images(request: Request) -> dict:
        # The images route's body (an edit's image too), answered at once with the queued
        # job, as a video job is: the page shows its steps and can cancel it; its image is
        # at .../image.
        data, image = await _image_fields(request, server.config.limits)
        job = api.job_from(ImageRequest.model_validate(data), "image", image)
        return api.job_object(api.submit(job))

    @app.get("/v1/ondeck/jobs/{job_id}")
    async def job_status(job_id: str) -> dict:
        return api.job_object(find_job(job_id))

    @app.get("/v1/ondeck/jobs/{job_id}/report")
    async def job_report(job_id: str) -> Any:
        return content_of(find_job(job_id), "report", "application/json")

    @app.get("/v1/ondeck/jobs/{job_id}/timeline")
    async def job_timeline(job_id: str) -> Any:
        job = find_job(job_id)
        if job.status == "completed":
            await asyncio.to_thread(server.timeline, job)
        return content_of(job, "timeline", "image/png")

    @app.get("/v1/ondeck/jobs/{job_id}/image")
    async def job_image(job_id: str) -> Any:
        job = find_job(job_id)  # its first image: image.png, or image-1.png of several
        first = next((role for role in job.files if role.startswith("image")), "image")
        return content_of(job, first, "image/png")

    @app.delete("/v1/ondeck/jobs/{job_id}")
    async def cancel_job(job_id: str) -> dict:
        job = find_job(job_id)
        job.cancel("cancelled")
        return {"id": job.id, "object": "job.cancelled", "cancelled": job.cancelled}

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        text = resources.files("ondeck.serve").joinpath("static/index.html").read_text()
        return HTMLResponse(text)


async def _json(request: Request) -> Any:
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python parses
        raise JobFailed(400, "invalid_json", "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise JobFailed(
            400, "invalid_json", f"the request body is a JSON {type(body).__name__}, not an object"
        )
    return body


async def _request_fields(
    request: Request, limits: Any, field: str = "input_reference"
) -> tuple[dict, bytes | None]:
    """The fields of a request and its input image's bytes (or None), from JSON or from
    a multipart form (what openai-python sends). ``field``: the image's name, a video's
    ``input_reference`` or an edit's ``image``."""
    kind = request.headers.get("content-type", "")
    image: bytes | None = None
    if kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        # A text field may be the image as a data: URL: base64's 4/3 and its prefix.
        longest_field = limits.image_bytes * 4 // 3 + 1024
        form = await request.form(max_files=1, max_fields=32, max_part_size=longest_field)
        data: dict = {}
        for key, value in form.multi_items():
            if hasattr(value, "read"):
                if key not in (field, f"{field}[]"):
                    raise JobFailed(400, "invalid_value", f"unexpected file field {key!r}", key)
                image = await value.read(limits.image_bytes + 1)
            elif key in (field, f"{field}[image_url]"):
                # A data: URL as a text field, as JSON takes it; the second name is how
                # openai-python's form writes ``{"image_url": ...}`` given in extra_body.
                image = _data_url(str(value), limits, field)
            else:
                data[key] = value
        for key in ("n", "steps", "num_inference_steps", "seed", "frames"):
            if key in data:
                data[key] = _integer(data[key], key)
        if "guidance_scale" in data:
            try:
                data["guidance_scale"] = float(data["guidance_scale"])
            except ValueError:
                raise JobFailed(
                    400, "invalid_value", "guidance_scale must be a number", "guidance_scale"
                ) from None
    else:
        data = await _json(request)
        if not isinstance(data, dict):
            raise JobFailed(400, "invalid_value", "the request body must be a JSON object")
        reference = data.pop(field, None)
        if isinstance(reference, dict) and reference.get("image_url"):
            image = _data_url(str(reference["image_url"]), limits, field)
        elif reference is not None:
            raise JobFailed(
                400,
                "invalid_value",
                f"{field} must be {{image_url: a data: URL}} or a file upload",
                field,
            )
    if image is not None and len(image) > limits.image_bytes:
        raise JobFailed(
            413,
            "image_too_large",
            f"the input image is larger than {limits.image_bytes} bytes",
            field,
        )
    return data, image


async def _image_fields(request: Request, limits: Any) -> tuple[dict, bytes | None]:
    """An image request's fields and its input image (an edit's ``image``); a mask, which
    no served pipeline takes, is a 400."""
    data, image = await _request_fields(request, limits, IMAGE_FIELDS["image"])
    if "mask" in data:
        raise JobFailed(400, "invalid_value", "ondeck serve takes no mask", "mask")
    return data, image


# A request's input image by the kind of its job: the field it comes in.
IMAGE_FIELDS = {"video": "input_reference", "image": "image"}


# Where a model that needs an input image is told to give it, by the kind of its job:
# the message and the request field it names.
_IMAGE_NEEDED = {
    "video": ("makes a video from an image: give it as input_reference", "input_reference"),
    "image": ("makes an image from an image: give it to /v1/images/edits", "model"),
}


def _check_image(name: str, model: Any, kind: str, image: bytes | None) -> None:
    """A 400 for an input image ``model`` takes none of, or for none where it needs one
    (saying where it goes)."""
    if image is not None and not model.takes_image:
        raise JobFailed(400, "invalid_value", f"{name!r} takes no input image", IMAGE_FIELDS[kind])
    if image is None and model.needs_image:
        message, field = _IMAGE_NEEDED[kind]
        raise JobFailed(400, "invalid_value", f"{name!r} {message}", field)


def _integer(value: str, key: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise JobFailed(400, "invalid_value", f"{key} must be a whole number", key) from None


def _data_url(url: str, limits: Any, field: str) -> bytes:
    # Only inline images: a URL the server would fetch could reach anything it can.
    if not url.startswith("data:") or ";base64," not in url:
        raise JobFailed(400, "invalid_value", "image_url must be a base64 data: URL", field)
    encoded = url.split(";base64,", 1)[1]
    if len(encoded) > limits.image_bytes * 4 // 3 + 4:
        raise JobFailed(
            413,
            "image_too_large",
            f"the input image is larger than {limits.image_bytes} bytes",
            field,
        )
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise JobFailed(400, "invalid_value", "image_url is not valid base64", field) from None


def _open_image(data: bytes, limits: Any, field: str) -> Any:
    """The input image, upright as its camera's orientation tag says, in RGB."""
    from PIL import Image

    from ..cli.media import ImageRangeError, upright_rgb

    too_large = JobFailed(
        413,
        "image_too_large",
        f"the input image has more than {limits.image_pixels} pixels",
        field,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # counted below
            image = Image.open(io.BytesIO(data))
        if image.width * image.height > limits.image_pixels:
            raise too_large
        image.load()
        return upright_rgb(image)
    except JobFailed:
        raise
    except ImageRangeError as error:
        raise JobFailed(400, "invalid_value", f"{field}: {error}", field) from None
    except Image.DecompressionBombError:
        raise too_large from None
    except Exception:
        raise JobFailed(
            400,
            "invalid_value",
            f"{field} is not an image ondeck can read",
            field,
        ) from None
