"""SGLang weight-sync paths against recording HTTP servers that stand in for SGLang (which needs a GPU).

The stand-ins are real HTTP servers; on ``/init_weights_update_group`` they really join the process
group (gloo here, NCCL on GPU) and on ``/update_weights_from_distributed`` they really receive the
broadcast tensors, so the test checks both the request bodies and the bytes that arrive.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
import torch.distributed as dist

from slime_server.trainer.sglang_weight_sync import (
    SGLangDistributedSync,
    SGLangTensorSync,
    deserialize_named_tensors,
    group_by_bytes,
)
from slime_server.trainer.weight_push import WeightPushError

pytestmark = pytest.mark.timeout(60)


class FakeSGLang:
    """Records every request; implements just enough of SGLang's weight-update side to be real."""

    def __init__(self, refuse_updates: bool = False) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.received: dict[str, torch.Tensor] = {}
        self.weight_version = "0"
        self.refuse_updates = refuse_updates
        self._pg: Any = None
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]

    def bodies(self, path: str) -> list[Any]:
        return [b for p, b in self.requests if p == path]

    def handle(self, path: str, body: Any) -> tuple[int, Any]:
        self.requests.append((path, body))
        if path == "/get_weight_version":
            return 200, {"weight_version": self.weight_version}
        if path in ("/pause_generation", "/continue_generation", "/flush_cache"):
            return 200, {"status": "ok"}
        if path == "/init_weights_update_group":
            store = dist.TCPStore(body["master_address"], body["master_port"], body["world_size"], False,
                                  timeout=timedelta(seconds=30))
            prefixed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{body['group_name']}/", store))
            self._pg = dist.ProcessGroupGloo(prefixed, body["rank_offset"], body["world_size"],
                                             timedelta(seconds=30))
            return 200, {"success": True, "message": "joined"}
        if path == "/update_weights_from_distributed":
            for name, dt, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                t = torch.empty(shape, dtype=getattr(torch, dt))
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                self._pg.broadcast([t], opts).wait()
                self.received[name] = t
            return self._updated(body)
        if path == "/update_weights_from_tensor":
            if self.refuse_updates:
                return 400, {"success": False, "message": "model has no such parameter"}
            per_rank = [dict(deserialize_named_tensors(x)) for x in body["serialized_named_tensors"]]
            for name, t in per_rank[0].items():  # every TP rank must see the same tensors
                assert all(torch.equal(r[name], t) for r in per_rank[1:]), name
                self.received[name] = t.clone()
            return self._updated(body)
        return 404, {"error": {"message": f"no route {path}"}}

    def _updated(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "ok"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, out = fake.handle(self.path, json.loads(raw) if raw else None)
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _serve

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def fakes() -> Iterator[list[FakeSGLang]]:
    servers = [FakeSGLang(), FakeSGLang()]
    yield servers
    for s in servers:
        s.close()


def model_like_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (64, 16), "model.layers.0.self_attn.q_proj.weight": (16, 16),
              "model.layers.0.mlp.down_proj.weight": (16, 32), "model.norm.weight": (16,)}
    out = [(n, torch.randn(s, generator=gen)) for n, s in shapes.items()]
    out.append(("model.layers.0.input_layernorm.weight", torch.randn(16, generator=gen).to(torch.bfloat16)))
    return out


def test_group_by_bytes():
    named = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("c", torch.zeros(30)), ("d", torch.zeros(1))]
    groups = [[n for n, _ in g] for g in group_by_bytes(named, 80)]
    assert groups == [["a", "b"], ["c"], ["d"]]


