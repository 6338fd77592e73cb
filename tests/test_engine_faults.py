"""An engine killed with ``kill -9`` under load (issue 9, "Faults"): the router stops sending to it,
no request hangs (each one is answered, or fails with a clear 503), the actor restarts the engine,
and the supervisor lets it back into the router only once it serves the current weights.

Real parts: two CPU engine processes owned by engine actors (with their restart monitor), the real
sgl-router, the gateway process, the `openai` SDK as clients, a real bucketed weight push for the
catch-up (the job's trainer does that push in `serve`; here a pusher holds the "current" weights).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from _gateway_helpers import MODEL, start_gateway, stop_gateway

from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.config import RouterSettings
from slime_server.rollout.actors import EngineActor, EngineSpec
from slime_server.rollout.engine_info import engine_weight_version
from slime_server.rollout.router import RouterProcess
from slime_server.rollout.supervisor import EngineSupervisor
from slime_server.trainer.weight_push import WeightPusher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
CURRENT = "7"  # the version the serving engines are on; a restarted engine comes back on "0"


def _served_version(url: str) -> str | None:
    with httpx.Client(timeout=10) as c:
        return engine_weight_version(c, url)


def _perturbed_weights(model_path: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    base: dict = {}
    for f in sorted(model_path.glob("*.safetensors")):
        base.update(load_file(str(f)))
    gen = torch.Generator().manual_seed(1)
    return {k: v + 1e-3 * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point() else v
            for k, v in base.items()}


def _client_loop(base_url: str, stop: threading.Event, out: list[tuple[float, float, str]]) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=60)
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}],
                                           max_tokens=8, temperature=1.0)
            outcome = "ok"
        except openai.APIStatusError as e:
            body = e.body if isinstance(e.body, dict) else {}
            outcome = f"{e.status_code}:{body.get('code')}"
        except Exception as e:  # noqa: BLE001 - a timeout or a dropped connection is what must not happen
            outcome = f"{type(e).__name__}"
        out.append((t0, time.monotonic(), outcome))


def test_kill_9_engine_under_load(tiny_model_path: Path, tmp_path: Path) -> None:
    weights = _perturbed_weights(tiny_model_path)
    actors = [EngineActor(EngineSpec(model_path=str(tiny_model_path), log_path=str(tmp_path / f"engine{i}.log"),
                                     health_interval_s=1.0, startup_timeout_s=120), start=False) for i in range(2)]
    gw = supervisor = None
    try:
        for a in actors:
            a.start()
        urls = [a.url() for a in actors]
        with RouterProcess(RouterSettings(), log_path=tmp_path / "router.log") as router, \
                WeightPusher(urls, rolling=True, sender=True) as pusher:
            router.start(worker_urls=urls)
            deadline = time.monotonic() + 60
            while len(router.worker_urls(healthy_only=True)) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            pusher.push(iter(weights.items()), version=CURRENT)  # both engines serve version 7

            def catch_up(url: str) -> bool:
                with WeightPusher([url], sender=True) as one:
                    one.push(iter(weights.items()), version=CURRENT)
                return True

            supervisor = EngineSupervisor(lambda: urls, router, interval_s=0.3, catch_up=catch_up).start()
            gw = start_gateway(router.url, tiny_model_path, tmp_path / "traj.db", tmp_path / "gateway.log")

            stop, results = threading.Event(), [[] for _ in range(4)]
            clients = [threading.Thread(target=_client_loop, args=(gw.base_url, stop, r), daemon=True)
                       for r in results]
            for c in clients:
                c.start()
            time.sleep(3.0)
            victim_pid = actors[0].pid()
            killed_at = time.monotonic()
            os.kill(victim_pid, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while ("readmitted", urls[0]) not in supervisor.events and time.monotonic() < deadline:
                time.sleep(0.2)
            readmitted_at = time.monotonic()
            time.sleep(3.0)  # traffic over both engines again
            stop.set()
            for c in clients:
                c.join(timeout=90)
            assert not any(c.is_alive() for c in clients), "a client hung"

            events = supervisor.events
            print("supervisor events:", events, f"recovered in {readmitted_at - killed_at:.1f} s")
            assert events.index(("quarantined", urls[0])) < events.index(("caught_up", urls[0])) \
                < events.index(("readmitted", urls[0]))
            assert actors[0].restarts == 1 and actors[0].pid() != victim_pid
            assert _served_version(urls[0]) == CURRENT
            assert sorted(router.worker_urls(healthy_only=True)) == sorted(urls)

            outcomes = [o for r in results for (_, _, o) in r]
            after = [o for r in results for (t0, _, o) in r if t0 > readmitted_at]
            failures = [o for o in outcomes if o != "ok"]
            print(f"{len(outcomes)} requests, {len(failures)} failed: {sorted(set(failures))}")
            assert outcomes.count("ok") >= 20 and after and all(o == "ok" for o in after)
            # never a hang or a dropped connection: anything that failed is a clear 503 in OpenAI format
            assert all(o.startswith("503:engine_") for o in failures), failures
            assert max(t1 - t0 for r in results for (t0, t1, _) in r) < 60

        # nothing was ever served from the restarted engine's stale (version 0) weights
        store = SQLiteTrajectoryStore(tmp_path / "traj.db")
        versions = {v for t in store.iter_trajectories(status=None)
                    for v, m in zip(t.weight_versions, t.loss_mask, strict=True) if m}
        assert versions == {int(CURRENT)}, versions
    finally:
        if supervisor is not None:
            supervisor.stop()
        if gw is not None:
            stop_gateway(gw)
        for a in actors:
            a.stop()


def test_without_a_trainer_a_restarted_engine_waits_for_the_served_version(tiny_model_path: Path,
                                                                          tmp_path: Path) -> None:
    """The only engine dies (so no other engine tells the version) and no job can catch it up: it
    stays out of the router until something serves it the version last seen, then comes back."""
    weights = _perturbed_weights(tiny_model_path)
    actor = EngineActor(EngineSpec(model_path=str(tiny_model_path), log_path=str(tmp_path / "engine.log"),
                                   health_interval_s=1.0, startup_timeout_s=120))
    supervisor = None
    try:
        url = actor.url()
        with RouterProcess(RouterSettings(), log_path=tmp_path / "router.log") as router:
            router.start(worker_urls=[url])
            with WeightPusher([url], sender=True) as pusher:
                pusher.push(iter(weights.items()), version=CURRENT)
            supervisor = EngineSupervisor(lambda: [url], router, interval_s=0.3).start()
            time.sleep(1.0)  # a tick has seen version 7 served
            os.kill(actor.pid(), signal.SIGKILL)
            deadline = time.monotonic() + 60
            while ("kept_out", url) not in supervisor.events and time.monotonic() < deadline:
                time.sleep(0.2)
            assert ("kept_out", url) in supervisor.events and url not in router.worker_urls()
            assert _served_version(url) == "0"  # restarted, base weights
            with WeightPusher([url], sender=True) as pusher:  # e.g. an operator's push, or the next job's
                pusher.push(iter(weights.items()), version=CURRENT)
            while ("readmitted", url) not in supervisor.events and time.monotonic() < deadline:
                time.sleep(0.2)
            assert router.worker_urls(healthy_only=True) == [url]
    finally:
        if supervisor is not None:
            supervisor.stop()
        actor.stop()
