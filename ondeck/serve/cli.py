"""``ondeck serve`` and ``ondeck generate --server URL``: their arguments and commands.

The command line's own module calls ``add_parser`` and dispatches to ``serve`` and
``remote_or``; nothing here imports it back.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..cli.options import UsageError, host_cache_argument, lora_argument, require_file
from ..errors import LoadError, OndeckError
from ..loading.fp8 import parse_storage_dtype
from ..memory import format_bytes, freeze_what_lives, parse_bytes

THREE_LINES = """\
start:
  pip install -e '.[serve]'    (in a clone of ondeck)
  ondeck serve --model wan=Wan-AI/Wan2.1-T2V-14B-Diffusers --budget 24GiB
  open http://127.0.0.1:8000/  (or point any OpenAI client at http://127.0.0.1:8000/v1)
"""


def _size(text: str, *, allow_zero: bool = False) -> int:
    try:
        nbytes = (
            int(float(text)) if re.fullmatch(r"[0-9.eE+]+", text.strip()) else parse_bytes(text)
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size; write e.g. 24GiB, 500MB or a number of bytes"
        ) from None
    if nbytes is None or nbytes < 0 or (nbytes == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    return nbytes


def _weights(text: str) -> str | dict[str, str]:
    chosen: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, dtype = part.rpartition("=")
        try:
            parse_storage_dtype(dtype)
        except LoadError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        chosen[name] = dtype
    if not chosen:
        raise argparse.ArgumentTypeError("expected fp8 or NAME=fp8, got nothing")
    return chosen[""] if "" in chosen else chosen


def _model(text: str) -> tuple[str, str]:
    name, sep, source = text.partition("=")
    if not sep or not name or not source:
        raise argparse.ArgumentTypeError(f"expected NAME=FOLDER_OR_REPO_ID, got {text!r}")
    return name, source


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is from 0 to 65535, got {port}")
    return port


def _instance(text: str) -> str:
    from .jobs import INSTANCE_NAME

    if not INSTANCE_NAME.match(text):
        raise argparse.ArgumentTypeError(
            f"an instance name is letters, digits, '.' or '-' (at most 32), got {text!r}"
        )
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the command line's subcommands, and ``--server`` to ``generate``."""
    serve = commands.add_parser(
        "serve",
        help="one resident process for many models, with an OpenAI-style API",
        description="Serve models over HTTP (OpenAI's images and videos APIs) from one "
        "process, under one memory budget across all of them.",
        epilog=THREE_LINES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "--model",
        action="append",
        default=[],
        type=_model,
        metavar="NAME=FOLDER_OR_REPO_ID",
        help="a model to serve under NAME (repeat for more); requests can name only these",
    )
    serve.add_argument(
        "--model-root", metavar="DIR", help="serve each subfolder of DIR, by its name"
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default loopback only)"
    )
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--budget", type=_size, help="one device budget for every model, e.g. 24GiB")
    serve.add_argument("--device", help="cuda, cuda:1, cpu, mps (default: cuda if present)")
    serve.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
    serve.add_argument(
        "--weights",
        type=_weights,
        metavar="fp8",
        help="keep weights in fp8 (every model but the VAE), or NAME=fp8[,NAME=fp8]",
    )
    serve.add_argument(
        "--host-cache",
        type=host_cache_argument,
        help="one pinned host cache for released weights of every model (e.g. 40GiB, 0 = off, "
        "or auto: what each plan leaves of the host memory)",
    )
    serve.add_argument(
        "--api-key", help="require Authorization: Bearer KEY (default: $ONDECK_API_KEY)"
    )
    _add_outputs(serve)
    _add_request_limits(serve)
    serve.add_argument(
        "--instance",
        type=_instance,
        metavar="NAME",
        help="put NAME into every job id (video_NAME-...), so that a load balancer in front "
        "of several servers can send a job's later requests to the server that holds it",
    )
    serve.add_argument(
        "--no-lookahead",
        action="store_true",
        help="evict the least recently used model and load nothing ahead, whatever waits",
    )
    serve.add_argument(
        "--plan",
        action="store_true",
        help="print what stays resident across the models and what a switch loads, then exit",
    )
    _add_model_files(serve)
    serve.add_argument("--debug", action="store_true", help="show Python tracebacks")
    _add_server_to_generate(commands)
    return serve


