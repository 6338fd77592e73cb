"""Our engine-facing code against the pinned SGLang release's own source (see tests/_sglang_source.py).

Why: the CPU engine, the gateway and the trainer must speak SGLang's exact HTTP API, so that a real SGLang
server drops in. Hand-written mirrors drift silently; these tests read SGLang's routes, request classes,
JSON contract (``sglang/api/v1/api_types.py``), unpickler allow-list and process-group code from the
wheel, so a route, key, payload global or rendezvous step we invent fails here.
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import os
import pickle
import pickletools
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch

from slime_server.rollout.protocol import SGLANG_ROUTES, GenerateOutput
from tests._sglang_source import (
    COMMON,
    LOAD_SNAPSHOT,
    SGLANG_VERSION,
    TENSOR_BUCKET,
    SGLangSourceError,
    api_types,
    class_fields,
    fetch_all,
    function_source,
    http_routes,
    io_struct_classes,
    io_struct_defaults,
    load_by_path,
    loads_route,
    safe_unpickler_allowed_globals,
    safe_unpickler_class,
)

REPO = Path(__file__).resolve().parents[1]
PROMPT = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module", autouse=True)
def _sglang_wheel() -> None:
    """Fetch the wheel first: without it every test here must fail (never skip) with one clear reason."""
    try:
        fetch_all()
    except SGLangSourceError as e:
        pytest.fail(str(e), pytrace=False)


def _wire_names(model: type) -> dict[str, Any]:
    """Our model's JSON keys (alias when set) -> pydantic field info."""
    return {(f.alias or name): f for name, f in model.model_fields.items()}


# ---------------------------------------------------------------- 1-2: routes and request bodies


@pytest.mark.parametrize(("method", "path"), [(m, p) for m, p, _ in SGLANG_ROUTES])
def test_route_exists_in_sglang(method: str, path: str) -> None:
    """Every engine route our code calls is served by SGLang's http_server with that HTTP method."""
    routes = http_routes()
    assert path in routes, f"SGLang {SGLANG_VERSION} has no route {path}"
    assert method in routes[path], f"SGLang {SGLANG_VERSION} serves {path} only for {sorted(routes[path])}"


_BODY_ROUTES = [(p, m) for _, p, m in SGLANG_ROUTES if m is not None and p != "/generate"]


@pytest.mark.parametrize(("path", "model"), _BODY_ROUTES, ids=[p for p, _ in _BODY_ROUTES])
def test_request_model_matches_io_struct(path: str, model: type) -> None:
    """Our body model of a control route uses only SGLang's field names (same class name in io_struct,
    ``BaseReq``'s ``rid``/``http_worker_ipc`` included) and has every field SGLang requires."""
    classes = io_struct_classes()
    assert model.__name__ in classes, f"{path}: io_struct has no class {model.__name__}"
    theirs = classes[model.__name__]
    ours = _wire_names(model)
    invented = sorted(set(ours) - set(theirs))
    assert not invented, f"{path}: {model.__name__} fields unknown to SGLang: {invented}"
    missing = sorted(f for f, required in theirs.items() if required and f not in ours)
    assert not missing, f"{path}: {model.__name__} lacks fields SGLang requires: {missing}"
    # a field left out means SGLang's default on a real server and ours on the CPU engine: the same one
    defaults = io_struct_defaults()[model.__name__]
    differ = {k: (f.get_default(call_default_factory=True), defaults[k]) for k, f in ours.items()
              if k in defaults and not f.is_required() and f.get_default(call_default_factory=True) != defaults[k]}
    assert not differ, f"{path}: {model.__name__} defaults (ours, SGLang's) differ: {differ}"


