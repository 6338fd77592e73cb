"""Issue 45, the gateway: images in user turns and tool results through Chat Completions, Responses and Messages
(the real ``openai`` and ``anthropic`` SDKs, streamed and not), in front of the real sgl-router and a CPU engine
serving the tiny Qwen2.5-VL. Every session is checked in the store: one trajectory; each turn's prompt the last
turn's tokens and more; the loss mask exactly on the generated tokens (a turn decoded under a forced tool call's
grammar is kept out of it, as every constrained turn is); each image's pads where its span says; each image file
stored once, however many turns resend it. Bad images: a 400 in each API's own error shape, nothing recorded.
"""

from __future__ import annotations

import base64
import io
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import torch

from tests._gateway_helpers import (
    MODEL,
    GatewayProc,
    engine_and_router,
    new_session,
    openai_client,
    running_gateway,
    session_trajectories,
)

pytestmark = [pytest.mark.timeout(600)]
TOOL = {"type": "function", "function": {"name": "screenshot", "description": "Take a screenshot of the screen",
                                         "parameters": {"type": "object", "properties": {"region": {"enum": ["full", "top"]}},
                                                        "required": ["region"]}}}
MAX_IMAGE_BYTES = 100_000
# A forced call's arguments from the random tiny model: greedy, it picks the JSON's optional whitespace for good; sampled,
# it leaves it within a few tokens (the engine's sampler is seeded: the same requests draw the same tokens)
FORCED = {"temperature": 1.0, "max_output_tokens": 200}


@pytest.fixture(scope="module")
def vl_gateway(vl_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    d = tmp_path_factory.mktemp("vl_gateway")
    # no free whitespace inside a forced call's JSON: the random tiny model would fill its budget with spaces
    with engine_and_router(vl_path, d, {"constrained_json_disable_any_whitespace": True}) as url, running_gateway(
            url, vl_path, d / "db.sqlite", d / "gateway.log", settings={"max_image_bytes": MAX_IMAGE_BYTES}) as gw:
        gw.router_url = url  # type: ignore[attr-defined]
        yield gw


def png(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    img = Image.fromarray((torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8).numpy())
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


PICS = [png(56, 56, 1), png(100, 60, 2), png(70, 90, 3)]  # 4, 8 and 6 tokens


def stored_images(gw: GatewayProc) -> dict[str, int]:
    with sqlite3.connect(gw.db_path) as db:
        return dict(db.execute("SELECT sha256, length(data) FROM images").fetchall())


def check_session(gw: GatewayProc, sid: str, pics: list[bytes], constrained: set[int] = frozenset()) -> dict:
    """One trajectory whose turns extend each other, its mask on the generated tokens of unconstrained turns, its
    image spans holding pads in the order the images were sent, each file stored once."""
    import hashlib

    from transformers import AutoConfig

    (traj,) = session_trajectories(gw, sid)
    turns = traj["turns"]
    assert len(turns) == 3
    for prev, turn in zip(turns, turns[1:], strict=False):
        assert turn["prompt_start"] == prev["output_end"]  # the next prompt extends the last turn's tokens
    generated = [i for k, t in enumerate(turns) if k not in constrained for i in range(t["output_start"], t["output_end"])]
    assert [i for i, m in enumerate(traj["loss_mask"]) if m] == generated
    from slime_server.models.tiny_vl import ensure_tiny_vl_model

    pad = AutoConfig.from_pretrained(ensure_tiny_vl_model()).image_token_id
    assert [s["sha256"] for s in traj["images"]] == [hashlib.sha256(p).hexdigest() for p in pics]
    for s in traj["images"]:
        assert traj["tokens"][s["offset"]:s["offset"] + s["length"]] == [pad] * s["length"]
        assert traj["tokens"][s["offset"] - 1] != pad and traj["tokens"][s["offset"] + s["length"]] != pad
    assert traj["tokens"].count(pad) == sum(s["length"] for s in traj["images"])
    stored = stored_images(gw)
    for p in pics:
        assert stored[hashlib.sha256(p).hexdigest()] == len(p)
    return traj


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_three_turns_with_images(vl_gateway: GatewayProc, stream: bool) -> None:
    c = openai_client(vl_gateway)
    sid = new_session(vl_gateway)
    messages: list[dict[str, Any]] = []
    usage = []
    for k, pic in enumerate(PICS):
        messages.append({"role": "user", "content": [{"type": "text", "text": f"What is in picture {k}?"},
                                                     {"type": "image_url", "image_url": {"url": data_url(pic)}}]})
        kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                  extra_headers={"X-Session-ID": sid})
        if stream:
            chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            usage.append(chunks[-1].usage)
        else:
            r = c.chat.completions.create(**kw)
            text = r.choices[0].message.content
            usage.append(r.usage)
        messages.append({"role": "assistant", "content": text})
    traj = check_session(vl_gateway, sid, PICS)
    assert [u.prompt_tokens for u in usage] == [t["output_start"] for t in traj["turns"]]


def test_chat_completions_refuses_an_image_in_a_tool_message(vl_gateway: GatewayProc) -> None:
    sid = new_session(vl_gateway)
    r = httpx.post(f"{vl_gateway.base_url}/chat/completions", headers={"X-Session-ID": sid}, timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": "shoot"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "screenshot", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [
                {"type": "image_url", "image_url": {"url": data_url(PICS[0])}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[2].content[0]"
    assert "text only in Chat Completions" in r.json()["error"]["message"]
    assert session_trajectories(vl_gateway, sid) == []


@pytest.mark.parametrize("stream", [False, True])
def test_responses_images_in_user_turns_and_in_a_tool_result(vl_gateway: GatewayProc, stream: bool) -> None:
    """Turn 1 forces a tool call; turn 2 answers it with a screenshot (``function_call_output`` with an
    ``input_image``); turn 3 sends another picture, each turn by ``previous_response_id`` (the stored chain replays
    the first picture from the store by its hash)."""
    c = openai_client(vl_gateway)
    sid = new_session(vl_gateway)
    tool = {"type": "function", **TOOL["function"]}
    common = dict(model=MODEL, tools=[tool], extra_headers={"X-Session-ID": sid})

    def create(**kw: Any) -> Any:
        kw = {"max_output_tokens": 6, "temperature": 0, **kw}
        if not stream:
            return c.responses.create(**common, **kw)
        events = list(c.responses.create(**common, **kw, stream=True))
        # the last event: response.completed, or response.incomplete when max_output_tokens cut the answer
        assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
        return events[-1].response

    first = create(input=[{"role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                                       {"type": "input_image", "image_url": data_url(PICS[0])}]}],
                   tool_choice={"type": "function", "name": "screenshot"}, **FORCED)
    (call,) = [o for o in first.output if o.type == "function_call"]
    second = create(previous_response_id=first.id, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                           "output": [{"type": "input_image",
                                                                       "image_url": data_url(PICS[1])}]}])
    create(previous_response_id=second.id, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(PICS[2])}, {"type": "input_text", "text": "And this?"}]}])
    check_session(vl_gateway, sid, PICS, constrained={0})


