"""SGLang's weight-update routes on a live CPU engine process, driven over raw HTTP as a GPU user drives
SGLang: tensor handles (``/update_weights_from_tensor``), a gloo group and broadcasts
(``/init_weights_update_group`` + ``/update_weights_from_distributed``), disk; pause modes with requests
in flight (per-token versions as ``weight_versions`` spans); SGLang's flush rule; bad input refused."""

from __future__ import annotations

import base64
import json
import pickle
import threading
from pathlib import Path

import httpx
import pytest
import torch

from slime_server import weights
from slime_server.rollout.protocol import MetaInfo
from slime_server.utils.net import find_free_port
from tests._engine_helpers import engine_process, hf_greedy, hf_model

PROMPT = [21, 22, 23, 24, 25]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(tiny_model_path, tmp_path_factory):
    with engine_process(tiny_model_path, tmp_path_factory.mktemp("engine"), "--health-check-timeout", "1") as u:
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


def version(url: str) -> str:
    return str(httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"])


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def _post_into(out: dict, url: str, path: str, body: dict) -> None:
    out.update(post(url, path, body).json())


def push_tensor(url: str, model, version_: str, flush_last: bool = True) -> int:
    """SGLang's tensor route, bucket by bucket, version and flush on the last (as our trainer does)."""
    groups = list(weights.group_by_bytes(model.state_dict().items(), 2 << 20))
    for i, group in enumerate(groups):
        last = i == len(groups) - 1
        body = {"serialized_named_tensors": [weights.serialize_flattened_bucket(group)],
                "load_format": "flattened_bucket", "flush_cache": last and flush_last}
        if last:
            body["weight_version"] = version_
        r = post(url, "/update_weights_from_tensor", body)
        assert r.status_code == 200 and r.json()["success"], r.text
    return len(groups)


@pytest.mark.parametrize(("seed", "mode"), [(1, "retract"), (2, "in_place")])
def test_paused_push_switches_weights_and_in_flight_request_survives(url, tiny_model_path, seed, mode) -> None:
    """slime's flow: pause, push, continue. The streamed request in flight finishes; its tokens before
    the update carry the old version and the ones after it the new one, as SGLang's spans say."""
    new = perturbed(tiny_model_path, seed)
    want = hf_greedy(new, PROMPT, GREEDY["max_new_tokens"])
    assert greedy(url) != want, "the perturbation must change the greedy output"
    old_version = version(url)
    new_version = f"{seed}-{mode}"
    body = {"input_ids": PROMPT, "return_logprob": True, "stream": True,
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 300, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        first = json.loads(next(ln for ln in lines if ln).removeprefix("data: "))
        assert first["meta_info"]["finish_reason"] is None  # the request is in flight
        post(url, "/pause_generation", {"mode": mode}).raise_for_status()
        assert push_tensor(url, new, new_version, flush_last=mode == "retract") >= 3
        post(url, "/continue_generation", {}).raise_for_status()
        assert version(url) == new_version
        chunks = [ln for ln in lines if ln]
    assert chunks[-1] == "data: [DONE]"
    out = json.loads(chunks[-2].removeprefix("data: "))
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 300
    versions = MetaInfo.model_validate(out["meta_info"]).token_versions(300)
    switch = versions.index(new_version)
    assert 0 < switch < 300
    assert set(versions[:switch]) == {old_version} and set(versions[switch:]) == {new_version}
    assert [s["version"] for s in out["meta_info"]["weight_versions"]] == [old_version, new_version]
    assert greedy(url) == want


def test_distributed_group_broadcast_and_destroy(url, tiny_model_path) -> None:
    """Rank 0 in this process, the engine as rank 1 of a gloo group formed by SGLang's rendezvous; one
    flat broadcast per bucket lands the weights; the group can be destroyed and formed again."""
    new = perturbed(tiny_model_path, 4)
    named = list(new.state_dict().items())
    for attempt in range(2):
        port = find_free_port()
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": "wtest", "backend": "gloo"}
        answer: dict = {}
        t = threading.Thread(target=_post_into, args=(answer, url, "/init_weights_update_group", init))
        t.start()
        pg = weights.open_weight_group("127.0.0.1", port, 2, 0, "wtest", "gloo", timeout_s=60)
        t.join(60)
        assert answer.get("success"), answer
        metas = weights.layout_of(named)
        flat = torch.empty(weights.flat_size(metas), dtype=torch.uint8)
        weights.fill_flat(flat, named, metas)
        body = {"names": [m.name for m in metas], "dtypes": [weights.dtype_name(m.dtype) for m in metas],
                "shapes": [list(m.shape) for m in metas], "group_name": "wtest", "flush_cache": True,
                "load_format": "flattened_bucket", "weight_version": f"dist-{attempt}"}
        res: dict = {}
        t = threading.Thread(target=_post_into, args=(res, url, "/update_weights_from_distributed", body))
        t.start()
        torch.distributed.broadcast(flat, src=0, group=pg)
        t.join(60)
        assert res.get("success"), res
        assert version(url) == f"dist-{attempt}"
        assert greedy(url) == hf_greedy(new, PROMPT, GREEDY["max_new_tokens"])
        r = post(url, "/destroy_weights_update_group", {"group_name": "wtest"})
        assert r.status_code == 200 and r.json()["success"]
        weights.close_weight_group(pg)
    r = post(url, "/destroy_weights_update_group", {"group_name": "wtest"})
    assert r.status_code == 400 and not r.json()["success"]  # SGLang: the group does not exist
    r = post(url, "/init_weights_update_group", {**init, "backend": "nccl"})
    assert r.status_code == 400 and "gloo" in r.json()["message"]


def test_flush_rule_as_sglang(url, tiny_model_path) -> None:
    """In-place pause keeps running requests: /flush_cache and an update with flush_cache are refused
    (the update loads but keeps the old version); after a retract pause both succeed."""
    body = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 200, "ignore_eos": True}}
    new = perturbed(tiny_model_path, 5)
    before = version(url)
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        next(ln for ln in lines if ln)
        post(url, "/pause_generation", {"mode": "in_place"}).raise_for_status()
        assert httpx.get(f"{url}/flush_cache", timeout=10).status_code == 400
        group = list(new.state_dict().items())[:2]
        r = post(url, "/update_weights_from_tensor", {
            "serialized_named_tensors": [weights.serialize_flattened_bucket(group)],
            "load_format": "flattened_bucket", "flush_cache": True, "weight_version": "refused"})
        assert r.status_code == 400 and not r.json()["success"] and "flush" in r.json()["message"]
        assert version(url) == before
        post(url, "/pause_generation", {"mode": "retract"}).raise_for_status()
        assert httpx.get(f"{url}/flush_cache", timeout=10).status_code == 200
        post(url, "/continue_generation", {}).raise_for_status()
        assert [ln for ln in lines if ln][-1] == "data: [DONE]"
    push_tensor(url, hf_model(tiny_model_path), before)  # back to the base weights for the next tests


