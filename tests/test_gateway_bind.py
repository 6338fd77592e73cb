"""The gateway's port is bound before anything else starts: port 0 picks a free one (no choose-then-bind race with
other processes on the host), and a port in use fails at once with the OS's error, before engines or Ray start."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from slime_server.server.gateway_thread import GatewayThread


def _app() -> Starlette:
    return Starlette(routes=[Route("/health", lambda request: PlainTextResponse("ok"))])


def test_port_zero_serves_on_the_port_it_bound() -> None:
    gateway = GatewayThread(_app(), "127.0.0.1", 0)
    try:
        assert gateway.port > 0
        gateway.start()
        assert httpx.get(f"http://127.0.0.1:{gateway.port}/health", timeout=10).text == "ok"
    finally:
        gateway.stop()
    with socket.socket() as s:  # stopped: the port is free again
        s.bind(("127.0.0.1", gateway.port))


def test_a_port_in_use_fails_at_construction_with_the_os_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            GatewayThread(_app(), "127.0.0.1", port)


def test_serve_with_a_port_in_use_fails_before_ray_and_engines_start(tiny_model_path: Path, tmp_path: Path) -> None:
    import ray

    from tests._jobs_helpers import start_stack

    ray_before = ray.is_initialized()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="Address already in use"):
            start_stack(tiny_model_path, tmp_path, gateway={"port": port})
    assert ray.is_initialized() == ray_before, "Ray was started for a server that could not listen"
    assert not (tmp_path / "logs").exists(), "engines were started for a server that could not listen"
