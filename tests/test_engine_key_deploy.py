"""One engine key per deployment, SGLang's way: engines that listen beyond loopback get a generated key,
and every client of theirs (sgl-router, gateway, supervisor, trainer's weight pusher, the loop's pause and
version calls) sends it; an engine or gateway that would listen on the network unguarded refuses to start.

Real parts: Ray engine actors, the CPU engine process, the real sgl-router binary (given the key through its
own ``--api-key``), the gateway over real HTTP with the ``openai`` SDK.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slime_server.config import EngineSettings, GatewaySettings, RaySettings, ServerSettings
from slime_server.rollout.actors import EngineActor, EngineSpec
from slime_server.rollout.engine_auth import InsecureEngineError, auth_headers
from slime_server.server.launch import Deployment
from slime_server.utils.net import find_free_port, is_loopback
from tests._rollout_helpers import generate_body

pytestmark = pytest.mark.timeout(300)
UNAUTHORIZED = {"error": "Unauthorized"}


@pytest.fixture(scope="module")
def keyed(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    settings = ServerSettings(
        engine=EngineSettings(model=str(tiny_model_path), num_engines=1, host="0.0.0.0", num_cpus_per_engine=0.5,
                              startup_timeout_s=120),
        ray=RaySettings(num_cpus=2),
    )
    dep = Deployment.start(settings, log_dir=tmp_path_factory.mktemp("keyed"))
    yield dep
    dep.shutdown()


def test_key_generated_kept_private_and_out_of_ps(keyed: Deployment) -> None:
    key = keyed.engine_api_key
    assert key and len(key) >= 32
    key_file = keyed.log_dir / "engine_api_key"
    assert key_file.read_text() == key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    (url,) = keyed.engine_urls
    assert not is_loopback(httpx.URL(url).host)  # the node's address: reachable from the network
    # neither the engine nor the router shows the key on its command line (`ps` is readable by all users)
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            assert key.encode() not in cmdline, f"pid {proc.name} shows the engine key in its command line"


def test_engine_refuses_calls_without_the_key(keyed: Deployment) -> None:
    (url,) = keyed.engine_urls
    key = keyed.engine_api_key
    with httpx.Client(timeout=60) as c:
        for headers in ({}, auth_headers("wrong-key"), {"Authorization": key or ""}):
            r = c.post(f"{url}/generate", json=generate_body(), headers=headers)
            assert (r.status_code, r.json()) == (401, UNAUTHORIZED)
            r = c.post(f"{url}/update_weights_from_disk", json={"model_path": "/tmp/evil"}, headers=headers)
            assert (r.status_code, r.json()) == (401, UNAUTHORIZED)
            r = c.post(f"{url}/abort_request", json={"abort_all": True}, headers=headers)
            assert (r.status_code, r.json()) == (401, UNAUTHORIZED)
        assert c.get(f"{url}/health").status_code == 200  # probes stay open, as SGLang's
        r = c.post(f"{url}/generate", json=generate_body(), headers=auth_headers(key))
        assert r.status_code == 200 and len(r.json()["meta_info"]["output_token_logprobs"]) == 4


def test_router_demands_the_key_and_calls_engines_with_it(keyed: Deployment) -> None:
    key = keyed.engine_api_key
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{keyed.router_url}/generate", json=generate_body())
        assert r.status_code == 401, r.text
        r = c.post(f"{keyed.router_url}/generate", json=generate_body(), headers=auth_headers(key))
        assert r.status_code == 200, r.text  # the router reached the keyed engine: it sent the key
    assert keyed.router.worker_urls() == keyed.engine_urls  # its own client (worker API) sends the key


def test_gateway_serves_through_the_keyed_router(keyed: Deployment, tiny_model_path: Path, tmp_path: Path) -> None:
    from openai import OpenAI

    from slime_server.server.build import build_gateway
    from slime_server.server.gateway_thread import GatewayThread

    def chat(engine_api_key: str | None) -> tuple[int, str]:
        port = find_free_port()
        app = build_gateway(keyed.router_url, tiny_model_path,
                            GatewaySettings(port=port, db_path=str(tmp_path / f"{port}.db"), served_model_name="tiny"),
                            engine_api_key=engine_api_key)
        gw = GatewayThread(app, "127.0.0.1", port).start()
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            try:
                out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3)
                return 200, out.choices[0].finish_reason
            except Exception as e:  # noqa: BLE001 - the status is what the test reads
                return getattr(e, "status_code", -1), str(e)
        finally:
            gw.stop()

    assert chat(keyed.engine_api_key) == (200, "length")
    status, text = chat(None)  # the same gateway without the deployment's key is refused by the router
    assert status >= 500, text


def test_supervisor_loop_and_pusher_send_the_key(keyed: Deployment, tiny_model_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from slime_server.rollout.supervisor import EngineSupervisor
    from slime_server.trainer.loop import EngineControl
    from slime_server.trainer.weight_push import WeightPusher, WeightPushError

    key = keyed.engine_api_key
    sup = EngineSupervisor(lambda: keyed.engine_urls, keyed.router, api_key=key, health_interval_s=None)
    sup.tick()  # liveness through /model_info, which needs the key: a keyless probe would quarantine it
    assert sup.quarantined() == [] and sup.serving_urls() == keyed.engine_urls

    control = EngineControl(lambda: keyed.engine_urls, api_key=key)
    control.pause()
    control.resume()
    assert control.versions() == ["0"]
    assert EngineControl(lambda: keyed.engine_urls).versions() == [None]  # /model_info refused without it

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    with WeightPusher(keyed.engine_urls, mode="distributed", sender=True, api_key=key) as pusher:
        stats = pusher.push(model.named_parameters(), version="keyed-1")
    assert stats.sent and stats.mode == "distributed" and control.versions() == ["keyed-1"]
    with WeightPusher(keyed.engine_urls, mode="distributed", sender=True) as keyless, \
            pytest.raises(WeightPushError) as err:
        keyless.push(model.named_parameters(), version="keyless-2")
    assert "401" in str(err.value)
    assert control.versions() == ["keyed-1"]


def test_keyless_engine_beyond_loopback_refuses_to_start(tiny_model_path: Path, tmp_path: Path) -> None:
    port = find_free_port()
    cmd = [sys.executable, "-m", "slime_server.rollout.engine_server", "--model-path", str(tiny_model_path),
           "--host", "0.0.0.0", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "SLIME_SERVER_ENGINE_KEY"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0
    assert "refusing to start an engine on 0.0.0.0 without an API key" in r.stderr
    assert "--insecure-engines" in r.stderr

    port = find_free_port()
    log = tmp_path / "insecure.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*cmd[:-1], str(port), "--insecure-engines"], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    try:
        from slime_server.utils.net import wait_http_ok

        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout=120, proc=proc)
        assert httpx.post(f"http://127.0.0.1:{port}/generate", json=generate_body()).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
    assert "has no API key (--insecure-engines)" in log.read_text()


def test_engine_actor_refuses_a_keyless_sglang_engine_beyond_loopback() -> None:
    spec = EngineSpec(kind="sglang", model_path="/models/m", host="0.0.0.0")
    with pytest.raises(InsecureEngineError, match="--insecure-engines"):
        EngineActor(spec, start=False)
    EngineActor(spec.model_copy(update={"insecure": True}), start=False, monitor=False)
    keyed = EngineActor(spec.model_copy(update={"api_key": "k"}), start=False, monitor=False)
    cmd = keyed.command()
    assert cmd[cmd.index("--api-key") + 1] == "k"  # SGLang takes its key as --api-key


def test_gateway_beyond_loopback_needs_an_admin_key(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "slime_server.cli", "serve", "--host", "0.0.0.0", "--port", str(find_free_port()),
            "--db-path", str(tmp_path / "t.db"), "--num-engines", "0"]
    r = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "refusing to serve on 0.0.0.0 without an admin key" in r.stderr and "Traceback" not in r.stderr
    assert "--insecure-gateway" in r.stderr
    r = subprocess.run([*base, "--api-key", "agents-key"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "without an admin key" in r.stderr  # an agents' key is not an admin key

    from slime_server.api.auth import GatewayExposureError, check_bind

    assert check_bind("127.0.0.1", None, False) is False
    assert check_bind("0.0.0.0", "admin", False) is False
    assert check_bind("0.0.0.0", None, True) is True
    with pytest.raises(GatewayExposureError):
        check_bind("::", None, False)