def test_bad_updates_are_refused_and_nothing_changes(url, tmp_path: Path) -> None:
    before_version, before = version(url), greedy(url)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            import os
            return (os.system, (f"touch {marker}",))

    evil = base64.b64encode(pickle.dumps(Evil())).decode()
    bodies = [
        {"serialized_named_tensors": [weights.serialize_flattened_bucket([("no.such.weight", torch.zeros(3))])],
         "load_format": "flattened_bucket", "weight_version": "bad"},
        {"serialized_named_tensors": [weights.serialize_flattened_bucket([("model.norm.weight", torch.zeros(7))])],
         "load_format": "flattened_bucket", "weight_version": "bad"},
        {"serialized_named_tensors": [evil], "weight_version": "bad"},
        {"serialized_named_tensors": ["not base64!"], "weight_version": "bad"},
        {"serialized_named_tensors": [], "weight_version": "bad"},
    ]
    for body in bodies:
        r = post(url, "/update_weights_from_tensor", body)
        assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert not marker.exists(), "a weight payload ran code"
    r = post(url, "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]],
                                                       "group_name": "missing"})
    assert r.status_code == 400 and "init_weights_update_group" in r.json()["message"]
    assert post(url, "/update_weights_from_tensor", {"load_format": "flattened_bucket"}).status_code == 400
    assert version(url) == before_version
    assert greedy(url) == before


def test_update_weights_from_disk(url, tiny_model_path, tmp_path) -> None:
    new = perturbed(tiny_model_path, 3)
    new.save_pretrained(tmp_path)
    r = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": 7})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert version(url) == "7"
    assert greedy(url) == hf_greedy(new, PROMPT, GREEDY["max_new_tokens"])
    r = post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "nothing-here")})
    assert r.status_code == 400 and r.json()["success"] is False and version(url) == "7"


def test_health_generate_follows_sglang_while_paused(url) -> None:
    """SGLang's /health_generate: 200 once the scheduler progresses; a paused engine makes no progress,
    so it answers 503 after the timeout (1 s here) — which is why the supervisor's verdicts are
    suspended during weight updates."""
    assert httpx.get(f"{url}/health_generate", timeout=10).status_code == 200
    post(url, "/pause_generation", {"mode": "retract"}).raise_for_status()
    try:
        assert httpx.get(f"{url}/health_generate", timeout=10).status_code == 503
    finally:
        post(url, "/continue_generation", {}).raise_for_status()
    assert httpx.get(f"{url}/health_generate", timeout=10).status_code == 200


_SENDER = """
import os, signal, sys, httpx, torch
from transformers import AutoModelForCausalLM
from slime_server import weights
model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
group = list(model.state_dict().items())[:4]
body = {"serialized_named_tensors": [weights.serialize_flattened_bucket(group)],
        "load_format": "flattened_bucket", "flush_cache": False, "weight_version": sys.argv[3]}
r = httpx.post(sys.argv[1] + "/update_weights_from_tensor", json=body, timeout=60)
assert r.status_code == 200, r.text
os.kill(os.getpid(), signal.SIGKILL)  # die like a killed trainer rank, its shm manager with it
"""


def test_engine_survives_its_sender_dying(url, tiny_model_path) -> None:
    """A trainer rank killed after a push (its torch shm manager goes with it) must not take the engine
    down: the engine maps the shared files itself and never talks to the sender's manager."""
    import subprocess
    import sys
    import time

    push_tensor(url, hf_model(tiny_model_path), "base")
    before = greedy(url)
    for i in range(2):
        p = subprocess.run([sys.executable, "-c", _SENDER, url, str(tiny_model_path), f"killed-{i}"], timeout=120)
        assert p.returncode == -9
        time.sleep(0.5)  # the manager notices its last client is gone and exits
        assert version(url) == f"killed-{i}"
        assert greedy(url) == before  # same weights (the base model's), still serving
    push_tensor(url, hf_model(tiny_model_path), "after-kill")
    assert version(url) == "after-kill" and greedy(url) == before
