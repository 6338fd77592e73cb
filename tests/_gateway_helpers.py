"""Real stack for the gateway tests: one CPU engine, the real sgl-router, the gateway process.

Each gateway runs as its own process on a real port (so tests can ``kill -9`` it), with its own
SQLite file; the engine and router are shared by a test module.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from slime_server.rollout.owned import start_retrying
from slime_server.utils.net import find_free_port, wait_http_ok
from slime_server.utils.procs import kill_group, python_module_cmd, spawn

MODEL = "tiny"


@dataclass
class GatewayProc:
    url: str
    proc: subprocess.Popen
    db_path: Path
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


def start_gateway(router_url: str, model_path: Path, db_path: Path, log_path: Path,
                  *extra: str, settings: dict | None = None) -> GatewayProc:
    """``slime-server gateway`` on a free port; ``settings``: more of the gateway section (limits, CORS, ...),
    given as the user would, in a ``--config`` YAML file beside the log."""
    config: list[str] = []
    if settings:
        path = log_path.with_suffix(".settings.yaml")
        path.write_text(yaml.safe_dump({"gateway": settings}))
        config = ["--config", str(path)]
    started: dict[str, Any] = {}

    def launch() -> None:  # a fresh port each try: another process may take the one chosen before we bind it
        port = find_free_port()
        cmd = python_module_cmd("slime_server.cli", "gateway", "--router-url", router_url, "--model-path",
                                str(model_path), "--db-path", str(db_path), "--port", str(port),
                                "--served-model-name", MODEL, *config, *extra)
        started.update(url=f"http://127.0.0.1:{port}",
                       proc=spawn(cmd, env={"OMP_NUM_THREADS": "1"}, log_path=str(log_path)))

    def port_taken() -> bool:
        return "address already in use" in log_path.read_text(errors="replace").lower()

    try:
        start_retrying(launch, lambda: wait_http_ok(f"{started['url']}/health", timeout=90, proc=started["proc"]),
                       lambda: kill_group(started["proc"]), port_taken)
    except Exception:
        if "proc" in started:
            kill_group(started["proc"])
        raise RuntimeError(f"gateway did not start:\n{log_path.read_text()[-3000:]}") from None
    url, proc = started["url"], started["proc"]
    return GatewayProc(url, proc, db_path, log_path)


def stop_gateway(gw: GatewayProc) -> None:
    kill_group(gw.proc, timeout=5)


@contextmanager
def running_gateway(router_url: str, model_path: Path, db_path: Path, log_path: Path, *extra: str,
                    settings: dict | None = None) -> Iterator[GatewayProc]:
    """``start_gateway`` for the length of a ``with`` block (a fixture's whole set-up and teardown)."""
    gw = start_gateway(router_url, model_path, db_path, log_path, *extra, settings=settings)
    try:
        yield gw
    finally:
        stop_gateway(gw)


@contextmanager
def inprocess_gateway(router_url: str, model_path: Path, db_path: Path) -> Iterator[tuple[str, object]]:
    """The gateway app (``api/server.build_gateway``) served by uvicorn on a thread of this process (as ``serve``
    runs it); yields (base URL, app) for tests that reach into it (attach a JobManager, watch its store)."""
    from slime_server.config import GatewaySettings
    from slime_server.server.build import build_gateway
    from slime_server.server.gateway_thread import GatewayThread
    from slime_server.utils.net import find_free_port

    port = find_free_port()
    app = build_gateway(router_url, model_path, GatewaySettings(port=port, db_path=str(db_path),
                                                                served_model_name=MODEL))
    server = GatewayThread(app, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.stop()


@contextmanager
def engine_and_router(model_path: Path, log_dir: Path, flags: dict | None = None) -> Iterator[str]:
    """One CPU engine serving ``model_path`` behind the real sgl-router; yields the router URL. ``flags``: the
    engine's optional serving flags by SGLang's names (``EngineSpec.lora``)."""
    from slime_server.config import RouterSettings
    from slime_server.rollout.actors import EngineActor, EngineSpec
    from slime_server.rollout.router import RouterProcess

    engine = EngineActor(EngineSpec(model_path=str(model_path), log_path=str(log_dir / "engine.log"),
                                    startup_timeout_s=120, lora=flags or {}), start=False, monitor=False)
    engine.start()
    try:
        with RouterProcess(RouterSettings(policy="round_robin"), log_path=log_dir / "router.log") as router:
            router.start(worker_urls=[engine.url()])
            deadline = time.monotonic() + 60
            while not router.worker_urls(healthy_only=True) and time.monotonic() < deadline:
                time.sleep(0.2)
            yield router.url
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def router_url(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One CPU engine serving the tiny model behind the real sgl-router, shared by every module that does
    not bring its own (starting one costs seconds; a test that pauses or aborts it resumes it)."""
    with engine_and_router(tiny_model_path, tmp_path_factory.mktemp("stack")) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(router_url: str, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    d = tmp_path_factory.mktemp("gateway")
    with running_gateway(router_url, tiny_model_path, d / "traj.db", d / "gateway.log") as gw:
        yield gw


@pytest.fixture(scope="session")
def tool_model(tiny_model_path: Path) -> Path:
    """The tiny model fine-tuned to call ``get_weather`` (built once per machine, cached)."""
    return cached_tool_model(tiny_model_path)


@pytest.fixture(scope="session")
def tool_router_url(tool_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One CPU engine serving the tool model behind the real sgl-router, shared by every module."""
    with engine_and_router(tool_model, tmp_path_factory.mktemp("tool-stack")) as url:
        yield url


@pytest.fixture(scope="session")
def tool_gateway(tool_router_url: str, tool_model: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    """The gateway process over ``tool_router_url``, shared by every module that drives the tool model
    (each test opens its own sessions, so none sees another's)."""
    d = tmp_path_factory.mktemp("tool-gateway")
    with running_gateway(tool_router_url, tool_model, d / "traj.db", d / "gateway.log") as gw:
        yield gw


def openai_client(gw: GatewayProc, api_key: str = "EMPTY", **kw):
    import openai

    return openai.OpenAI(base_url=gw.base_url, api_key=api_key, max_retries=0, timeout=120, **kw)


def new_session(gw: GatewayProc, **body) -> str:
    """A fresh session id from the sessions REST API (``body``: its fields, e.g. ``group_id``)."""
    import httpx

    r = httpx.post(f"{gw.base_url}/sessions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def session_trajectories(gw: GatewayProc, sid: str) -> list[dict]:
    import httpx

    r = httpx.get(f"{gw.base_url}/sessions/{sid}/trajectory", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def check_mask(traj: dict, n_turns: int) -> None:
    """Loss mask 1 exactly on the generated spans, each with an engine logprob."""
    assert len(traj["turns"]) == n_turns
    generated = [i for t in traj["turns"] for i in range(t["output_start"], t["output_end"])]
    assert [i for i, m in enumerate(traj["loss_mask"]) if m] == generated
    assert all(traj["rollout_logprobs"][i] <= 0.0 for i in generated)


def check_one_turn(gw: GatewayProc, sid: str, input_tokens: int, output_tokens: int) -> None:
    """The session holds one trajectory of one turn, whose prompt and output are exactly as many tokens as the
    API's usage said, with the loss mask on the output alone."""
    (traj,) = session_trajectories(gw, sid)
    check_mask(traj, 1)
    (turn,) = traj["turns"]
    assert turn["output_start"] == input_tokens
    assert turn["output_end"] - turn["output_start"] == output_tokens


os.environ.setdefault("OMP_NUM_THREADS", "1")


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_USER = "What is the weather in Paris?"
TOOL_ARGS = '{"city": "Paris"}'
TOOL_RESULT = '{"temp_c": 21, "sky": "sunny"}'
FINAL_ANSWER = "It is sunny and 21 C in Paris."


def tool_conversation() -> list[dict]:
    return [
        {"role": "user", "content": TOOL_USER},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": TOOL_ARGS}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": TOOL_RESULT},
        {"role": "assistant", "content": FINAL_ANSWER},
    ]


TOOL_MODEL_VERSION = "2"


def cached_tool_model(base: Path) -> Path:
    """``train_tool_model`` once per machine (it takes ~30 s of CPU), cached beside the tiny model."""
    import fcntl
    import shutil
    import tempfile

    out = base.parent / f"{base.name}-gateway-tool-v{TOOL_MODEL_VERSION}"
    with open(base.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=base.parent))
            train_tool_model(base, tmp)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    return out


def train_tool_model(base: Path, out: Path, steps: int = 80) -> Path:
    """Fine-tune the tiny model for a few steps to emit the weather call for the weather question.

    Why: a random tiny model never writes a well-formed call; overfitting one conversation gives a
    real model whose greedy output is a real call, so the tool path is tested end to end.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base))
    conv = tool_conversation()
    ids: list[int] = []
    mask: list[int] = []
    # the assistant's call, trained in its rendered context; also with the tool as the OpenAI Agents SDK
    # sends it (an explicit "strict": false), so the client tests see a real call from that SDK too
    agents_sdk_tool = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": False}}
    for k, tool in ((1, WEATHER_TOOL), (1, agents_sdk_tool)):
        ctx = tok.apply_chat_template(conv[:k], tools=[tool], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(conv[: k + 1], tools=[tool], tokenize=False)
        assert full.startswith(ctx)
        c = tok.encode(ctx, add_special_tokens=False)
        target = tok.encode(full[len(ctx):].rstrip("\n"), add_special_tokens=False)
        ids.append(c + target)
        mask.append(len(c))
    torch.set_num_threads(2)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    for _ in range(steps):
        loss = torch.zeros(())
        for seq, start in zip(ids, mask, strict=True):
            x = torch.tensor([seq])
            labels = x.clone()
            labels[0, :start] = -100
            loss = loss + model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if float(loss.detach()) < 0.05:
            break
    model.eval()
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out
