"""Bucketed weight push from a Megatron-core trainer model into real CPU engine processes."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from slime_server.trainer.convert import export_hf_state_dict, iter_hf_tensors, load_hf_checkpoint_into
from slime_server.trainer.model import build_gpt_model
from slime_server.trainer.parallel import parallel_context
from slime_server.trainer.weight_push import (
    WeightPusher,
    WeightPushError,
    in_shared_memory,
    is_push_sender,
    mark_last,
)
from slime_server.utils.net import find_free_port
from slime_server.weights import SharedStaging, nbytes, share_in_place
from tests._engine_helpers import hf_greedy, hf_logprobs
from tests._weight_push_helpers import (
    NEW_TOKENS,
    PROMPT,
    engine_processes,
    greedy,
    hf_reference,
    perturbed,
    version_of,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def megatron(tiny_model_path: Path):
    """The tiny model as a Megatron GPTModel (TP=1) in this process; tests perturb it in place."""
    from transformers import AutoConfig

    torch.set_num_threads(2)
    with parallel_context(tp_size=1):
        config = AutoConfig.from_pretrained(str(tiny_model_path))
        model = build_gpt_model(config).eval()
        load_hf_checkpoint_into(model, tiny_model_path)
        yield config, model


@pytest.fixture(scope="module")
def engines(tiny_model_path: Path, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """Two engines serving the tiny model."""
    with engine_processes([tiny_model_path, tiny_model_path], tmp_path_factory.mktemp("logs")) as urls:
        yield urls[0], urls[1]


def test_mark_last():
    assert list(mark_last([])) == []
    assert list(mark_last("ab")) == [("a", False), ("b", True)]


@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_push_matches_trainer_model(megatron, engines, mode):
    """Several buckets into a real engine through SGLang's routes (shared-memory tensor handles, or a
    gloo group and one broadcast per bucket): greedy ids and logprobs equal the trainer's, version moves.

    Two pushes through one pusher: the second rewrites the reused bucket buffers (and reuses the group),
    so stale bytes from the first would show up as a mismatch."""
    config, model = megatron
    url = engines[0]
    before_ids, before_lps, _ = greedy(url)
    total = sum(t.numel() * t.element_size() for t in perturbed(model, seed=1).values())
    bucket_bytes = total // 4
    with WeightPusher([url], bucket_bytes=bucket_bytes, mode=mode, sender=True) as pusher:
        pusher.push(iter_hf_tensors(model), version=6)
        arena_bytes, group = pusher._arena.nbytes, pusher._group
        state = perturbed(model, seed=11, scale=0.2)
        stats = pusher.push(iter_hf_tensors(model), version=7)
        assert pusher._arena.nbytes == arena_bytes  # buffers reused, not reallocated
        assert pusher._group is group  # the group is kept between pushes
    assert (group is None) == (mode == "tensor")
    assert stats.sent and stats.version == "7" and stats.mode == mode
    assert stats.tensors == len(state) and stats.bytes == total
    assert stats.buckets >= max(2, math.ceil(total / bucket_bytes))
    assert [e.weight_version for e in stats.engines] == ["7"] and stats.engines[0].gbps > 0
    assert version_of(url) == "7"

    ids, lps, versions = greedy(url)
    ref = hf_reference(config, state)
    assert ids == hf_greedy(ref, PROMPT, NEW_TOKENS)
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(hf_logprobs(ref, PROMPT, ids, 0.0)),
                               atol=1e-4, rtol=0)
    assert versions == ["7"] * NEW_TOKENS
    assert (ids, lps) != (before_ids, before_lps)  # the push really changed what the engine serves


def _listening(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def test_distributed_megatron_forward_parity(megatron, engines):
    """The broadcast path lands the same weights; checked against the Megatron forward itself."""
    from slime_server.trainer.model import forward_logits

    _, model = megatron
    url = engines[0]
    perturbed(model, seed=2)
    with WeightPusher([url], bucket_bytes=2**20, mode="distributed", sender=True) as pusher:
        stats = pusher.push(iter_hf_tensors(model), version="v-dist")
        # the rendezvous port was open only while the group formed; the group itself lives on
        port = pusher.rendezvous_port
        assert port and not _listening(pusher.master_address, port)
        assert pusher.push(iter_hf_tensors(model), version="v-dist2").mode == "distributed"
        assert pusher.rendezvous_port == port  # the same group: no new rendezvous
    assert stats.buckets > 1 and version_of(url) == "v-dist2"
    ids, lps, _ = greedy(url)
    with torch.no_grad():
        logits = forward_logits(model, torch.tensor([PROMPT + ids]))[0, len(PROMPT) - 1:-1].float()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    assert ids == logits.argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(lps), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_two_engines_while_serving(megatron, engines, mode):
    """Both engines end on the new version (tensor: one after the other; distributed: one group, one
    broadcast); a client hammering both during the push sees no error: paused requests wait."""
    _, model = megatron
    perturbed(model, seed=3)
    stop = threading.Event()
    failures: list[str] = []
    served: list[str] = []

    def client() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                for url in engines:
                    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
                    try:
                        r = c.post(f"{url}/generate", json=body)
                        if r.status_code != 200:
                            failures.append(f"{url}: HTTP {r.status_code} {r.text[:200]}")
                        else:
                            served.append(r.json()["meta_info"]["weight_version"])
                    except httpx.HTTPError as e:
                        failures.append(f"{url}: {e!r}")

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        with WeightPusher(list(engines), bucket_bytes=2**20, rolling=True, mode=mode, sender=True) as pusher:
            stats = pusher.push(iter_hf_tensors(model), version=f"42{mode}")
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not failures, failures[:3]
    assert [e.weight_version for e in stats.engines] == [f"42{mode}"] * 2
    assert [version_of(u) for u in engines] == [f"42{mode}"] * 2
    assert f"42{mode}" in served and len(served) >= 4


def test_refused_bucket_is_reported_not_skipped(megatron, engines):
    """A bucket the engine refuses (a tensor its model lacks) fails the push loudly; the engine keeps
    its old version and goes on serving (the buckets before it were the weights it already had)."""
    _, model = megatron
    url = engines[1]
    before = version_of(url)
    before_out = greedy(url)

    def with_stray_tensor():
        yield from iter_hf_tensors(model)
        yield "model.layers.99.mlp.up_proj.weight", torch.zeros(4, 4)

    with WeightPusher([url], bucket_bytes=2**20, sender=True) as pusher, pytest.raises(WeightPushError) as err:
        pusher.push(with_stray_tensor(), version=99)
    assert list(err.value.errors) == [url] and "model.layers.99" in err.value.errors[url]
    assert err.value.versions == {url: before}
    assert url in str(err.value) and "on the new version: none" in str(err.value)
    assert greedy(url) == before_out  # same weights, same version, still serving


def test_dead_engine_is_reported(megatron, engines):
    """An engine that is gone shows up in the error with version None; the live one still updates."""
    _, model = megatron
    dead = f"http://127.0.0.1:{find_free_port()}"
    with WeightPusher([engines[0], dead], bucket_bytes=2**20, sender=True) as pusher, \
            pytest.raises(WeightPushError) as err:
        pusher.push(iter_hf_tensors(model), version=123)
    assert err.value.versions == {engines[0]: "123", dead: None}
    assert list(err.value.errors) == [dead]


def test_non_sender_iterates_but_sends_nothing(engines):
    seen: list[str] = []

    def tensors():
        for i in range(3):
            seen.append(f"t{i}")
            yield f"t{i}", torch.zeros(2)

    before = version_of(engines[0])
    with WeightPusher([engines[0]], sender=False) as pusher:
        stats = pusher.push(tensors(), version="never")
    assert not stats.sent and stats.tensors == 3 and seen == ["t0", "t1", "t2"]
    assert version_of(engines[0]) == before


def test_single_process_is_the_sender():
    assert is_push_sender()


def test_bad_arguments():
    with pytest.raises(ValueError):
        WeightPusher([])
    with pytest.raises(ValueError):
        WeightPusher(["http://127.0.0.1:1"], mode="carrier-pigeon")  # type: ignore[arg-type]
    with WeightPusher(["http://127.0.0.1:1"], sender=True) as pusher, pytest.raises(ValueError):
        pusher.push(iter(()), version=1)


def test_parameters_in_shared_memory_go_by_reference(megatron, engines):
    """A trainer's parameters moved into shared memory (``weights.share_in_place``, what a sender rank does before
    a same-host push) are handed over in place: the engine copies straight from them. Without staging, what the
    export converts (q/k/v, split out of Megatron's fused layout) is packed into a bucket; with it
    (``weights.SharedStaging``, what the rank passes) the split writes into shared buffers and nothing is packed.
    Each push gives the engine exactly the trainer's weights (the staged buffers rewritten push after push), and
    the engine keeps them when the trainer's tensors change afterwards (copied, not aliased)."""
    config, _ = megatron
    model = build_gpt_model(config).eval()  # a model of its own: the other tests' stays unshared
    state = perturbed(model, seed=21, scale=0.2)
    params = list(model.parameters())
    assert not any(p.is_shared() for p in params)
    assert share_in_place(p.data for p in params) >= sum(p.numel() * p.element_size() for p in params)
    assert all(p.is_shared() for p in params) and share_in_place(p.data for p in params) == 0
    after = export_hf_state_dict(model)
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)  # moved intact
    named = list(iter_hf_tensors(model))
    shared = sum(nbytes(t) for _, t in named if in_shared_memory(t))
    assert {n.split(".")[-2] for n, t in named if not in_shared_memory(t)} == {"q_proj", "k_proj", "v_proj"}
    url = engines[0]
    total = sum(nbytes(t) for _, t in named)

    def serves(state: dict[str, torch.Tensor]) -> tuple[list[int], list[float]]:
        ids, lps, _ = greedy(url)
        ref = hf_reference(config, state)
        assert ids == hf_greedy(ref, PROMPT, NEW_TOKENS)
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(hf_logprobs(ref, PROMPT, ids, 0.0)),
                                   atol=1e-4, rtol=0)
        return ids, lps

    staging = SharedStaging()
    with WeightPusher([url], bucket_bytes=total // 4, mode="tensor", sender=True) as pusher:
        stats = pusher.push(iter_hf_tensors(model), version=31)
        assert stats.referenced_bytes == shared and 0 < shared < stats.bytes == total
        assert version_of(url) == "31"
        serves(state)
        for version, seed in ((32, 22), (33, 23)):  # training steps change the parameters in place
            state = perturbed(model, seed=seed, scale=0.2)
            stats = pusher.push(iter_hf_tensors(model, staging), version=version)
            assert stats.referenced_bytes == stats.bytes == total  # nothing packed
            assert staging.nbytes == total - shared  # q/k/v, the same buffers every push
            got = serves(state)
    with torch.no_grad():  # the trainer's next step rewrites its parameters in place
        for p in params:
            p.mul_(0.5)
    assert greedy(url)[:2] == got
