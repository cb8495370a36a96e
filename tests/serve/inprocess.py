"""A Server driven in-process through its ASGI app (no subprocess, no port)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from ondeck.serve.app import create_app
from ondeck.serve.server import Limits, ServeConfig, Server

KIB = 1024


def make_server(models, tmp: Path, names=("wan",), **config) -> Server:
    config.setdefault("budget_bytes", 1800 * KIB)
    config.setdefault("steps", 2)
    server = Server(
        ServeConfig(
            models={n: str(models[n]) for n in names},
            device="cpu",
            outputs=tmp / "outputs",
            **config,
        ),
        say=lambda *_: None,
    )
    server.start()
    return server


def call(server: Server, method: str, path: str, **kwargs) -> httpx.Response:
    """One request to the server's app, from this (non-async) test."""
    app = create_app(server)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


__all__ = ["Limits", "call", "make_server"]