def test_distributed_sync_bodies_and_broadcast(fakes):
    named = model_like_tensors()
    sync = SGLangDistributedSync([f.url for f in fakes], engine_gpus=1, group_name="slime-test", backend="gloo",
                                 bucket_bytes=4096, timeout=30)
    try:
        sync.connect()
        stats = sync.push(iter(named), version=5)
    finally:
        sync.close()
    port = sync.master_port
    for i, fake in enumerate(fakes):
        assert fake.bodies("/init_weights_update_group") == [{
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1 + i, "world_size": 3,
            "group_name": "slime-test", "backend": "gloo"}]
        updates = fake.bodies("/update_weights_from_distributed")
        assert [u["names"] for u in updates] == [["model.embed_tokens.weight"],
                                                 [n for n, _ in named[1:]]]
        assert updates[1]["dtypes"] == ["float32", "float32", "float32", "bfloat16"]
        assert updates[1]["shapes"] == [[16, 16], [16, 32], [16], [16]]
        assert [(u["group_name"], u["flush_cache"], u["weight_version"]) for u in updates] == [
            ("slime-test", False, None), ("slime-test", True, "5")]
        assert set(updates[0]) == {"names", "dtypes", "shapes", "group_name", "flush_cache",
                                   "abort_all_requests", "weight_version"}
        assert fake.paths() == ["/init_weights_update_group", "/pause_generation", "/flush_cache",
                                "/update_weights_from_distributed", "/update_weights_from_distributed",
                                "/continue_generation", "/get_weight_version"]
        assert fake.bodies("/pause_generation") == [{"mode": "retract"}]
        for name, t in named:  # the bytes really arrived through the group
            assert torch.equal(fake.received[name], t), name
    assert stats.buckets == 2 and stats.tensors == 5 and stats.version == "5"
    assert [e.weight_version for e in stats.engines] == ["5", "5"]


def test_distributed_sync_rank_offsets_for_multi_gpu_engines():
    sync = SGLangDistributedSync(["http://a:1", "http://b:2", "http://c:3"], engine_gpus=[2, 4, 1],
                                 master_port=29500)
    try:
        reqs = sync.init_requests()
    finally:
        sync.close()
    assert [(r.rank_offset, r.world_size) for r in reqs] == [(1, 8), (3, 8), (7, 8)]
    assert {r.backend for r in reqs} == {"nccl"}


def test_push_before_connect_is_refused(fakes):
    sync = SGLangDistributedSync([fakes[0].url])
    try:
        with pytest.raises(RuntimeError, match="connect"):
            sync.push(iter(model_like_tensors()), version=1)
    finally:
        sync.close()


def test_tensor_sync_bodies_and_payload(fakes):
    named = model_like_tensors(seed=1)
    sync = SGLangTensorSync([f.url for f in fakes], engine_tp=2, bucket_bytes=4096, pause_mode="abort")
    try:
        stats = sync.push(iter(named), version="v9")
    finally:
        sync.close()
    for fake in fakes:
        assert fake.paths() == ["/pause_generation", "/flush_cache", "/update_weights_from_tensor",
                                "/update_weights_from_tensor", "/continue_generation", "/get_weight_version"]
        assert fake.bodies("/pause_generation") == [{"mode": "abort"}]
        updates = fake.bodies("/update_weights_from_tensor")
        assert [(u["load_format"], u["flush_cache"], u["weight_version"]) for u in updates] == [
            (None, False, None), (None, True, "v9")]
        assert set(updates[0]) == {"serialized_named_tensors", "load_format", "flush_cache",
                                   "abort_all_requests", "weight_version"}
        for u in updates:  # one payload per engine TP rank, each a str
            assert len(u["serialized_named_tensors"]) == 2 and all(isinstance(x, str) for x in
                                                                   u["serialized_named_tensors"])
        for name, t in named:
            assert torch.equal(fake.received[name], t), name
    assert stats.buckets == 2 and [e.weight_version for e in stats.engines] == ["v9", "v9"]


def test_tensor_sync_failure_is_reported_and_generation_resumes():
    ok, bad = FakeSGLang(), FakeSGLang(refuse_updates=True)
    sync = SGLangTensorSync([ok.url, bad.url])
    try:
        with pytest.raises(WeightPushError) as err:
            sync.push(iter(model_like_tensors()), version=3)
    finally:
        sync.close()
        ok.close()
        bad.close()
    assert list(err.value.errors) == [bad.url] and "no such parameter" in err.value.errors[bad.url]
    assert err.value.versions == {ok.url: "3", bad.url: "0"}
    assert bad.paths()[-2:] == ["/continue_generation", "/get_weight_version"]
