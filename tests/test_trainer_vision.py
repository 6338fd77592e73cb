"""Issue 45, the trainer: Megatron's language model (mRoPE, the frozen vision tower's embeddings in its input)
scores recorded image sessions as the engine did.

Sessions are recorded the real way (the gateway in front of sgl-router and the CPU engine serving the tiny
Qwen2.5-VL, images in several turns); the trainer reads them from the store as a job does (``to_train_sample``
with the store's image files), packs them and computes every generated token's log-prob, which must equal the
engine's recorded one. Without the images' inputs (no embeddings, plain RoPE) the same tokens score otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests._gateway_helpers import (
    MODEL,
    GatewayProc,
    engine_and_router,
    new_session,
    openai_client,
    running_gateway,
)
from tests.test_gateway_vision import PICS, data_url, png

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def recorded(vl_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProc, list[str]]]:
    """Two sessions of three turns, an image in each user turn (the first and last the same in both, the second of
    the same size but another), sampled at temperature 1 with the turn's seed."""
    d = tmp_path_factory.mktemp("trainer_vision")
    with engine_and_router(vl_path, d) as url, running_gateway(url, vl_path, d / "db.sqlite", d / "gw.log") as gw:
        c = openai_client(gw)
        sids = []
        for k in range(2):
            sid = new_session(gw)
            messages: list[dict] = []
            for turn, pic in enumerate([PICS[0], png(96, 64, 7 + k), PICS[2]]):
                messages.append({"role": "user", "content": [
                    {"type": "text", "text": f"step {turn}"}, {"type": "image_url", "image_url": {"url": data_url(pic)}}]})
                r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=turn,
                                              extra_headers={"X-Session-ID": sid})
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
            sids.append(sid)
        yield gw, sids


def test_trainer_logprobs_on_recorded_image_sessions_equal_the_engines(recorded, vl_path: Path) -> None:
    from transformers import AutoConfig

    from slime_server.buffer.open import open_store
    from slime_server.trainer.convert import load_hf_checkpoint_into
    from slime_server.trainer.model import build_gpt_model
    from slime_server.trainer.packing import pack_samples
    from slime_server.trainer.parallel import parallel_context
    from slime_server.trainer.samples import to_train_sample
    from slime_server.trainer.train_step import packed_logprobs

    gw, sids = recorded
    store = open_store(str(gw.db_path))
    try:
        trajs = [t for sid in sids for t in store.get_trajectories(sid)]
        blobs = store.get_images([s.sha256 for t in trajs for s in t.images])
    finally:
        store.close()
    assert len(trajs) == 2 and all(len(t.turns) == 3 and len(t.images) == 3 for t in trajs)
    samples = [to_train_sample(t, images=blobs) for t in trajs]
    assert all(len(s.images) == 3 for s in samples)
    with parallel_context(tp_size=1):
        model = build_gpt_model(AutoConfig.from_pretrained(str(vl_path))).eval()
        load_hf_checkpoint_into(model, vl_path)
        # both in one micro-batch, over their token tree: they share the first turn (its image and the answer
        # sampled with the same seed) and part from each other at the second turn's image, another in each
        (mb,) = pack_samples(samples, 4096, share_prefixes=True)
        assert mb.images is not None and mb.tree is not None
        first = samples[0].images[1].offset  # the second turn's image
        pads = samples[0].images[1].length
        assert samples[1].images[1].offset == first and samples[0].tokens[:first + pads] == samples[1].tokens[:first + pads]
        assert mb.tree.num_rows == mb.num_tokens - first  # the same pad ids, another image: shared only up to it
        with torch.no_grad():
            lp, _ = packed_logprobs(model, mb)
            plain = mb.__class__(**{**mb.__dict__, "images": None})  # the same tokens without the images' inputs
            assert getattr(model, "vision", None) is not None
            lp_plain, _ = packed_logprobs(model, plain)
    mask = mb.loss_mask.bool()
    assert int(mask.sum()) == sum(sum(t.loss_mask) for t in trajs) > 30
    diff = (lp[mask] - mb.rollout_logprobs[mask]).abs()
    assert float(diff.max()) < 1e-4, float(diff.max())
    assert float((lp_plain[mask] - mb.rollout_logprobs[mask]).abs().max()) > 1e-2


def image_episode(server, i: int) -> str:
    """A two-turn session with an image in each user turn through the OpenAI SDK, rewarded and closed."""
    import random
    import uuid

    from openai import OpenAI

    from tests._jobs_helpers import AGENT, create_paced, rest

    sid = f"img-{uuid.uuid4().hex[:12]}"
    client = OpenAI(base_url=server.base_url, api_key=AGENT, default_headers={"X-Session-Id": sid}, max_retries=0)
    messages: list[dict] = []
    for turn in range(2):
        messages.append({"role": "user", "content": [{"type": "text", "text": f"what is {i}?"}, {
            "type": "image_url", "image_url": {"url": data_url(png(56 + 14 * ((i + turn) % 3), 56, i * 2 + turn))}}]})
        r = create_paced(client, model=Path(server.deployment.model_path).name, max_tokens=5, temperature=1.0,
                         messages=messages, seed=i)
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    with rest(server) as c:
        c.post(f"/sessions/{sid}/reward", json={"reward": random.random()}).raise_for_status()
        c.post(f"/sessions/{sid}/close").raise_for_status()
    return sid


def test_a_live_job_trains_on_image_sessions_and_pushes(vl_path: Path, tmp_path: Path) -> None:
    """A job on the tiny VLM: three steps over sessions whose every turn shows an image, each pushed to the engine
    (its weight version follows), the trainer's first-step log-probs those the engine recorded (no drift)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests._jobs_helpers import admin, create_job, engine_versions, running_stack, wait_event, wait_job

    with running_stack(vl_path, tmp_path) as server:
        j = create_job(server, max_staleness=None)
        wait_event(server, j["id"], "trainer_ready")
        with ThreadPoolExecutor(4) as pool:
            sessions = list(pool.map(lambda i: image_episode(server, i), range(14)))
        j = wait_job(server, j["id"], lambda j: j["step"] >= 3, timeout=300)
        with admin(server) as c:
            metrics = [m["metrics"] for m in c.get(f"/jobs/{j['id']}/metrics").raise_for_status().json()]
        assert len(metrics) >= 3 and all(m["loss"] == m["loss"] for m in metrics[:3])
        # the first step's policy is the engine's: the trainer's log-probs equal the recorded ones
        assert metrics[0]["train_rollout_logprob_abs_diff"] < 1e-4, metrics[0]
        pushed = wait_job(server, j["id"], lambda j: j["policy_version"] >= 3)["policy_version"]
        deadline = time.monotonic() + 60
        while int(engine_versions(server)[0]) < 3:  # the engine serves a pushed policy
            assert time.monotonic() < deadline, (engine_versions(server), pushed)
            time.sleep(0.2)
        assert len(sessions) == 14