def test_generate_models_match_api_types() -> None:
    """``/generate``: our request and sampling-params keys are keys of SGLang's JSON contract
    (``GenerateRequest`` ignores unknown keys, so only this check catches an invented one)."""
    from slime_server.rollout.protocol import GenerateReqInput, SamplingParams

    at = api_types()
    # http_server's /generate checks the body against GenerateRequest (unknown keys ignored) and hands FastAPI's
    # io_struct.GenerateReqInput to the tokenizer manager: a key of that dataclass is honoured even where the JSON
    # contract does not list it (0.5.23's return_routed_experts). A key of neither is invented.
    req_fields = set(at.GenerateRequest.__struct_fields__) | set(io_struct_classes()["GenerateReqInput"])
    sp_fields = set(at.SamplingParams.__struct_fields__)
    invented = sorted(set(_wire_names(GenerateReqInput)) - req_fields)
    assert not invented, f"GenerateReqInput keys unknown to SGLang's GenerateRequest and GenerateReqInput: {invented}"
    assert "return_routed_experts" in io_struct_classes()["GenerateReqInput"]
    invented = sorted(set(_wire_names(SamplingParams)) - sp_fields)
    assert not invented, f"SamplingParams keys unknown to SGLang (it answers 400 to them): {invented}"


# ---------------------------------------------------------------- 3: /generate bodies the gateway sends


def _gateway_stub(context_length: int = 4096) -> Any:
    """What ``turn.sampling_params`` reads of a gateway (and nothing else)."""
    return types.SimpleNamespace(renderer=types.SimpleNamespace(context_length=context_length),
                                 settings=types.SimpleNamespace(max_prompt_tokens=None, max_output_tokens=None))


# Every OpenAI-side argument of turn.sampling_params, with non-default values (a new argument must
# be added here: the test refuses to run without it, so every key the function can emit is covered).
_OPENAI_CASES: list[dict[str, Any]] = [
    dict(max_tokens=None, temperature=None, top_p=None, top_k=None, min_p=None, stop=None, seed=None, n=1,
         frequency_penalty=None, presence_penalty=None),
    dict(max_tokens=16, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, stop="END", seed=1234, n=3,
         frequency_penalty=0.5, presence_penalty=0.25, ignore_eos=True),
    dict(max_tokens=8, temperature=0.0, top_p=1e-9, top_k=0, min_p=0.0, stop=["\n\n", "END"], seed=0, n=1,
         frequency_penalty=0.0, presence_penalty=0.0, ignore_eos=False),
]


def _openai_params(case: dict[str, Any]) -> dict[str, Any]:
    from slime_server.gateway.turn import sampling_params

    accepted = set(inspect.signature(sampling_params).parameters) - {"gw", "prompt_len"}
    unknown = accepted - set(_OPENAI_CASES[1])
    assert not unknown, f"sampling_params takes {sorted(unknown)}: add them to _OPENAI_CASES"
    return sampling_params(_gateway_stub(), prompt_len=len(PROMPT), **case)


