"""A uvicorn server on a background thread, its signal handlers off, its socket bound before it starts.

Why a thread: uvicorn re-raises SIGTERM/SIGINT after its own graceful shutdown, which would kill the process
before the engines and router are stopped; ``serve`` keeps the signals on its main thread instead.
Why bind first: the port is ours from the constructor on (port 0 picks a free one, read back as ``port``), and a
port in use fails there with the OS's error. Choosing a free port and binding it later raced with every other
process on the host (seen under two test workers: another process took the port in between).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when ``host`` is an IPv6 address), as uvicorn would bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"the gateway cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


class GatewayThread:
    """A uvicorn server for ``app`` on a background thread; ``start`` returns once it serves on ``port``."""

    def __init__(self, app: Any, host: str, port: int, sock: socket.socket | None = None) -> None:
        """``sock``: a listener bound earlier (``bind_listener``), whose port the app was configured with."""
        import uvicorn

        self.socket = sock if sock is not None else bind_listener(host, port)
        self.host, self.port = host, int(self.socket.getsockname()[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                                    access_log=False))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # signals stay ours
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, name="gateway",
                                       daemon=True)

    def start(self, timeout: float = 60.0) -> GatewayThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.socket.close()
                raise RuntimeError(f"the gateway did not start on {self.host}:{self.port}")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)
        self.socket.close()
