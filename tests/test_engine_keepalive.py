"""Engine clients never reuse a connection the engine may be closing.

SGLang (SGLANG_TIMEOUT_KEEP_ALIVE, 5 s by default) and our engine close a connection idle that long; httpx kept
one idle for 5 s as well, so a call made just as the engine closed it went out on a dead socket ("connection
reset by peer": CI saw a weight push's /pause_generation fail so, after the demo's eval paused pushes ~5 s).
The server here resets a connection when a request arrives on it after it sat idle longer than the clients'
expiry, which is what a keep-alive close racing a request looks like from the client: a client that reuses
such a connection fails, one that opened a new connection passes. Outside the unit: the server (the engines' side
of the race); the clients are the trainer's and the loop's own.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from slime_server.trainer.loop import EngineControl
from slime_server.trainer.weight_push import WeightPusher
from slime_server.utils.net import CLIENT_KEEPALIVE_EXPIRY_S, ENGINE_KEEP_ALIVE_S, engine_limits
from tests._sglang_source import sglang_file

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n{}"


@pytest.fixture
def resets_reused_connections() -> Iterator[tuple[str, list[int]]]:
    """An HTTP server that resets a connection reused after more than CLIENT_KEEPALIVE_EXPIRY_S idle; yields its URL
    and a list that counts the connections it accepted."""
    srv = socket.create_server(("127.0.0.1", 0))
    accepted: list[int] = []
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            answered_at: float | None = None
            buf = b""
            while not stop.is_set():
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
                if b"\r\n\r\n" not in buf:
                    continue
                head, _, rest = buf.partition(b"\r\n\r\n")
                m = re.search(rb"content-length:\s*(\d+)", head, re.I)
                if m and len(rest) < int(m.group(1)):
                    continue
                buf = b""
                if answered_at is not None and time.monotonic() - answered_at > CLIENT_KEEPALIVE_EXPIRY_S:
                    # the keep-alive close racing this request: RST, no answer
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                conn.sendall(OK)
                answered_at = time.monotonic()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            accepted.append(1)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}", accepted
    finally:
        stop.set()
        srv.close()


def test_the_server_fails_a_client_that_reuses_an_idle_connection(resets_reused_connections) -> None:
    """The server does what the docstring says: httpx's default keeps the connection and the second call fails."""
    url, accepted = resets_reused_connections
    with httpx.Client() as plain:
        assert plain.post(f"{url}/pause_generation", json={}).status_code == 200
        time.sleep(CLIENT_KEEPALIVE_EXPIRY_S + 0.5)
        with pytest.raises(httpx.HTTPError):
            plain.post(f"{url}/pause_generation", json={})
    assert len(accepted) == 1


def test_pauses_and_pushes_open_a_new_connection_after_an_idle_pause(resets_reused_connections) -> None:
    url, accepted = resets_reused_connections
    control = EngineControl(lambda: [url])
    pusher = WeightPusher([url])
    try:
        for _ in range(2):
            control.pause()
            control.resume()  # back to back: the connection is reused, as it should be
            pusher._post(url, "/pause_generation", None)
            time.sleep(CLIENT_KEEPALIVE_EXPIRY_S + 0.5)  # idle past the client's expiry, short of the engine's
    finally:
        control.close()
        pusher.close()
    # a new connection per client after each idle pause; the resume right after a pause reused the pause's
    assert len(accepted) == 4


def test_clients_expire_idle_connections_before_sglang_closes_them() -> None:
    """SGLang's own default, read from the pinned release, is the engine keep-alive we assume."""
    environ = sglang_file("sglang/srt/environ.py").read_text()
    m = re.search(r"SGLANG_TIMEOUT_KEEP_ALIVE\s*=\s*EnvInt\((\d+)\)", environ)
    assert m, "SGLang no longer declares SGLANG_TIMEOUT_KEEP_ALIVE as an EnvInt"
    assert float(m.group(1)) == ENGINE_KEEP_ALIVE_S
    assert engine_limits().keepalive_expiry == CLIENT_KEEPALIVE_EXPIRY_S < ENGINE_KEEP_ALIVE_S / 2