def _admitted(at: ModuleType, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as it goes over the wire, checked as SGLang's ``/generate`` checks it first (a 400 fails here)."""
    wire = json.loads(json.dumps(body))
    try:
        at.GenerateRequest.from_json_value(wire)
    except at.JsonContractError as e:
        pytest.fail(f"SGLang {SGLANG_VERSION} answers 400 to {wire}: {e}", pytrace=False)
    return wire


@pytest.mark.parametrize("case", _OPENAI_CASES, ids=["defaults", "all-set", "edge"])
@pytest.mark.parametrize("stream", [False, True])
def test_gateway_generate_bodies_pass_sglang_contract(case: dict[str, Any], stream: bool) -> None:
    """The gateway's real builders (OpenAI params -> ``sampling_params`` -> ``EngineClient.build_request``)
    produce bodies SGLang admits (its ``/generate`` runs ``GenerateRequest.from_json_value`` first)."""
    from slime_server.gateway.engine_client import EngineClient

    at = api_types()
    params = _openai_params(case)
    rid = "chatcmpl-1" if case["n"] == 1 else None  # the builder also runs without a rid (e.g. probes)
    for top in (0, 5):
        body = EngineClient.build_request(PROMPT, params, return_logprob=True, top_logprobs_num=top, rid=rid,
                                          stream=stream)
        _admitted(at, body)


def test_gateway_image_bodies_pass_sglang_contract() -> None:
    """A vision-language prompt's body (issue 45): each image's pads collapsed to SGLang's one pad, the files as
    ``image_data`` data URLs in pad order (SGLang 0.5.23 expands the pad; a URL would make it fetch)."""
    from slime_server.buffer.schema import ImageSpan
    from slime_server.gateway.engine_client import EngineClient
    from slime_server.gateway.images import EngineImages

    at = api_types()
    assert "image_data" in at.GenerateRequest.__struct_fields__
    assert "return_prompt_token_ids" in (set(at.GenerateRequest.__struct_fields__)
                                         | set(io_struct_classes()["GenerateReqInput"]))
    pad = 99
    ids = [1, 2, pad, pad, pad, 3, pad, pad, 4]
    urls = ["data:image/png;base64,AAAA", "data:image/jpeg;base64,BBBB"]
    images = EngineImages(pad, [ImageSpan(sha256="a", offset=2, length=3), ImageSpan(sha256="b", offset=6, length=2)],
                          urls)
    for stream in (False, True):
        body = EngineClient.build_request(ids, _openai_params(_OPENAI_CASES[1]), rid="chatcmpl-1", stream=stream,
                                          images=images)
        wire = _admitted(at, body)
        assert wire["input_ids"] == [1, 2, pad, 3, pad, 4] and wire["image_data"] == urls


def _sglang_answer(at: ModuleType, ids: list[int], finish: Any, versions: list[tuple[str, int, int]]
                   ) -> dict[str, Any]:
    """A realistic SGLang ``/generate`` answer, encoded by SGLang's own contract code."""
    mi = at.GenerateMetaInfo(
        id="abc", prompt_tokens=len(PROMPT), completion_tokens=len(ids), finish_reason=finish,
        output_token_logprobs=[at.LogprobEntry(logprob=-0.5 - i, token_id=t, text=None) for i, t in enumerate(ids)],
        output_top_logprobs=[[at.LogprobEntry(logprob=-0.5 - i, token_id=t, text=None)] for i, t in enumerate(ids)],
        e2e_latency=0.25, cached_tokens=2, weight_version=versions[-1][0] if versions else "0",
        weight_versions=[at.WeightVersionSpan(version=v, start=s, end=e) for v, s, e in versions])
    return json.loads(json.dumps(at.GenerateResponse(text="xy", output_ids=ids, meta_info=mi).to_json_value()))


def test_partial_rollout_continuation_bodies_pass_sglang_contract() -> None:
    """A generation the engine aborted is continued (``api/partial.generate_continuing``) with a body of
    its own (new ``max_new_tokens``, ``seed``, ``n`` and rid): every body must pass SGLang's contract.
    The fake engine admits requests with SGLang's own check, as its ``/generate`` does."""
    from slime_server.gateway.engine_client import EngineClient
    from slime_server.gateway.partial import generate_continuing

    at = api_types()
    bodies: list[dict[str, Any]] = []

    def answer(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        bodies.append(body)
        try:
            at.GenerateRequest.from_json_value(body)
        except at.JsonContractError as e:  # SGLang's http_server: 400 {"error": "<contract message>"}
            return 400, {"error": {"message": str(e)}}
        ids = [100 + len(bodies), 200 + len(bodies)]
        if len(bodies) == 1:
            finish = at.FinishAbort(message="paused for a weight update", status_code=None, err_type=None)
        else:
            finish = at.FinishLength(length=body["sampling_params"]["max_new_tokens"])
        return 200, _sglang_answer(at, ids, finish, [("1", 0, len(ids))])

    async def run() -> None:
        from aiohttp import web

        async def generate(request: web.Request) -> web.Response:
            status, payload = answer(await request.json())
            return web.json_response(payload, status=status)

        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)  # a real HTTP server: the client's own wire path
        await site.start()
        port = runner.addresses[0][1]
        client = EngineClient(f"http://127.0.0.1:{port}")
        params = _openai_params(dict(_OPENAI_CASES[1], n=1))
        try:
            await generate_continuing(client.generate, PROMPT, params, rid="chatcmpl-2",
                                      aborted_by_us=lambda _rid: False, max_continuations=2,
                                      return_logprob=True, top_logprobs_num=3)
        finally:
            await client.aclose()
            await runner.cleanup()

    asyncio.run(run())
    assert len(bodies) == 2, bodies
    assert bodies[1]["input_ids"] == PROMPT + [101, 201] and bodies[1]["rid"] == "chatcmpl-2-cont0"


# ---------------------------------------------------------------- 4: /generate answers, both directions


@pytest.fixture(scope="module")
def engine_url(tiny_model_path, tmp_path_factory):
    from tests._engine_helpers import engine_process

    with engine_process(tiny_model_path, tmp_path_factory.mktemp("engine"), "--max-running-requests", "4") as u:
        yield u


def _decode_answer(at: ModuleType, obj: Any) -> Any:
    try:
        return at.GenerateResponse.from_json_value(obj)
    except at.JsonContractError as e:
        pytest.fail(f"SGLang's contract refuses our engine's answer {obj}: {e}", pytrace=False)


def _finish(at: ModuleType, resp: Any) -> Any:
    """The decoded finish reason; SGLang decodes a malformed one to a raw dict, which we refuse."""
    fr = resp.meta_info.finish_reason
    assert fr is None or isinstance(fr, at.FinishStop | at.FinishLength | at.FinishAbort), (
        f"finish_reason {fr!r} is not one of SGLang's shapes")
    return fr


def test_engine_answers_decode_with_sglang_contract(engine_url: str) -> None:
    """Our CPU engine's ``/generate`` answers (plain, n > 1, stream; length, stop by token, stop by string,
    abort) decode with SGLang's ``GenerateResponse`` — what sgl-router and SGLang clients expect."""
    from slime_server.gateway.engine_client import EngineClient

    at = api_types()

    def post(params: dict[str, Any], **kw: Any) -> Any:
        body = EngineClient.build_request(PROMPT, params, **kw)
        at.GenerateRequest.from_json_value(body)
        r = httpx.post(f"{engine_url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    plain = post(greedy, return_logprob=True, top_logprobs_num=2)
    resp = _decode_answer(at, plain)
    assert isinstance(_finish(at, resp), at.FinishLength) and resp.meta_info.finish_reason.length == 8
    assert len(resp.meta_info.output_token_logprobs) == 8 and resp.output_ids == plain["output_ids"]
    assert resp.meta_info.weight_version is not None

    by_token = _decode_answer(at, post({**greedy, "ignore_eos": False, "stop_token_ids": [plain["output_ids"][2]]},
                                       return_logprob=True))
    fr = _finish(at, by_token)
    assert isinstance(fr, at.FinishStop) and fr.matched == plain["output_ids"][2]

    pieces = httpx.post(f"{engine_url}/generate", timeout=60, json={
        "input_ids": PROMPT, "return_logprob": True, "return_text_in_logprobs": True, "sampling_params": greedy,
    }).json()["meta_info"]["output_token_logprobs"]
    stop = next((p[2].strip() for p in pieces[1:] if p[2] and p[2].strip()), None)
    assert stop, f"no printable token to stop on in {pieces}"
    by_text = _decode_answer(at, post({**greedy, "stop": [stop]}, return_logprob=True))
    fr = _finish(at, by_text)
    assert isinstance(fr, at.FinishStop) and fr.matched == stop, by_text

    several = post({**greedy, "temperature": 1.0, "n": 2, "sampling_seed": 7}, return_logprob=True)
    assert isinstance(several, list) and len(several) == 2
    assert all(isinstance(_finish(at, _decode_answer(at, o)), at.FinishLength) for o in several)

    body = EngineClient.build_request(PROMPT, greedy, return_logprob=True, top_logprobs_num=2, stream=True)
    with httpx.stream("POST", f"{engine_url}/generate", json=body, timeout=120) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [_decode_answer(at, json.loads(ln.removeprefix("data: "))) for ln in lines[:-1]]
    assert all(_finish(at, c) is None for c in chunks[:-1]) and isinstance(_finish(at, chunks[-1]), at.FinishLength)

    box: dict[str, Any] = {}
    long = EngineClient.build_request(PROMPT, {"max_new_tokens": 3000, "ignore_eos": True}, rid="contract-abort")
    t = threading.Thread(target=lambda: box.update(r=httpx.post(f"{engine_url}/generate", json=long, timeout=60)))
    t.start()
    time.sleep(0.5)
    assert httpx.post(f"{engine_url}/abort_request", json={"rid": "contract-abort"}, timeout=10).status_code == 200
    t.join(60)
    assert isinstance(_finish(at, _decode_answer(at, box["r"].json())), at.FinishAbort)


def _unknown_keys(at: ModuleType, answer: dict[str, Any]) -> list[str]:
    """Keys of an answer that SGLang's contract does not define (it ignores them when decoding)."""
    out = [k for k in answer if k not in at.GenerateResponse.__struct_fields__]
    mi = answer.get("meta_info") or {}
    out += [f"meta_info.{k}" for k in mi if k not in at.GenerateMetaInfo.__struct_fields__]
    fr = mi.get("finish_reason") or {}
    variant = {"stop": at.FinishStop, "length": at.FinishLength, "abort": at.FinishAbort}.get(fr.get("type"))
    if variant is not None:
        out += [f"meta_info.finish_reason.{k}" for k in fr if k != "type" and k not in variant.__struct_fields__]
    return out


def test_engine_answers_carry_only_sglang_keys(engine_url: str) -> None:
    """Our engine sends no ``/generate`` key outside SGLang's contract: SGLang's decoder ignores unknown keys,
    so only this catches one, and a key only our engine sends is one the gateway may come to depend on
    (it then breaks on a real SGLang server)."""
    from slime_server.gateway.engine_client import EngineClient

    at = api_types()
    body = EngineClient.build_request(PROMPT, {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True},
                                      return_logprob=True, top_logprobs_num=2)
    answers = [httpx.post(f"{engine_url}/generate", json=body, timeout=60).json()]
    with httpx.stream("POST", f"{engine_url}/generate", json={**body, "stream": True}, timeout=60) as r:
        answers += [json.loads(ln.removeprefix("data: ")) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    unknown = sorted({k for a in answers for k in _unknown_keys(at, a)})
    assert not unknown, f"our engine's answers carry keys SGLang {SGLANG_VERSION} does not send: {unknown}"


@pytest.mark.parametrize(("why", "body"), [
    ("unknown sampling key", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "bogus_knob": 1}}),
    ("OpenAI spelling of sampling_seed", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "seed": 1}}),
    ("temperature of the wrong type", {"input_ids": PROMPT, "sampling_params": {"temperature": "hot"}}),
    ("input_ids of the wrong type", {"input_ids": "11 12", "sampling_params": {"max_new_tokens": 2}}),
])
def test_engine_refuses_what_sglang_refuses(engine_url: str, why: str, body: dict[str, Any]) -> None:
    """A body SGLang answers with 400 is a 400 on our engine too: otherwise CI passes requests that a real
    SGLang server refuses (the gateway's bugs would only show on GPU)."""
    at = api_types()
    with pytest.raises(at.JsonContractError):
        at.GenerateRequest.from_json_value(body)
    r = httpx.post(f"{engine_url}/generate", json=body, timeout=60)
    assert r.status_code == 400, f"{why}: SGLang refuses {body}, our engine answered {r.status_code} {r.text[:300]}"