@pytest.mark.parametrize("stream", [False, True])
def test_messages_images_in_user_turns_and_in_a_tool_result(vl_gateway: GatewayProc, stream: bool) -> None:
    c = anthropic.Anthropic(base_url=vl_gateway.url, api_key="EMPTY", max_retries=0, timeout=120)
    sid = new_session(vl_gateway)
    tool = {"name": "screenshot", "description": TOOL["function"]["description"],
            "input_schema": TOOL["function"]["parameters"]}

    def block(pic: bytes) -> dict[str, Any]:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(pic).decode()}}

    def create(messages: list[dict[str, Any]], **kw: Any) -> Any:
        forced = "tool_choice" in kw
        args = dict(model=MODEL, max_tokens=FORCED["max_output_tokens"] if forced else 6, tools=[tool],
                    messages=messages, extra_body={"temperature": FORCED["temperature"] if forced else 0.0},
                    extra_headers={"X-Session-ID": sid}, **kw)
        if not stream:
            return c.messages.create(**args)
        with c.messages.stream(**args) as s:
            return s.get_final_message()

    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, block(PICS[0])]}]
    first = create(messages, tool_choice={"type": "tool", "name": "screenshot"})
    (use,) = [b for b in first.content if b.type == "tool_use"]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": [{"type": "text", "text": "the screen:"}, block(PICS[1])]}]}]
    second = create(messages)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]
                  or [{"type": "text", "text": ""}]},
                 {"role": "user", "content": [block(PICS[2]), {"type": "text", "text": "And this?"}]}]
    create(messages)
    check_session(vl_gateway, sid, PICS, constrained={0})


