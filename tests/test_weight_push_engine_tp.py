"""The pusher learns each engine's TP size from SGLang's ``GET /server_info`` (``tp_size``, a ``ServerArgs`` field):
an SGLang engine started with ``--tp-size 2`` indexes ``serialized_named_tensors`` by its TP rank, so it must get
two payloads (and two ranks in a weight-update group). The engine here stands in for such an SGLang server: it
answers the four routes the tensor path calls and records what arrives (the pusher is the unit under test; our
own CPU engine runs TP 1 and is covered by test_weight_push.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest
import torch

from slime_server.trainer.weight_push import WeightPusher
from tests._json_http import JsonHandler


class _Engine:
    def __init__(self, tp: int | None) -> None:
        self.tp = tp
        self.version = "0"
        self.payload_counts: list[int] = []
        self.server_info_calls = 0


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[str, _Engine]]:
    state = _Engine(request.param)

    class Handler(JsonHandler):
        def do_GET(self) -> None:
            if self.path == "/model_info":
                self.answer(200, {"weight_version": state.version})
            elif self.path == "/server_info":
                state.server_info_calls += 1
                self.answer(200, {} if state.tp is None else {"tp_size": state.tp})
            else:
                self.answer(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            body = self.read_json()
            if self.path == "/update_weights_from_tensor":
                state.payload_counts.append(len(body["serialized_named_tensors"]))
                if body.get("weight_version"):
                    state.version = body["weight_version"]
            self.answer(200, {"success": True, "message": ""})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


NAMED = [("a", torch.randn(64, 64)), ("b", torch.randn(64)), ("c", torch.randn(128, 64))]


@pytest.mark.parametrize(("engine", "want"), [(2, 2), (1, 1), (None, 1)], indirect=["engine"],
                         ids=["tp2", "tp1", "no-tp_size"])
def test_one_payload_per_engine_tp_rank_from_server_info(engine: tuple[str, _Engine], want: int) -> None:
    url, state = engine
    with WeightPusher([url], bucket_bytes=20_000, mode="tensor", sender=True) as pusher:
        stats = pusher.push(NAMED, version=1)
        pusher.push(NAMED, version=2)
    assert stats.buckets > 1 and state.version == "2"
    assert state.payload_counts == [want] * (2 * stats.buckets)
    # read once when the engine says; asked again at each push when it does not
    assert state.server_info_calls == (2 if state.tp is None else 1)


@pytest.mark.parametrize("engine", [2], indirect=True)
def test_an_explicit_engine_tp_is_not_read(engine: tuple[str, _Engine]) -> None:
    url, state = engine
    with WeightPusher([url], bucket_bytes=1 << 20, mode="tensor", sender=True, engine_tp=3) as pusher:
        pusher.push(NAMED, version=1)
    assert state.payload_counts == [3] and state.server_info_calls == 0