def _add_model_files(serve: argparse.ArgumentParser) -> None:
    """``generate``'s single files and LoRAs, each for one served model by its name."""
    flags = (
        ("--transformer", _model_file, "MODEL=FILE", "MODEL's transformer from one file"),
        (
            "--component",
            _model_component,
            "MODEL:NAME=FILE",
            "MODEL's component NAME from one file",
        ),
        ("--lora", _model_lora, "MODEL=FILE[:SCALE]", "apply this LoRA to MODEL (scale 1.0)"),
    )
    for flag, parse, metavar, help in flags:
        serve.add_argument(
            flag,
            action="append",
            default=[],
            type=parse,
            metavar=metavar,
            help=help + "; repeatable",
        )


def _model_file(text: str) -> tuple[str, str]:
    model, _, file = text.partition("=")
    if not model or not file:
        raise argparse.ArgumentTypeError(f"expected MODEL=FILE, got {text!r}")
    return model, file


def _model_component(text: str) -> tuple[str, str, str]:
    named, _, file = text.partition("=")
    model, _, component = named.rpartition(":")
    if not model or not component or not file:
        raise argparse.ArgumentTypeError(f"expected MODEL:NAME=FILE, got {text!r}")
    return model, component, file


def _model_lora(text: str) -> tuple[str, tuple[str, float]]:
    model, file = _model_file(text)
    return model, lora_argument(file)