@pytest.mark.parametrize("finish", ["stop-int", "stop-str", "stop-list", "stop-none", "length", "abort"])
def test_real_sglang_answer_parses_with_our_models(finish: str) -> None:
    """A realistic SGLang answer (encoded by its own contract code, a request that spanned two weight
    versions) parses with ``GenerateOutput``, and ``MetaInfo.token_versions`` follows the spans."""
    at = api_types()
    ids = [5, 6, 7, 8, 9]
    fr = {"stop-int": at.FinishStop(matched=9), "stop-str": at.FinishStop(matched="</s>"),
          "stop-list": at.FinishStop(matched=[8, 9]), "stop-none": at.FinishStop(matched=None),
          "length": at.FinishLength(length=5),
          "abort": at.FinishAbort(message="aborted", status_code=400, err_type="BadRequestError")}[finish]
    answer = _sglang_answer(at, ids, fr, [("3", 0, 3), ("4", 3, 5)])
    out = GenerateOutput.model_validate(answer)
    assert out.output_ids == ids and out.meta_info.completion_tokens == 5
    assert out.meta_info.token_versions(5) == ["3", "3", "3", "4", "4"]
    assert out.meta_info.weight_version == "4"
    assert out.meta_info.finish_reason is not None
    assert out.meta_info.finish_reason.type == answer["meta_info"]["finish_reason"]["type"]
    if finish.startswith("stop"):
        assert out.meta_info.finish_reason.matched == answer["meta_info"]["finish_reason"]["matched"]
    assert [e[1] for e in out.meta_info.output_token_logprobs] == ids


