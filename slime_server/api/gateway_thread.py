"""A uvicorn server on a background thread, its signal handlers off.

Why: uvicorn re-raises SIGTERM/SIGINT after its own graceful shutdown, which would kill the process
before the engines and router are stopped; ``serve`` keeps the signals on its main thread instead.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class GatewayThread:
    """A uvicorn server for ``app`` on a background thread; ``start`` returns once it is bound."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    access_log=False))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # signals stay ours
        self.thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)

    def start(self, timeout: float = 60.0) -> GatewayThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start (port in use?)")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)