def _brought(args: argparse.Namespace, models: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``--transformer``, ``--component`` and ``--lora`` by served model, as each model's
    pipeline takes them; a model not served, a file not there or a component given twice
    is the flag's error, before anything is built."""
    brought: dict[str, dict[str, Any]] = {}

    def files_of(flag: str, model: str, file: str) -> dict[str, Any]:
        if model not in models:
            raise UsageError(
                f"argument {flag}: no model named {model!r} is served ({', '.join(models)})"
            )
        require_file(flag, file)
        return brought.setdefault(model, {})

    given = [("--transformer", model, "transformer", file) for model, file in args.transformer]
    for flag, model, component, file in given + [("--component", *e) for e in args.component]:
        components = files_of(flag, model, file).setdefault("components", {})
        if component in components:
            raise UsageError(f"argument {flag}: {model}'s {component} is given twice")
        components[component] = file
    for model, (file, scale) in args.lora:
        files_of("--lora", model, file).setdefault("loras", []).append((file, scale))
    return brought


def _add_outputs(serve: argparse.ArgumentParser) -> None:
    """Where the jobs' files go, how much of them is kept, and how a stop treats a job."""
    serve.add_argument(
        "--outputs",
        metavar="DIR",
        help="folder for the jobs' files (default: $ONDECK_CACHE/serve-outputs)",
    )
    serve.add_argument(
        "--outputs-cap",
        type=_size,
        default=20 * 2**30,
        help="the outputs folder's size cap; the oldest jobs' files go first (default 20GiB)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long the running job may take to finish before it "
        "is stopped at its next step; a second signal stops at once (default 30)",
    )


def _add_request_limits(serve: argparse.ArgumentParser) -> None:
    """What a request may ask for, and the steps of one that names none."""
    serve.add_argument("--steps", type=_positive, help="denoising steps when a request names none")
    serve.add_argument(
        "--max-body", type=_size, default=8 * 2**20, help="largest request body (default 8MiB)"
    )
    serve.add_argument(
        "--max-prompt", type=_positive, default=4000, help="longest prompt, in characters"
    )
    serve.add_argument("--max-side", type=_positive, default=2048, help="largest width or height")
    serve.add_argument("--max-frames", type=_positive, default=241)


def _add_server_to_generate(commands: Any) -> None:
    """``generate --server URL``: the same command, run by a running ``ondeck serve``."""
    generate = commands.choices.get("generate")
    if generate is None:
        return
    generate.add_argument(
        "--server",
        metavar="URL",
        help="send the job to a running `ondeck serve` (MODEL_DIR is then the served "
        "model's name) and write the same output folder",
    )
    generate.add_argument("--api-key", help="the server's key (default: $ONDECK_API_KEY)")


def remote_or(local: Any) -> Any:
    """``generate``: to the server given with ``--server``, else ``local``."""

    def run(args: argparse.Namespace) -> int:
        if getattr(args, "server", None):
            from .client import generate_remote

            return generate_remote(args)
        return local(args)

    return run


def _config(args: argparse.Namespace) -> Any:
    from .server import Limits, ServeConfig, models_from_root

    limits = Limits(
        body_bytes=args.max_body,
        prompt_chars=args.max_prompt,
        side=args.max_side,
        frames=args.max_frames,
    )
    if args.steps is not None and args.steps > limits.steps:
        # A request naming no steps would ask for them, past what any request may.
        raise UsageError(
            f"argument --steps: at most {limits.steps} (the most a request may ask for), "
            f"got {args.steps}"
        )
    models: dict[str, str] = {}
    embedded = None  # the name of the embedded default, where it is served
    if args.model_root:
        models.update(models_from_root(args.model_root))
    for name, source in args.model:
        if name in models:
            raise OndeckError(f"--model {name}: the name is given twice")
        models[name] = source
    if not models:
        from ..embedded import embedded_default

        path, built = embedded_default(say=print)
        print(
            f"ondeck: no --model given; serving the embedded default as 'wan-embedded' "
            f"({path}; random weights: its videos are noise)"
        )
        embedded = "wan-embedded"
        models[embedded] = str(path)
    brought = _brought(args, models)
    api_key = args.api_key or os.environ.get("ONDECK_API_KEY") or None
    return ServeConfig(
        models=models,
        brought=brought,
        budget_bytes=args.budget,
        device=args.device,
        dtype=args.dtype,
        host_cache_bytes=args.host_cache,
        weights=args.weights,
        outputs=Path(args.outputs).expanduser() if args.outputs else None,
        outputs_cap_bytes=args.outputs_cap,
        api_key=api_key,
        steps=args.steps,
        shutdown_grace_seconds=args.shutdown_grace,
        lookahead=not args.no_lookahead,
        instance=args.instance,
        embedded=embedded,
        limits=limits,
    )


def serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .app import create_app
        from .server import Server
    except ImportError as error:
        raise OndeckError(
            f"ondeck serve needs its extra: pip install -e '.[serve]' in the clone ({error.name} "
            "is missing)"
        ) from None
    from ..cli.commands import quiet_library_bars

    quiet_library_bars()
    if not args.plan:
        _check_port(args.host, args.port)  # before any model is built, not after
    config = _config(args)
    server = Server(config, say=lambda line: print(line, flush=True))
    if args.plan:
        print(server.manager.plan())
        return 0
    for name, model in server.models.items():
        total = sum(v or 0 for v in model.pipeline.component_bytes().values())
        print(f"ondeck: serving {name} ({model.kind}, {format_bytes(total)}) from {model.source}")
    print(f"ondeck: one budget of {format_bytes(server.budget_bytes)} on {server.device}")
    plan = server.manager.plan()
    print(plan)
    for name in (name for name, model in plan.models.items() if not model.fits):
        print(
            f"ondeck: warning: {name} does not fit the budget of "
            f"{format_bytes(server.budget_bytes)}, even streaming: its jobs will be refused "
            "(503); --budget or another --device may fit it",
            file=sys.stderr,
        )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        print(
            f"ondeck: warning: listening on {args.host} without --api-key: anyone who can "
            "reach this address can run jobs",
            file=sys.stderr,
        )
    app = create_app(server)
    freeze_what_lives()  # the models live as long as the server: no job rescans them

    uv = _listener(uvicorn, server, app, args)
    server.start()
    # uvicorn turns SIGTERM and SIGINT into a graceful stop, then raises the signal again
    # with the handler it found: this one notes it, so the queue stops and the exit is 0.
    received: list[int] = []
    previous = {
        s: signal.signal(s, lambda number, _: received.append(number)) for s in STOP_SIGNALS
    }
    try:
        uv.run()
    except SystemExit:
        if uv.started:
            raise
        raise OndeckError(
            f"could not listen on {_url(args.host, args.port)} (the line above says why; "
            "another server on the port is the usual reason: --port chooses another)"
        ) from None
    finally:
        stopped = _stop(server, received)
        for number, handler in previous.items():
            signal.signal(number, handler)
    print(f"ondeck: stopped ({server.jobs_run} jobs done, {server.jobs_failed} failed)", flush=True)
    return 0 if stopped else 1


def _url(host: str, port: int) -> str:
    """The server's address as a URL: an IPv6 host in brackets."""
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def _check_port(host: str, port: int) -> None:
    """Refuse a port another process listens on now, naming it: each address ``host``
    resolves to is bound as uvicorn's listener binds it (address reuse on, an IPv6
    socket IPv6 only, a family this host cannot make skipped), then let go. A host that
    does not resolve is left to uvicorn's own error, and so is a port taken after this."""
    import socket

    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return
    for family, kind, protocol, _, address in dict.fromkeys(found):
        try:
            probe = socket.socket(family, kind, protocol)
        except OSError:
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as error:
                raise OndeckError(
                    f"could not listen on {_url(host, port)} ({error.strerror or error}): "
                    "another server on the port is the usual reason; --port chooses another"
                ) from None


def _listener(uvicorn: Any, server: Any, app: Any, args: argparse.Namespace) -> Any:
    """uvicorn's server for ``app``, stopping as a job server should: on the first stop
    signal the waiting jobs fail and no new one starts, but it keeps answering while the
    running job has its grace (its client can follow it and fetch what it made, for
    ``LINGER_SECONDS`` after), then stops listening; a second signal ends the process."""
    from .server import LINGER_SECONDS, STOP_MARGIN_SECONDS

    grace = server.config.shutdown_grace_seconds

    class Uvicorn(uvicorn.Server):
        stop_asked = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            # A signal handler, run between two operations of the main thread (which
            # also serves the requests): it only starts what stops the server.
            if self.stop_asked:
                _exit_at_once(sig, None)
            self.stop_asked = True
            threading.Thread(
                target=self._stop_when_done, args=(sig, frame), name="ondeck-serve-stop"
            ).start()

        def _stop_when_done(self, sig: int, frame: Any) -> None:
            server.begin_shutdown()
            job = server.job_in_hand()
            if job is not None:
                print(
                    f"ondeck: stopping: waiting jobs fail; the running job {job.id} "
                    f"({job.model}) has {grace:g} s to finish, then stops at its next step "
                    "(Ctrl-C again stops now)",
                    flush=True,
                )
                if job.done_event.wait(grace + STOP_MARGIN_SECONDS):
                    if job.status == "completed":
                        time.sleep(LINGER_SECONDS)  # its client fetches what it made
            uvicorn.Server.handle_exit(self, sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)  # exits where the address is taken
            # The port bound, which --port 0 leaves to the system.
            bound = [s.getsockname()[1] for each in self.servers for s in each.sockets]
            print(
                f"ondeck: listening on {_url(args.host, bound[0] if bound else args.port)}",
                flush=True,
            )

    return Uvicorn(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=int(grace) + 5,
            lifespan="off",
        )
    )


def _exit_at_once(number: int, frame: Any) -> None:
    # A signal handler: one write, where print could meet the stream mid-write.
    os.write(1, b"\nondeck: stopped without waiting for the running job\n")
    os._exit(128 + number)


def _stop(server: Any, received: list[int]) -> bool:
    """Stop the server once its listener has (the running job has had its grace there):
    what is left of the job, the files being written, the pipelines. A stop signal from
    now on (or a second one before) ends the process at once. False where the running
    job was still in a step well past its grace (``Server.stop``)."""
    from .server import STOP_MARGIN_SECONDS

    for number in STOP_SIGNALS:
        signal.signal(number, _exit_at_once)
    if len(received) > 1:
        _exit_at_once(received[-1], None)
    running = server.job_in_hand()
    stopped = server.stop()
    if not stopped:
        grace = server.config.shutdown_grace_seconds
        print(
            f"ondeck: the running job {running.id if running else ''} is still in a step "
            f"{grace + STOP_MARGIN_SECONDS:g} s after the stop began; stopping without it",
            flush=True,
        )
        os._exit(1)  # its threads are not waited for: one of them is still in that step
    return stopped