def _bad_images() -> list[tuple[str, str, str]]:
    """(why, data URL, what the error says)"""
    big = png(200, 200, 9)  # noise does not compress: ~120 KB of PNG
    assert len(big) > MAX_IMAGE_BYTES
    return [
        ("too large", data_url(big), "bytes; at most"),
        ("an unknown format", data_url(png(20, 20, 1, fmt="BMP"), "image/bmp"), "BMP images are not supported"),
        ("corrupt base64", "data:image/png;base64,@@notbase64@@", "base64 is corrupt"),
        ("no image at all", data_url(b"hello, world" * 20), "not an image"),
        ("a remote URL while fetching is off", "https://example.com/cat.png", "does not fetch image URLs"),
    ]


BAD = _bad_images()


@pytest.mark.parametrize(("why", "url", "says"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_image_is_a_400_in_each_apis_shape_and_nothing_is_recorded(vl_gateway: GatewayProc, why: str,
                                                                         url: str, says: str) -> None:
    before = stored_images(vl_gateway)
    sid = new_session(vl_gateway)
    base, h = vl_gateway.base_url, {"X-Session-ID": sid}
    chat = httpx.post(f"{base}/chat/completions", headers=h, timeout=60, json={"model": MODEL, "max_tokens": 4,
                      "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})
    responses = httpx.post(f"{base}/responses", headers=h, timeout=60, json={"model": MODEL, "max_output_tokens": 4,
                           "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}]})
    source = ({"type": "url", "url": url} if url.startswith("http") else
              {"type": "base64", "media_type": url[5:url.index(";")], "data": url.split(",", 1)[1]})
    messages = httpx.post(f"{vl_gateway.url}/v1/messages", headers=h, timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image",
                                                                                      "source": source}]}]})
    for r in (chat, responses):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert says in err["message"] and err["type"] == "invalid_request_error", err
    assert messages.status_code == 400, messages.text
    body = messages.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert says in body["error"]["message"]
    assert session_trajectories(vl_gateway, sid) == [] and stored_images(vl_gateway) == before


def test_an_image_to_a_text_only_model_is_a_400(gateway: GatewayProc) -> None:
    sid = new_session(gateway)
    r = httpx.post(f"{gateway.base_url}/chat/completions", headers={"X-Session-ID": sid}, timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": data_url(PICS[0])}}]}]})
    assert r.status_code == 400 and "text-only model" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "messages[0].content[1]"
    assert session_trajectories(gateway, sid) == []


def test_images_come_back_through_the_store_once_each(vl_gateway: GatewayProc) -> None:
    """Two sessions sending the same picture: one stored file; a Responses record keeps the hash, not the bytes."""
    c = openai_client(vl_gateway)
    same = png(64, 64, 42)
    for _ in range(2):
        c.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(same)}}]}])
    r = c.responses.create(model=MODEL, max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(same)}]}])
    import hashlib

    digest = hashlib.sha256(same).hexdigest()
    assert stored_images(vl_gateway)[digest] == len(same)
    with sqlite3.connect(vl_gateway.db_path) as db:
        (body,) = db.execute("SELECT body FROM stored_responses WHERE id = ?", (r.id,)).fetchone()
    assert f"sha256:{digest}" in body and base64.b64encode(same).decode()[:40] not in body
    assert json.loads(body)["input"][0]["content"][0]["image_url"]["url"] == f"sha256:{digest}"


def test_count_tokens_counts_each_image_as_the_engine_expands_it(vl_gateway: GatewayProc) -> None:
    c = anthropic.Anthropic(base_url=vl_gateway.url, api_key="EMPTY", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": base64.b64encode(PICS[1]).decode()}}]}]
    counted = c.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    sent = c.messages.create(model=MODEL, max_tokens=1, messages=messages)
    assert counted == sent.usage.input_tokens


def test_export_carries_each_trajectorys_images_in_slimes_field(vl_gateway: GatewayProc, tmp_path: Path) -> None:
    from slime_server.buffer.export import export_jsonl, read_jsonl
    from slime_server.buffer.open import open_store

    c = openai_client(vl_gateway)
    sid = new_session(vl_gateway)
    pics = [PICS[2], PICS[0]]
    c.chat.completions.create(model=MODEL, max_tokens=2, extra_headers={"X-Session-ID": sid}, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pics]}])
    httpx.post(f"{vl_gateway.base_url}/sessions/{sid}/reward", json={"reward": 1.0}, timeout=30).raise_for_status()
    store = open_store(str(vl_gateway.db_path))
    try:
        export_jsonl(store, tmp_path / "out.jsonl")
    finally:
        store.close()
    (sample,) = [s for s in read_jsonl(tmp_path / "out.jsonl") if s.session_id == sid]
    urls = sample.multimodal_inputs["images"]
    assert [base64.b64decode(u.split(",", 1)[1]) for u in urls] == pics
    (traj,) = session_trajectories(vl_gateway, sid)
    assert sample.metadata["image_spans"] == traj["images"] and sample.tokens == traj["tokens"]