# ---------------------------------------------------------------- 5: /update_weights_from_tensor payloads


def pickle_globals(data: bytes) -> set[tuple[str, str]]:
    """Every (module, name) a pickle imports: GLOBAL args, and the two strings below each STACK_GLOBAL
    (pushed directly or fetched from the memo)."""
    found: set[tuple[str, str]] = set()
    memo: dict[int, Any] = {}
    pushed: list[Any] = []  # values of the push operations, in order (None: not a string)
    top: Any = None
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("PERSID", "BINPERSID"):
            raise AssertionError("persistent ids: SGLang's SafeUnpickler has no persistent_load")
        if name == "GLOBAL":
            module, attr = arg.split(" ", 1)
            found.add((module, attr))
            top = None
        elif name == "STACK_GLOBAL":
            assert len(pushed) >= 2 and isinstance(pushed[-2], str) and isinstance(pushed[-1], str), (
                "STACK_GLOBAL without two strings pushed before it")
            found.add((pushed[-2], pushed[-1]))
            top = None
        elif name == "MEMOIZE":
            memo[len(memo)] = top
            continue
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = top
            continue
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            top = memo.get(int(arg))
        elif isinstance(arg, str) and name.endswith(("UNICODE", "STRING", "UNICODE8")):
            top = arg
        elif op.stack_after:
            top = None
        else:
            continue
        pushed.append(top)
    return found


