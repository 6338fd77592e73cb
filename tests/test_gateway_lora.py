"""LoRA adapters through /v1 (issue 43): ``model: "<served>:<adapter>"`` (SGLang's convention) in the three APIs
reaches the engines as ``lora_path`` through the real sgl-router, the answer is the adapter's, each recorded turn
names the adapter that generated it, ``/v1/models`` lists the adapters (asked of an engine behind the router), and
an adapter the engines lack is a 404 in each API's own error shape, a stream's included."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests._jobs_helpers import running_stack
from tests.test_engine_lora import _save_adapter

ASK = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``serve``'s stack (engines as Ray actors, sgl-router, gateway) with ``engine.lora_paths`` set, as
    ``serve --lora-paths full=DIR`` sets it."""
    tmp = tmp_path_factory.mktemp("gateway-lora")
    adapter = _save_adapter(tiny_model_path, tmp / "full", 1, r=8, lora_alpha=16, target_modules="all-linear")
    with running_stack(tiny_model_path, tmp, keys=False, engine={"lora_paths": f"full={adapter}"}) as server:
        yield Stack(base_url=server.base_url, url=server.base_url.removesuffix("/v1"),
                    model=Path(server.deployment.model_path).name)


@dataclass
class Stack:
    base_url: str
    url: str
    model: str


def _turns(gw: Any, session: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{gw.url}/v1/sessions/{session}/trajectory", timeout=30)
    r.raise_for_status()
    return [turn for traj in r.json() for turn in traj["turns"]]


def test_chat_completions_answer_with_the_named_adapter(gateway: Any) -> None:
    oa = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
    base = oa.chat.completions.create(model=gateway.model, messages=ASK, **GREEDY, logprobs=True,
                                      extra_headers={"X-Session-Id": "lora-base"})
    tuned = oa.chat.completions.create(model=f"{gateway.model}:full", messages=ASK, **GREEDY, logprobs=True,
                                       extra_headers={"X-Session-Id": "lora-full"})
    lp = [[t.logprob for t in r.choices[0].logprobs.content] for r in (base, tuned)]
    assert lp[0] != lp[1], "the adapter must change what is generated"
    streamed = oa.chat.completions.create(model=f"{gateway.model}:full", messages=ASK, **GREEDY, stream=True,
                                          extra_headers={"X-Session-Id": "lora-stream"})
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == tuned.choices[0].message.content
    assert [t["lora_adapter"] for t in _turns(gateway, "lora-base")] == [None]
    assert [t["lora_adapter"] for t in _turns(gateway, "lora-full")] == ["full"]
    assert [t["lora_adapter"] for t in _turns(gateway, "lora-stream")] == ["full"]


def test_responses_messages_and_completions_take_the_adapter_too(gateway: Any) -> None:
    oa = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
    chat = oa.chat.completions.create(model=f"{gateway.model}:full", messages=ASK, **GREEDY).choices[0].message.content
    resp = oa.responses.create(model=f"{gateway.model}:full", input="Name three colours.", max_output_tokens=12,
                               temperature=0, extra_headers={"X-Session-Id": "lora-responses"})
    assert resp.output_text == chat
    an = anthropic.Anthropic(base_url=gateway.url, api_key="none", max_retries=0)
    msg = an.messages.create(model=f"{gateway.model}:full", max_tokens=12, messages=ASK, extra_body={"temperature": 0},
                             extra_headers={"X-Session-Id": "lora-messages"})
    assert msg.content[0].text == chat
    assert [t["lora_adapter"] for t in _turns(gateway, "lora-responses")] == ["full"]
    assert [t["lora_adapter"] for t in _turns(gateway, "lora-messages")] == ["full"]
    base = oa.completions.create(model=gateway.model, prompt=[11, 12, 13, 14], max_tokens=6, temperature=0, logprobs=0)
    tuned = oa.completions.create(model=f"{gateway.model}:full", prompt=[11, 12, 13, 14], max_tokens=6, temperature=0,
                                  logprobs=0)
    assert base.choices[0].logprobs.token_logprobs != tuned.choices[0].logprobs.token_logprobs


def test_an_adapter_the_engines_lack_is_a_404_in_each_api(gateway: Any) -> None:
    oa = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
    for model in (f"{gateway.model}:nope", "other-model:full"):
        with pytest.raises(openai.NotFoundError) as e:
            oa.chat.completions.create(model=model, messages=ASK, max_tokens=4)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
        with pytest.raises(openai.NotFoundError):
            oa.responses.create(model=model, input="hi", max_output_tokens=4)
        with pytest.raises(anthropic.NotFoundError) as a:
            anthropic.Anthropic(base_url=gateway.url, api_key="none", max_retries=0).messages.create(
                model=model, max_tokens=4, messages=ASK)
        assert a.value.body["type"] == "error" and a.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):  # before the stream starts: the gateway asked the engines
        list(oa.chat.completions.create(model=f"{gateway.model}:nope", messages=ASK, max_tokens=4, stream=True))
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve(f"{gateway.model}:nope")


def test_models_lists_the_adapters_with_their_parent(gateway: Any) -> None:
    oa = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
    cards = {m.id: m for m in oa.models.list().data}
    assert set(cards) == {gateway.model, f"{gateway.model}:full"}
    assert cards[f"{gateway.model}:full"].model_extra["parent"] == gateway.model
    assert "parent" not in cards[gateway.model].model_extra
    assert oa.models.retrieve(f"{gateway.model}:full").id == f"{gateway.model}:full"
