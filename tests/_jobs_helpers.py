"""Driving a running server's jobs over REST (admin and agent keys, episodes, waiting for a job's state or
event), shared by the modules that run jobs end to end."""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from slime_server.utils.net import tls_context

ADMIN = "admin-key"
AGENT = "agent-key"


def stack_settings(model: Path, work: Path, *, engines: int = 1, keys: bool = True,
                   **sections: dict[str, Any]) -> Any:
    """``serve``'s settings for a test: ``model`` on ``engines`` CPU engines, a local Ray of 3 CPUs, the
    store and job files under ``work``, a free port, these helpers' admin and agent keys unless ``keys`` is
    False; each of ``sections`` (``ray={...}``) is merged into its section."""
    from slime_server.config import load_settings

    tree: dict[str, dict[str, Any]] = {
        "engine": {"model": str(model), "num_engines": engines},
        "ray": {"num_cpus": 3},
        "trainer": {"work_dir": str(work / "jobs")},
        "gateway": {"port": 0, "db_path": str(work / "db.sqlite"),
                    **({"api_key": AGENT, "admin_api_key": ADMIN} if keys else {})},
    }
    for name, values in sections.items():
        tree[name] = {**tree.get(name, {}), **values}
    return load_settings(None, tree)


def start_stack(model: Path, work: Path, **kw: Any) -> Any:
    """The whole stack of ``serve`` (engines, sgl-router, gateway, job manager) in this process; ``.stop()``
    it. Keyword arguments as for ``stack_settings``."""
    from slime_server.server.serve_cmd import start_server

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    settings = stack_settings(model, work, **kw)
    return start_server(settings, settings.gateway, work / "logs")


@contextmanager
def running_stack(model: Path, work: Path, **kw: Any) -> Iterator[Any]:
    running = start_stack(model, work, **kw)
    try:
        yield running
    finally:
        running.stop()


def admin(server: Any) -> httpx.Client:
    return httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=300,
                        headers={"Authorization": f"Bearer {ADMIN}"}, verify=tls_context())


def rest(server: Any) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=120, headers={"Authorization": f"Bearer {AGENT}"},
                        verify=tls_context())


def create_paced(client: OpenAI, timeout: float = 300, **kw: Any) -> Any:
    """``chat.completions.create`` as a well-behaved agent calls it while a job trains: a 429 of buffer pacing
    (the trainer is behind) is waited out for its Retry-After, as the built-in runner does; any other error
    raises. ``client`` must not retry on its own (``max_retries=0``), so that other errors surface."""
    from openai import RateLimitError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.chat.completions.create(**kw)
        except RateLimitError as e:
            assert "buffer is full" in str(e) and time.monotonic() < deadline, e
            time.sleep(float(e.response.headers.get("retry-after", "1")))


def episode(server: Any, i: int, *, metadata: dict[str, str] | None = None) -> str:
    """One session: a chat turn through the OpenAI SDK (waiting out buffer pacing), a reward, close. Returns
    the session id."""
    sid = f"ep-{uuid.uuid4().hex[:12]}"
    client = OpenAI(base_url=server.base_url, api_key=AGENT, default_headers={"X-Session-Id": sid}, max_retries=0)
    r = create_paced(client, model=Path(server.deployment.model_path).name, max_tokens=6, temperature=1.0,
                                       messages=[{"role": "user", "content": f"Count to {i % 7}."}], seed=i,
                                       metadata=metadata)
    text = r.choices[0].message.content or ""
    with rest(server) as c:
        c.post(f"/sessions/{sid}/reward", json={"reward": float(len(text) % 3 == 0) + random.random() * 0.1}
               ).raise_for_status()
        c.post(f"/sessions/{sid}/close").raise_for_status()
    return sid


def drive(server: Any, n: int, concurrency: int = 4) -> list[str]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda i: episode(server, i), range(n)))


def create_job(server: Any, pacing: dict[str, Any] | None = None, loss: dict[str, Any] | None = None,
               algorithm: str = "reinforce_plus_plus", lora: dict[str, Any] | None = None, **loop: Any) -> dict[str, Any]:
    body = {"name": "test", "algorithm": algorithm, "optimizer": {"lr": 1e-3},
            "loop": {"batch_size": 4, "checkpoint_interval": 2, "poll_interval_s": 0.05, **loop},
            "pacing": pacing or {}, "loss": loss or {}, **({"lora": lora} if lora else {})}
    with admin(server) as c:
        r = c.post("/jobs", json=body)
        assert r.status_code == 200, r.text
        return r.json()


def job(server: Any, job_id: str) -> dict[str, Any]:
    with admin(server) as c:
        return c.get(f"/jobs/{job_id}").raise_for_status().json()


def wait_job(server: Any, job_id: str, pred, timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        j = job(server, job_id)
        if pred(j):
            return j
        assert j["status"] not in ("failed",), j["error"]
        if time.monotonic() > deadline:
            store = server.gateway.server.config.app.state.gw.store
            pool = [(t.id[-6:], t.status, t.reward, t.consumed_step, sorted({v for v, m in zip(t.weight_versions, t.loss_mask, strict=True) if m}))
                    for t in store.list_trajectories(limit=10_000)][-30:]
            raise AssertionError(f"timed out; job is {j}; stats {store.stats()}; last trajectories {pool}")
        time.sleep(0.2)


def drain_pool(server: Any) -> None:
    """Earlier tests' unused data must not blur exact counts: take it out of the pool (it stays stored)."""
    store = server.gateway.server.config.app.state.gw.store
    store.mark_consumed([t.id for t in store.list_trajectories(unconsumed=True, limit=10_000)], -1)


def wait_event(server: Any, job_id: str, kind: str, timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        with admin(server) as c:
            found = [e for e in job_events(c, job_id) if e["kind"] == kind]
        if found:
            return found[-1]
        assert time.monotonic() < deadline, f"no {kind!r} event"
        time.sleep(0.3)


def cancel(server: Any, job_id: str) -> dict[str, Any]:
    with admin(server) as c:
        r = c.post(f"/jobs/{job_id}/cancel")
        assert r.status_code == 200, r.text
        return r.json()


def engine_versions(server: Any) -> list[str]:
    return [httpx.get(f"{u}/model_info", timeout=10, verify=tls_context()).json()["weight_version"]
            for u in server.deployment.engine_urls]


def store_trajectories(server: Any, session_ids: list[str]) -> list[Any]:
    store = server.gateway.server.config.app.state.gw.store
    return [t for sid in session_ids for t in store.get_trajectories(sid)]


def job_events(c: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    """The job's stored events so far (the SSE endpoint without following)."""
    with c.stream("GET", f"/jobs/{job_id}/events", params={"follow": "false"}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