def test_the_shapes_environment_shows_its_picture_through_a_tool(vl_gateway: GatewayProc) -> None:
    """The visual environment: ``look`` returns the rendered picture (``ToolOutput``), the runner shows it in a user
    turn after the tool results (Chat Completions' rule), and the session records it token-exactly; the reward reads
    the answer against what was drawn."""
    from PIL import Image

    from slime_server.agents.runner import tool_images_message
    from slime_server.envs.base import ToolOutput, get_environment

    env = get_environment("shapes")
    rows = env.default_dataset(40, seed=3)
    assert {r.label for r in rows} == {"red", "green", "blue", "yellow"}
    state = env.reset(rows[0])
    out = env.step(state, "look", "{}")
    assert isinstance(out, ToolOutput) and len(out.images) == 1
    picture = Image.open(io.BytesIO(out.images[0])).convert("RGB")
    colours = {c for c in picture.getdata() if min(c) < 200}  # the shape's pixels (the background is light)
    from slime_server.envs.shapes import COLOURS

    assert colours == {COLOURS[rows[0].label]}
    assert env.step(state, "look", "{}").images == out.images  # the same picture every look
    assert env.reward(state, f"It is <answer>{rows[0].label}</answer>.") == 1.0
    assert env.reward(state, "<answer>purple</answer>") == 0.0 and env.reward(state, rows[0].label) == 0.0
    c = openai_client(vl_gateway)
    sid = new_session(vl_gateway)
    first = c.chat.completions.create(model=MODEL, messages=state.messages, tools=state.tools, temperature=1.0,
                                      max_tokens=FORCED["max_output_tokens"], extra_headers={"X-Session-ID": sid},
                                      tool_choice={"type": "function", "function": {"name": "look"}})
    (call,) = first.choices[0].message.tool_calls
    messages = [*state.messages, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": out.text}, tool_images_message(out.images)]
    c.chat.completions.create(model=MODEL, messages=messages, tools=state.tools, max_tokens=4, temperature=0,
                              extra_headers={"X-Session-ID": sid})
    (traj,) = session_trajectories(vl_gateway, sid)
    import hashlib

    assert len(traj["turns"]) == 2 and traj["turns"][1]["prompt_start"] == traj["turns"][0]["output_end"]
    assert [s["sha256"] for s in traj["images"]] == [hashlib.sha256(out.images[0]).hexdigest()]


def test_a_remote_image_url_is_fetched_only_where_the_operator_allows_it(vl_gateway: GatewayProc, vl_path: Path,
                                                                          tmp_path: Path) -> None:
    """``gateway.fetch_image_urls``: on, an http URL is fetched (a real local HTTP server) and recorded like an inline
    image, once by hash; a missing file is a 400 naming it; off (the module's gateway), the same URL is a 400."""
    import hashlib
    import threading
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    (tmp_path / "cat.png").write_bytes(PICS[1])
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    try:
        off = httpx.post(f"{vl_gateway.base_url}/chat/completions", json=body, timeout=60)
        assert off.status_code == 400 and "does not fetch image URLs" in off.json()["error"]["message"]
        with running_gateway(vl_gateway.router_url, vl_path, tmp_path / "db.sqlite", tmp_path / "gw.log",
                             settings={"fetch_image_urls": True}) as gw:
            sid = new_session(gw)
            r = httpx.post(f"{gw.base_url}/chat/completions", json=body, headers={"X-Session-ID": sid}, timeout=60)
            assert r.status_code == 200, r.text
            (traj,) = session_trajectories(gw, sid)
            assert [s["sha256"] for s in traj["images"]] == [hashlib.sha256(PICS[1]).hexdigest()]
            assert stored_images(gw) == {hashlib.sha256(PICS[1]).hexdigest(): len(PICS[1])}
            missing = {**body, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url.replace("cat", "dog")}}]}]}
            r = httpx.post(f"{gw.base_url}/chat/completions", json=missing, timeout=60)
            assert r.status_code == 400 and "HTTP 404" in r.json()["error"]["message"], r.text
    finally:
        server.shutdown()
