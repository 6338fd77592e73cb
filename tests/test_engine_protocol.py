"""The engine's SGLang protocol over real HTTP: response shapes, stop handling, streaming, abort,
client disconnects, info endpoints, and 400s (never 500s) for bad input."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests._engine_helpers import engine_process

PROMPT = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def url(tiny_model_path, tmp_path_factory):
    with engine_process(tiny_model_path, tmp_path_factory.mktemp("engine"), "--max-running-requests", "16") as u:
        yield u


def gen(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=timeout)


def test_batch_input_text_input_and_meta_info_shape(url) -> None:
    body = {"input_ids": [PROMPT, [40, 41]], "sampling_params": {"temperature": 0, "max_new_tokens": 3,
                                                                 "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    out = gen(url, body).json()
    assert isinstance(out, list) and len(out) == 2
    mi = out[1]["meta_info"]
    assert mi["prompt_tokens"] == 2 and mi["completion_tokens"] == 3 and mi["cached_tokens"] == 0
    assert mi["finish_reason"] == {"type": "length", "length": 3}
    assert mi["weight_version"] == "0" and mi["e2e_latency"] > 0
    assert len(mi["output_top_logprobs"]) == 3 and all(len(t) == 2 for t in mi["output_top_logprobs"])
    top, chosen = mi["output_top_logprobs"][0][0], mi["output_token_logprobs"][0]
    assert top[1] == chosen[1] and abs(top[0] - chosen[0]) < 1e-6  # greedy picks the top token
    assert [e[1] for e in mi["input_token_logprobs"]] == [40, 41] and mi["input_token_logprobs"][0][0] is None
    named = gen(url, {**body, "input_ids": [40, 41], "return_text_in_logprobs": True}).json()["meta_info"]
    assert all(isinstance(e[2], str) for e in named["output_token_logprobs"] + named["input_token_logprobs"])
    text = gen(url, {"text": "hello world", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}).json()
    assert text["meta_info"]["prompt_tokens"] > 0 and len(text["output_ids"]) == 2


def test_stop_token_is_kept_in_output_ids_and_trimmed_from_text(url) -> None:
    free = gen(url, {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 12,
                                                              "ignore_eos": True}}).json()["output_ids"]
    stop_at = free[3]
    first = free.index(stop_at)
    out = gen(url, {"input_ids": PROMPT, "return_logprob": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [stop_at]}}).json()
    assert out["output_ids"] == free[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert len(out["meta_info"]["output_token_logprobs"]) == first + 1


def test_streaming_sends_cumulative_chunks_then_done(url) -> None:
    body = {"input_ids": PROMPT, "stream": True, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert "e2e_latency" in chunks[-1]["meta_info"] and "e2e_latency" not in chunks[0]["meta_info"]
    plain = gen(url, {**body, "stream": False}).json()
    assert chunks[-1]["output_ids"] == plain["output_ids"]


def test_abort_request_finishes_with_abort(url) -> None:
    box: dict = {}

    def long() -> None:
        box["r"] = gen(url, {"input_ids": PROMPT, "rid": "to-abort",
                             "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})

    t = threading.Thread(target=long)
    t.start()
    time.sleep(1.0)
    assert httpx.post(f"{url}/abort_request", json={"rid": "to-abort"}, timeout=10).status_code == 200
    t.join(30)
    out = box["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 3000


def test_info_endpoints(url) -> None:
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
    info = httpx.get(f"{url}/get_model_info", timeout=10).json()
    assert info["is_generation"] is True and info["model_path"]
    server = httpx.get(f"{url}/get_server_info", timeout=10).json()
    assert server["max_running_requests"] == 16 and server["num_generate_requests"] > 0
    assert httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"] == "0"
    assert httpx.post(f"{url}/flush_cache", timeout=10).status_code == 200


BAD_BODIES = [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"input_ids": []}), "must not be empty"),
    (json.dumps({"input_ids": [[]]}), "must not be empty"),
    (json.dumps({"input_ids": "abc"}), "input_ids"),
    (json.dumps({"input_ids": [1, 2, 10**9]}), "outside the vocabulary"),
    (json.dumps({"input_ids": [1, -3]}), "outside the vocabulary"),
    (json.dumps({}), "exactly one of"),
    (json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**7}}), "context length"),
    (json.dumps({"input_ids": [1], "sampling_params": {"temperature": -1}}), "temperature"),
    (json.dumps({"input_ids": [1], "sampling_params": {"top_p": 0}}), "top_p"),
    (json.dumps({"input_ids": [1], "sampling_params": {"top_k": -5}}), "top_k"),
    (json.dumps({"input_ids": [1], "sampling_params": {"n": 10**6}}), "n"),
    (json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}}), "max_new_tokens"),
    (json.dumps({"input_ids": [1], "sampling_params": [{}, {}]}), "entries"),
    (json.dumps({"input_ids": [1], "top_logprobs_num": 100000, "return_logprob": True}), "top_logprobs_num"),
]


@pytest.mark.parametrize(("body", "why"), BAD_BODIES)
def test_bad_input_is_a_400_and_the_engine_keeps_serving(url, body: str, why: str) -> None:
    r = httpx.post(f"{url}/generate", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert why in r.json()["error"]["message"]
    ok = gen(url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


def test_bad_control_bodies_are_400(url) -> None:
    assert httpx.post(f"{url}/abort_request", json={}, timeout=10).status_code == 400
    assert httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "/nonexistent"},
                      timeout=10).status_code == 400
    assert httpx.post(f"{url}/pause_generation", json={"mode": "sideways"}, timeout=10).status_code == 400


def _state(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=10).json()["internal_states"][0]


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_the_request(url, stream: bool) -> None:
    body = {"input_ids": PROMPT, "stream": stream, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    before = _state(url)["generated_tokens"]
    if stream:
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 3:
                    break  # leaving the block closes the connection mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/generate", json=body, timeout=httpx.Timeout(10, read=0.5))
    deadline = time.monotonic() + 10
    while _state(url)["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.2)
    state = _state(url)
    assert state["num_running_reqs"] == 0 and state["generated_tokens"] - before < 4000


def test_protocol_models_parse_a_real_sglang_answer() -> None:
    """The gateway validates engine answers with these models, so SGLang's own shape must parse."""
    from slime_server.rollout.protocol import GenerateOutput

    sglang = {"text": "hi", "output_ids": [5, 6], "meta_info": {
        "id": "abc", "finish_reason": {"type": "abort", "message": "stop", "status_code": 400,
                                       "err_type": "BadRequestError"},
        "prompt_tokens": 3, "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
        "completion_tokens": 2, "cached_tokens": 1, "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]]}}
    out = GenerateOutput.model_validate(sglang)
    assert out.meta_info.finish_reason.type == "abort" and out.meta_info.e2e_latency is None
    assert out.meta_info.output_token_logprobs[1] == (-0.25, 6, None)
    assert out.meta_info.model_extra["num_retractions"] == 0
    partial = {**sglang, "meta_info": {**sglang["meta_info"], "finish_reason": None}}
    assert GenerateOutput.model_validate(partial).meta_info.finish_reason is None
