"""An MoE model's routed experts recorded with every turn (issue 44): the real sgl-router in front of a CPU engine
serving the tiny Qwen3-MoE with ``--enable-return-routed-experts``, the gateway process recording, the real
``openai`` and ``anthropic`` SDKs (Chat Completions, plain and streamed, Responses, Messages). Each trajectory
holds the routes of all but its last token, a later turn extends them from where they ended (asking the engine
for the new positions only), they are the experts HF's router picks for the same tokens, and the export carries
them as slime's ``rollout_routed_experts``. An engine that does not answer routes is a 502 naming its flag."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import numpy as np
import pytest
import torch

from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from tests._engine_helpers import engine_process
from tests._gateway_helpers import (
    MODEL,
    GatewayProc,
    engine_and_router,
    new_session,
    openai_client,
    running_gateway,
)

NEAR_TIE = 1e-5  # router probabilities this close may be ordered either way by float rounding


@pytest.fixture(scope="module")
def moe_path() -> Path:
    from slime_server.models.tiny import ensure_tiny_model, tiny_moe_spec

    return ensure_tiny_model(spec=tiny_moe_spec())


@pytest.fixture(scope="module")
def moe_stack(moe_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, GatewayProc]]:
    d = tmp_path_factory.mktemp("moe-stack")
    with engine_and_router(moe_path, d, flags={"enable_return_routed_experts": True}) as router, \
            running_gateway(router, moe_path, d / "traj.db", d / "gateway.log",
                            settings={"record_routed_experts": True}) as gw:
        yield router, gw


@pytest.fixture(scope="module")
def moe_gateway(moe_stack: tuple[str, GatewayProc]) -> GatewayProc:
    return moe_stack[1]


def test_sgl_router_drops_the_routes_fields_so_the_gateway_calls_engines_itself(moe_stack) -> None:
    """Why gateway/direct_engines.py exists: through sgl-router 0.3.2 an engine that answers routes is never asked
    (the router's request type has no return_routed_experts); from the same engine, asked directly, they come."""
    router, _gw = moe_stack
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3}, "return_routed_experts": True}
    assert "routed_experts" not in httpx.post(f"{router}/generate", json=body, timeout=60).json()["meta_info"]
    (worker,) = [w["url"] for w in httpx.get(f"{router}/workers", timeout=30).json()["workers"]]
    assert "routed_experts" in httpx.post(f"{worker}/generate", json=body, timeout=60).json()["meta_info"]


def _trajectories(gw: GatewayProc, sid: str) -> list:
    store = SQLiteTrajectoryStore(str(gw.db_path))
    try:
        return store.get_trajectories(sid)
    finally:
        store.close()


def _hf_agrees(model, tokens: list[int], routes: np.ndarray) -> None:
    """``routes`` [len(tokens) - 1, layers, k] are HF's router's top-k for the same tokens (one prefill over them),
    wherever HF's k-th and next probabilities are not a near tie."""
    with torch.no_grad():
        out = model(torch.tensor([tokens[:-1]]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    probs = torch.stack([logits.float().softmax(-1) for logits in out.router_logits], dim=1)
    top = probs.topk(k + 1, dim=-1)
    clear = (top.values[..., k - 1] - top.values[..., k]) > NEAR_TIE
    assert clear.float().mean() > 0.99
    assert np.array_equal(routes[clear.numpy()], top.indices[..., :k][clear].numpy())


def test_every_api_records_routes_joined_across_turns(moe_gateway: GatewayProc, moe_path: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_path).eval()
    oa = openai_client(moe_gateway)
    kw = dict(model=MODEL, max_tokens=8, temperature=1.0)
    # Chat Completions: a first turn, then a streamed second turn that extends it
    chat = new_session(moe_gateway)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    first = oa.chat.completions.create(messages=messages, **kw, extra_headers={"X-Session-Id": chat})
    (after_one,) = _trajectories(moe_gateway, chat)
    one = after_one.routed_experts
    assert one is not None and one.positions == len(after_one.tokens) - 1 and (one.layers, one.topk) == (4, 2)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "And times 2?"}]
    list(oa.chat.completions.create(messages=messages, **kw, stream=True, extra_headers={"X-Session-Id": chat}))
    (after_two,) = _trajectories(moe_gateway, chat)
    two = after_two.routed_experts
    assert len(after_two.turns) == 2 and two.positions == len(after_two.tokens) - 1
    assert np.array_equal(two.array()[: one.positions], one.array())  # the first turn's routes kept as recorded
    # Responses and Messages record theirs alike
    responses = new_session(moe_gateway)
    oa.responses.create(model=MODEL, input="Say hi.", max_output_tokens=6, extra_headers={"X-Session-Id": responses})
    messages_api = new_session(moe_gateway)
    anthropic.Anthropic(base_url=moe_gateway.url, api_key="EMPTY", max_retries=0, timeout=120).messages.create(
        model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Count to 3."}],
        extra_headers={"X-Session-Id": messages_api})
    recorded = [after_two] + [t for sid in (responses, messages_api) for t in _trajectories(moe_gateway, sid)]
    assert len(recorded) == 3
    for traj in recorded:
        assert traj.routed_experts.positions == len(traj.tokens) - 1
        _hf_agrees(hf, traj.tokens, traj.routed_experts.array())
    # the export carries them as slime's field
    for sid in (chat, responses, messages_api):
        r = httpx.post(f"{moe_gateway.base_url}/sessions/{sid}/reward", json={"reward": 1.0}, timeout=30)
        assert r.status_code == 200, r.text
    from slime_server.buffer.export import export_jsonl, read_jsonl

    store = SQLiteTrajectoryStore(str(moe_gateway.db_path))
    try:
        export_jsonl(store, tmp_path / "out.jsonl")
    finally:
        store.close()
    by_tokens = {tuple(t.tokens): t for t in recorded}
    lines = read_jsonl(tmp_path / "out.jsonl")
    assert len(lines) == 3
    for line in lines:
        assert np.array_equal(np.array(line.rollout_routed_experts), by_tokens[tuple(line.tokens)].routed_experts.array())
    raw = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    assert isinstance(raw["rollout_routed_experts"][0][0][0], int)


def test_an_engine_that_answers_no_routes_is_a_502_naming_its_flag(moe_path: Path, tmp_path: Path) -> None:
    with engine_process(moe_path, tmp_path) as engine_url, \
            running_gateway(engine_url, moe_path, tmp_path / "traj.db", tmp_path / "gateway.log",
                            settings={"record_routed_experts": True}) as gw:
        r = httpx.post(f"{gw.base_url}/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 502 and "--enable-return-routed-experts" in r.json()["error"]["message"]