_NAMED = [  # mixed dtypes, laid out so every tensor starts on its element size (see the alignment test)
    ("model.embed_tokens.weight", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
    ("model.layers.0.mlp.up_proj.weight", torch.randn(4, 6)),
    ("model.layers.0.input_layernorm.weight", torch.randn(2, 2).half()),
    ("lm_head.weight", torch.randn(3, 2).bfloat16()),
]


def test_weight_payload_uses_only_globals_sglang_unpickles() -> None:
    """The trainer's ``/update_weights_from_tensor`` payload references only globals in SGLang's
    ``SafeUnpickler.ALLOWED_GLOBALS``, loads with that very unpickler, and SGLang's
    ``FlattenedTensorBucket`` rebuilds our tensors from it (as ``_update_weights_from_flattened_bucket``)."""
    import base64

    from slime_server.weights import serialize_flattened_bucket

    payload = serialize_flattened_bucket(_NAMED)
    raw = base64.b64decode(payload, validate=True)
    refused = sorted(pickle_globals(raw) - safe_unpickler_allowed_globals())
    assert not refused, f"SGLang's SafeUnpickler refuses these globals of our payload: {refused}"

    obj = safe_unpickler_class()(io.BytesIO(raw)).load()
    tb = load_by_path(TENSOR_BUCKET)
    metas = [tb.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                        end_idx=m.end_idx, numel=m.numel) for m in obj["metadata"]]
    rebuilt = tb.FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=metas).reconstruct_tensors()
    assert [n for n, _ in rebuilt] == [n for n, _ in _NAMED]
    for (_, got), (name, want) in zip(rebuilt, _NAMED, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_by_reference_payload_uses_only_globals_sglang_unpickles() -> None:
    """The payload of tensors sent in place (a trainer's parameters in shared memory: views at offsets of their
    storage; ``load_format`` left out, SGLang's default) references only ``SafeUnpickler.ALLOWED_GLOBALS`` and
    loads with that very unpickler into the same (name, tensor) pairs: the list SGLang's default branch passes
    to ``model.load_weights``."""
    import base64

    from slime_server.weights import serialize, share_in_place

    storage = torch.randn(64)
    share_in_place([storage])
    named = [("model.layers.0.mlp.down_proj.weight", storage[8:32].view(4, 6)), ("model.norm.weight", storage[40:44]),
             ("lm_head.weight", storage[:8].view(2, 4).t())]  # offsets, and a transposed (strided) view
    raw = base64.b64decode(serialize(named), validate=True)
    refused = sorted(pickle_globals(raw) - safe_unpickler_allowed_globals())
    assert not refused, f"SGLang's SafeUnpickler refuses these globals of our payload: {refused}"
    got = safe_unpickler_class()(io.BytesIO(raw)).load()
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, t), (name, want) in zip(got, named, strict=True):
        assert t.shape == want.shape and torch.equal(t, want), name


