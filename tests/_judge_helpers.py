"""A deterministic, rule-based judge served over real HTTP as an OpenAI-compatible endpoint.

It reads the judge prompt the server sends and answers -1 with a hint when the user's next
message complains ("too long", "do not ..."), else +1: what the online tests judge with.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from slime_server.utils.net import find_free_port

HINT = "Answer in one short sentence."


def judge_app(seen: list[str]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "rule-judge", "object": "model", "created": 0, "owned_by": "t"}]}

    @app.post("/v1/chat/completions")
    def chat(body: dict) -> dict:
        text = body["messages"][-1]["content"]
        seen.append(text)
        nxt = text.split("User's next message:")[-1].lower()
        verdict = f"SCORE: -1\nHINT: {HINT}" if ("too long" in nxt or "do not" in nxt) else "SCORE: +1"
        return {"id": "j", "object": "chat.completion", "created": 0, "model": "rule-judge",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": verdict}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    return app


@contextmanager
def running_judge() -> Iterator[tuple[str, list[str]]]:
    """(base_url, texts the judge was asked about), served in a thread until the block ends."""
    seen: list[str] = []
    port = find_free_port()
    server = uvicorn.Server(uvicorn.Config(judge_app(seen), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1", seen
    finally:
        server.should_exit = True
        thread.join(10)
