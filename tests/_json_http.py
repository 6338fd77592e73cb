"""A stdlib HTTP handler that reads and answers JSON and logs nothing: the base of the tests' stand-ins for an
SGLang server's weight routes (tests/_sglang_ipc_receiver.py, tests/test_weight_push_engine_tp.py)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    def answer(self, code: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def read_json(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

    def log_message(self, *args: Any) -> None:
        pass