def test_pickle_globals_sees_every_import() -> None:
    """The opcode walk itself: STACK_GLOBAL with memoized strings (protocol 4) and GLOBAL (protocol 2)."""
    import collections

    objs = [collections.OrderedDict, collections.Counter, types.SimpleNamespace(a=1)]
    want = {("collections", "OrderedDict"), ("collections", "Counter"), ("types", "SimpleNamespace")}
    for protocol in (2, 4, 5):
        assert pickle_globals(pickle.dumps(objs, protocol=protocol)) == want, protocol


@pytest.mark.parametrize(("case", "named"), [
    ("aligned", [(n, t.shape, t.dtype) for n, t in _NAMED]),
    ("fp8-then-scale", [("w", (3, 5), torch.float8_e4m3fn), ("w_scale", (3,), torch.float32)]),
    ("odd-bf16-then-fp32", [("bias", (3,), torch.bfloat16), ("weight", (2, 2), torch.float32)]),
])
def test_flattened_layout_is_one_sglang_accepts(case: str, named: list[tuple[str, Any, torch.dtype]]) -> None:
    """Our flattened-bucket layout (``layout_of``, used by the trainer on both weight paths) is SGLang's:
    on ``/update_weights_from_distributed`` SGLang computes it from names/dtypes/shapes
    (``FlattenedTensorBucket.empty``) and views each slice as its dtype, so it refuses a tensor whose byte
    offset is not a multiple of its element size. Our side must then refuse too (or never produce one)."""
    from slime_server.weights import dtype_name, layout_of

    tb = load_by_path(TENSOR_BUCKET)
    group = [(n, torch.zeros(shape, dtype=dt)) for n, shape, dt in named]
    try:
        ours = layout_of(group)
    except ValueError:
        ours = None
    try:
        theirs = tb.FlattenedTensorBucket.empty([n for n, _, _ in named], [dtype_name(dt) for _, _, dt in named],
                                                [list(s) for _, s, _ in named], "cpu").get_metadata()
    except ValueError as e:
        assert ours is None, f"{case}: SGLang refuses this bucket ({e}) but our layout_of packs it: {ours}"
        return
    assert ours is not None, f"{case}: SGLang accepts this bucket, our layout_of refuses it"
    assert [(m.name, m.start_idx, m.end_idx) for m in ours] == [(m.name, m.start_idx, m.end_idx) for m in theirs]


# ---------------------------------------------------------------- 6: process-group rendezvous

RENDEZVOUS_TIMEOUT_S = 60
_N = 1 << 20
_SEED = 1234

