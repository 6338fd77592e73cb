"""Bucketed weight updates into a live engine process: shm and raw-bytes transports, atomic switch,
in-flight requests survive (with per-token versions), bad buckets refused, update from disk."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from _engine_helpers import engine_process, hf_greedy, hf_model

from slime_server import weights

PROMPT = [21, 22, 23, 24, 25]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(tiny_model_path, tmp_path_factory):
    with engine_process(tiny_model_path, tmp_path_factory.mktemp("engine")) as u:
        yield u


def perturbed(model_path, seed: int):
    model = hf_model(model_path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def greedy(url: str) -> list[int]:
    r = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def push(url: str, model, version: str, transport: str) -> int:
    buckets = list(weights.pack_buckets(model.state_dict().items(), max_bytes=2 << 20))
    with httpx.Client(timeout=120) as client:
        for i, b in enumerate(buckets):
            res = weights.push_bucket(client, url, b, weight_version=version, last=i == len(buckets) - 1,
                                      transport=transport)
            assert res["success"], res
    return len(buckets)


@pytest.mark.parametrize(("seed", "version", "transport", "pause"),
                         [(1, "1", "shm", True), (2, "2", "http", False)])
def test_bucket_push_switches_weights_and_in_flight_request_survives(url, tiny_model_path, seed, version,
                                                                     transport, pause) -> None:
    """slime's flow pauses in place around the push; without a pause the switch lands between steps."""
    new = perturbed(tiny_model_path, seed)
    want = hf_greedy(new, PROMPT, GREEDY["max_new_tokens"])
    assert greedy(url) != want, "the perturbation must change the greedy output"
    old_version = httpx.get(f"{url}/get_weight_version", timeout=10).json()["weight_version"]
    body = {"input_ids": PROMPT, "return_logprob": True, "stream": True,
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 300, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        first = json.loads(next(ln for ln in lines if ln).removeprefix("data: "))
        assert first["meta_info"]["finish_reason"] is None  # the request is in flight
        if pause:
            httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, timeout=10).raise_for_status()
        assert push(url, new, version, transport) >= 3
        if pause:
            httpx.post(f"{url}/continue_generation", json={}, timeout=10).raise_for_status()
        assert httpx.get(f"{url}/get_weight_version", timeout=10).json() == {"weight_version": version}
        chunks = [ln for ln in lines if ln]
    assert chunks[-1] == "data: [DONE]"
    out = json.loads(chunks[-2].removeprefix("data: "))
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 300
    versions = out["meta_info"]["output_token_weight_versions"]
    switch = versions.index(version) if version in versions else len(versions)
    assert set(versions[:switch]) == {old_version} and set(versions[switch:]) <= {version}
    assert switch > 0
    if pause:
        assert switch < len(versions), "tokens after the paused update come from the new weights"
    assert greedy(url) == want


def test_bad_bucket_is_refused_and_nothing_changes(url) -> None:
    before_version = httpx.get(f"{url}/get_weight_version", timeout=10).json()["weight_version"]
    before = greedy(url)
    with httpx.Client(timeout=30) as client:
        for named in ([("no.such.weight", torch.zeros(3))], [("model.norm.weight", torch.zeros(7))]):
            (b,) = weights.pack_buckets(named, max_bytes=1 << 20)
            with pytest.raises(httpx.HTTPStatusError) as e:
                weights.push_bucket(client, url, b, weight_version="bad", last=True)
            assert e.value.response.status_code == 400 and not e.value.response.json()["success"]
        r = client.post(f"{url}/update_weights_from_bucket", json={"path": "/dev/shm/none", "meta": {}})
        assert r.status_code == 400
        r = client.post(f"{url}/update_weights_from_bucket", content=b"\0" * 8,
                        headers={"Content-Type": "application/octet-stream", weights.META_HEADER: "{}"})
        assert r.status_code == 400
    assert httpx.get(f"{url}/get_weight_version", timeout=10).json()["weight_version"] == before_version
    assert greedy(url) == before


def test_update_weights_from_disk(url, tiny_model_path, tmp_path) -> None:
    new = perturbed(tiny_model_path, 3)
    new.save_pretrained(tmp_path)
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": 7},
                   timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert httpx.get(f"{url}/get_weight_version", timeout=10).json() == {"weight_version": "7"}
    assert greedy(url) == hf_greedy(new, PROMPT, GREEDY["max_new_tokens"])
