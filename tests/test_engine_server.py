"""The engine over real HTTP (a real server process): exactness against Hugging Face, continuous
batching, and seeded sampling."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests._engine_helpers import engine_process, hf_greedy, hf_logprobs, hf_model

PROMPT = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def url(tiny_model_path, tmp_path_factory):
    with engine_process(tiny_model_path, tmp_path_factory.mktemp("engine"), "--max-running-requests", "16") as u:
        yield u


@pytest.fixture(scope="module")
def ref(tiny_model_path):
    return hf_model(tiny_model_path)


def gen(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=timeout)


def test_greedy_matches_hf_generate(url, ref) -> None:
    for prompt in (PROMPT, [5, 900, 33]):
        r = gen(url, {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 24,
                                                               "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == hf_greedy(ref, prompt, 24)


def test_sampled_logprobs_match_a_separate_hf_forward(url, ref) -> None:
    sp = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 32, "ignore_eos": True, "sampling_seed": 7}
    out = gen(url, {"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True}).json()
    entries = out["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"] and len(entries) == 32
    assert all(e[2] is None for e in entries)
    want = hf_logprobs(ref, PROMPT, out["output_ids"], 0.8)
    assert max(abs(e[0] - w) for e, w in zip(entries, want, strict=True)) < 1e-4
    greedy = gen(url, {"input_ids": PROMPT, "return_logprob": True,
                       "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}).json()
    want = hf_logprobs(ref, PROMPT, greedy["output_ids"], 0.0)  # temperature 0 -> plain log_softmax
    got = [e[0] for e in greedy["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_sixteen_concurrent_requests_equal_sequential(url) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randrange(3, 24))] for _ in range(16)]
    sp = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}

    def one(p: list[int]) -> dict:
        r = gen(url, {"input_ids": p, "sampling_params": sp, "return_logprob": True})
        assert r.status_code == 200, r.text
        return r.json()

    t0 = time.perf_counter()
    seq = [one(p) for p in prompts]
    t_seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        conc = list(pool.map(one, prompts))
    t_conc = time.perf_counter() - t0
    for a, b in zip(seq, conc, strict=True):
        assert a["output_ids"] == b["output_ids"]
        la = [e[0] for e in a["meta_info"]["output_token_logprobs"]]
        lb = [e[0] for e in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-4
    # Speed is a benchmark's business (tools/bench_engine.py measures batching side by side); a timed
    # assert here failed once on a loaded CI machine (1.04x) and passes at ~2.4x on a quiet one.
    print(f"16 requests: sequential {t_seq:.2f}s, concurrent {t_conc:.2f}s ({t_seq / t_conc:.1f}x)")


def test_seed_reproduces_and_n_returns_n_results(url) -> None:
    sp = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 1234}
    a = gen(url, {"input_ids": PROMPT, "sampling_params": sp}).json()
    b = gen(url, {"input_ids": PROMPT, "sampling_params": sp}).json()
    c = gen(url, {"input_ids": PROMPT, "sampling_params": {**sp, "sampling_seed": 4321}}).json()
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]
    # SGLang's range: any signed 64-bit seed (negative ones too), nothing beyond
    neg = [gen(url, {"input_ids": PROMPT, "sampling_params": {**sp, "sampling_seed": -(2**63)}}) for _ in range(2)]
    assert neg[0].status_code == 200 and neg[0].json()["output_ids"] == neg[1].json()["output_ids"]
    assert gen(url, {"input_ids": PROMPT, "sampling_params": {**sp, "sampling_seed": 2**63}}).status_code == 400
    many = gen(url, {"input_ids": PROMPT, "sampling_params": {**sp, "n": 3}, "rid": "grp"}).json()
    assert isinstance(many, list) and len(many) == 3
    assert many[0]["output_ids"] == a["output_ids"]  # sample i uses seed + i
    assert len({tuple(m["output_ids"]) for m in many}) == 3
    ids = [m["meta_info"]["id"] for m in many]  # SGLang 0.5.23: regenerate_rid, a fresh uuid per sample
    assert len(set(ids)) == 3 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_rids_as_sglang_names_them(url) -> None:
    """A batch under one rid runs as ``{rid}_{i}``; the samples of an n > 1 request get fresh uuids, so an
    abort by the request's rid (or by ``{rid}_{i}``) stops none of them, as on SGLang 0.5.23; a rid named
    twice in one request, or one still in flight, is refused (SGLang's duplicate-rid checks)."""
    sp = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    batch = gen(url, {"input_ids": [PROMPT, [40, 41]], "sampling_params": sp, "rid": "bat"}).json()
    assert [b["meta_info"]["id"] for b in batch] == ["bat_0", "bat_1"]
    listed = gen(url, {"input_ids": [PROMPT, [40, 41]], "sampling_params": sp, "rid": ["p", "q"]}).json()
    assert [b["meta_info"]["id"] for b in listed] == ["p", "q"]
    dup = gen(url, {"input_ids": [PROMPT, [40, 41]], "sampling_params": sp, "rid": ["p", "p"]})
    assert dup.status_code == 400 and "Duplicate request ID" in dup.json()["error"]["message"]

    box: dict = {}
    long = {"temperature": 1.0, "max_new_tokens": 600, "ignore_eos": True, "n": 2}
    t = threading.Thread(target=lambda: box.update(r=gen(url, {"input_ids": PROMPT, "sampling_params": long,
                                                               "rid": "par"})))
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and httpx.get(f"{url}/get_load", timeout=10).json()[0]["num_reqs"] < 2:
        time.sleep(0.01)
    busy = gen(url, {"input_ids": PROMPT, "sampling_params": sp, "rid": "par"})
    assert busy.status_code == 200  # "par" names no running request: SGLang forgets it once n > 1 fans out
    for rid in ("par", "par_0", "par_1"):
        assert httpx.post(f"{url}/abort_request", json={"rid": rid}, timeout=10).status_code == 200
    time.sleep(0.1)
    assert httpx.get(f"{url}/get_load", timeout=10).json()[0]["num_reqs"] == 2  # both samples still run
    t.join(120)
    samples = box["r"].json()
    assert [s["meta_info"]["finish_reason"]["type"] for s in samples] == ["length", "length"]
    assert all(s["meta_info"]["id"] not in ("par", "par_0", "par_1") for s in samples)

    box.clear()
    t = threading.Thread(target=lambda: box.update(r=gen(url, {"input_ids": PROMPT, "rid": "solo",
                                                               "sampling_params": {**long, "n": 1}})))
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and httpx.get(f"{url}/get_load", timeout=10).json()[0]["num_reqs"] < 1:
        time.sleep(0.01)
    again = gen(url, {"input_ids": PROMPT, "sampling_params": sp, "rid": "solo"})
    assert again.status_code == 400 and "Duplicate request ID detected: solo" in again.json()["error"]["message"]
    assert httpx.post(f"{url}/abort_request", json={"rid": "solo"}, timeout=10).status_code == 200
    t.join(60)
    assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