# One rank of the weight-update group. "sglang": SGLang's init_custom_process_group, exec'd from the wheel
# (it needs only the `torch_release` global of common.py); "ours": slime_server.weights.open_weight_group.
_RANK_SCRIPT = textwrap.dedent("""
    import datetime, os, sys, torch, torch.distributed as dist
    from packaging.version import Version
    role, group, src_file = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, port, n, seed = (int(a) for a in sys.argv[4:8])
    pg_timeout = float(sys.argv[8])
    if role == "sglang":
        ns = {"torch_release": Version(torch.__version__).release}
        exec(compile(open(src_file).read(), "sglang:init_custom_process_group", "exec"), ns)
        pg = ns["init_custom_process_group"](backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                             timeout=datetime.timedelta(seconds=pg_timeout), world_size=2,
                                             rank=rank, group_name=group)
    else:
        from slime_server.weights import open_weight_group
        pg = open_weight_group("127.0.0.1", port, 2, rank, group, "gloo", pg_timeout)
    want = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    t = want.clone() if rank == 0 else torch.zeros_like(want)
    dist.broadcast(t, src=0, group=pg)
    if rank == 1 and not torch.equal(t, want):
        sys.exit(f"rank 1 received a different tensor (sum {t.sum().item()} != {want.sum().item()})")
    dist.barrier(group=pg)  # as /destroy_weights_update_group: both sides tear the group down, then exit
    dist.destroy_process_group(pg)
    print(f"{role} rank {rank}: ok", flush=True)
    os._exit(0)  # skip interpreter teardown: torch's TCPStore thread may abort() there (not our concern)
""")


@pytest.mark.parametrize("ours_rank", [0, 1], ids=["trainer-ours-engine-sglang", "trainer-sglang-engine-ours"])
def test_weight_group_rendezvous_with_sglang(ours_rank: int, tmp_path: Path) -> None:
    """Our ``open_weight_group`` meets SGLang's ``init_custom_process_group`` (TCP rendezvous, the outer
    ``PrefixStore(group_name, ...)``, torch's per-group prefix) and a 1M-float broadcast arrives intact.
    Rank 0 ours = our trainer against a SGLang engine; rank 1 ours = our CPU engine against slime's trainer,
    which creates the group with SGLang's function. A mismatch hangs: each side times out instead."""
    from slime_server.utils.net import find_free_port

    src = tmp_path / "init_custom_process_group.py"
    src.write_text(function_source(COMMON, "init_custom_process_group"))
    port = find_free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    procs = {}
    for rank in (0, 1):
        role = "ours" if rank == ours_rank else "sglang"
        cmd = [sys.executable, "-c", _RANK_SCRIPT, role, "slime-test", str(src), str(rank), str(port), str(_N),
               str(_SEED), str(RENDEZVOUS_TIMEOUT_S - 15)]
        procs[f"{role} rank {rank}"] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                        stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    outs = {}
    for name, p in procs.items():
        try:
            outs[name] = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            outs[name] = p.communicate()[0] + "\n<killed: no rendezvous in time>"
    report = "\n".join(f"--- {n} (exit {p.returncode}):\n{outs.get(n, '')[-3000:]}" for n, p in procs.items())
    assert all(p.returncode == 0 for p in procs.values()), f"weight-group rendezvous failed:\n{report}"



def test_load_route_is_sglangs(engine_url: str) -> None:
    """Issue 41: the dashboard reads an engine's load from SGLang 0.5.23's ``GET /v1/loads``
    (``entrypoints/v1_loads.py``; 0.5.23 serves no ``/get_load``): our response model names only the keys that
    route returns and the ``LoadSnapshot`` fields it sends per rank, and the CPU engine answers it so."""
    from slime_server.rollout.protocol import LoadSnapshot, LoadsResponse

    path, keys = loads_route()
    assert path == "/v1/loads"
    assert set(LoadsResponse.model_fields) == keys
    assert set(LoadSnapshot.model_fields) <= class_fields(LOAD_SNAPSHOT, "LoadSnapshot")
    r = httpx.get(f"{engine_url}/v1/loads", params={"include": "core"}, timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert set(body) == keys and LoadsResponse.model_validate(body).loads[0].num_running_reqs == 0
    assert set(body["loads"][0]) <= class_fields(LOAD_SNAPSHOT, "LoadSnapshot")
