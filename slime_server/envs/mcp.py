"""MCP adapter: any MCP tool server (stdio transport) becomes an environment's tools.

The Model Context Protocol over stdio is JSON-RPC 2.0, one message per line: ``initialize`` ->
``notifications/initialized`` -> ``tools/list`` -> ``tools/call``. ``MCPClient`` speaks that much;
``MCPEnvironment`` exposes the server's tools (their ``inputSchema`` as OpenAI function
parameters) and forwards each tool call, with the reward left to a function you pass (by default
exact match against the row's label).
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any

from slime_server.envs.base import DatasetRow, Environment, EpisodeState
from slime_server.envs.rewards import exact_match, extract_answer

PROTOCOL_VERSION = "2025-06-18"


class MCPError(RuntimeError):
    pass


class MCPClient:
    """A stdio MCP server as a child process (closed with ``close``)."""

    def __init__(self, command: Sequence[str], *, timeout_s: float = 30.0, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1, env=env)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._next_id = 0
        init = self.request("initialize", {"protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                                           "clientInfo": {"name": "slime-server", "version": "0.1"}})
        self.server_info = init.get("serverInfo", {})
        self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def _send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            self._send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}})
            result: list[dict[str, Any]] = []

            def read() -> None:
                assert self.proc.stdout is not None
                for line in self.proc.stdout:
                    if not line.strip():
                        continue
                    msg = json.loads(line)
                    if msg.get("id") == rid:
                        result.append(msg)
                        return

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            reader.join(self.timeout_s)
            if not result:
                raise MCPError(f"MCP server gave no answer to {method} within {self.timeout_s}s")
        msg = result[0]
        if "error" in msg:
            raise MCPError(f"{method}: {msg['error'].get('message', msg['error'])}")
        return msg.get("result", {})

    def list_tools(self) -> list[dict[str, Any]]:
        return self.request("tools/list").get("tools", [])

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        result = self.request("tools/call", {"name": name, "arguments": arguments})
        text = "\n".join(c.get("text", "") for c in result.get("content", []) if c.get("type") == "text")
        return f"error: {text}" if result.get("isError") else text

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class MCPEnvironment(Environment):
    """Tools from an MCP server; ``reward_fn(state, final_text)`` scores episodes."""

    name = "mcp"

    def __init__(self, command: Sequence[str], *, system_prompt: str | None = None,
                 reward_fn: Callable[[EpisodeState, str], float] | None = None, rows: list[DatasetRow] | None = None,
                 max_turns: int = 4) -> None:
        self.client = MCPClient(command)
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self._reward_fn = reward_fn
        self._rows = rows or []
        self._tools = [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t.get("inputSchema") or {"type": "object", "properties": {}}}}
            for t in self.client.list_tools()]

    def tools(self) -> list[dict[str, Any]]:
        return self._tools

    def call_tool(self, state: EpisodeState, name: str, arguments: dict[str, Any]) -> str:
        try:
            return self.client.call_tool(name, arguments)
        except MCPError as e:
            return f"error: {e}"

    def reward(self, state: EpisodeState, final_text: str) -> float:
        if self._reward_fn is not None:
            return self._reward_fn(state, final_text)
        return exact_match(extract_answer(final_text), str(state.row.label))

    def default_dataset(self, n: int, seed: int = 0) -> list[DatasetRow]:
        if not self._rows:
            raise NotImplementedError("an MCP environment needs a dataset")
        return [self._rows[i % len(self._rows)] for i in range(n)]

    def close(self) -> None:
        self.client.close()
