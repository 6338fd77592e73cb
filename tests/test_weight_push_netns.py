"""A weight push across two network namespaces (two test hosts on one machine, joined by a veth pair):
the trainer side in one, a CPU engine process in the other. Nothing is shared but the wire and the disk
the checkpoint is read from, so the pusher picks SGLang's distributed path by itself (the engine's
address is not this host's), forms the gloo group through SGLang's rendezvous across the link, and
broadcasts a >= 200 MB model; the engine then serves exactly the pushed weights. The engine listens on its
link address, so it must have an API key (it refuses to start without one): every call sends it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from slime_server.models.tiny import ensure_tiny_model
from slime_server.rollout.engine_auth import KEY_ENV
from slime_server.utils.procs import kill_group, spawn
from tests._netns_helpers import two_namespaces
from tests._tools_helpers import load_tool

pytestmark = pytest.mark.timeout(420)
NET = "10.213.7"  # the two test hosts' own link (made here, removed after)
KEY = "netns-engine-key"


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str]]:
    """Namespaces A (trainer, NET.1) and B (engine, NET.2) joined by veth; removed afterwards."""
    with two_namespaces(NET) as hosts:
        yield hosts


TRAINER = textwrap.dedent("""
    import json, sys, httpx, torch
    from transformers import AutoModelForCausalLM
    from slime_server.trainer.weight_push import WeightPusher
    url, ckpt, out, key = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    named = [(n, t) for n, t in model.state_dict().items() if n != "lm_head.weight"]
    with WeightPusher([url], bucket_bytes=64 * 2**20, sender=True, api_key=key) as pusher:
        stats = pusher.push(iter(named), version="netns-1")
    prompt = [5, 6, 7, 8, 9]
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
    served = httpx.post(f"{url}/generate", json=body, timeout=120, headers={"Authorization": f"Bearer {key}"}).json()
    ids = list(prompt)  # greedy as the engine's ignore_eos: argmax every step, EOS included (generate stops there)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    ref = ids[len(prompt):]
    json.dump({"mode": stats.mode, "bytes": stats.bytes, "gbps": stats.gbps, "buckets": stats.buckets,
               "served": served["output_ids"], "version": served["meta_info"]["weight_version"],
               "reference": ref}, open(out, "w"))
""")


def test_distributed_push_between_two_network_namespaces(two_hosts: tuple[str, str], tmp_path: Path) -> None:
    a, b = two_hosts
    bench = load_tool("bench_weight_sync.py")
    ckpt = tmp_path / "ckpt"
    state = bench.save_checkpoint(bench.bench_config(2, 1024, 32000), ckpt, ensure_tiny_model())
    assert sum(t.numel() * t.element_size() for t in state.values()) >= 200e6
    engine = spawn(["ip", "netns", "exec", b, sys.executable, "-m", "slime_server.rollout.engine_server",
                    "--model-path", str(ckpt), "--host", f"{NET}.2", "--port", "30777", "--num-threads", "1"],
                   env={"OMP_NUM_THREADS": "1", KEY_ENV: KEY}, log_path=str(tmp_path / "engine.log"))
    try:
        out = tmp_path / "result.json"
        wait = (f"import httpx,time\nfor _ in range(600):\n  try:\n    httpx.get('http://{NET}.2:30777/health')"
                f".raise_for_status(); break\n  except Exception: time.sleep(0.2)\nelse: raise SystemExit(1)")
        subprocess.run(["ip", "netns", "exec", a, sys.executable, "-c", wait], check=True, timeout=180)
        subprocess.run(["ip", "netns", "exec", a, sys.executable, "-c", TRAINER, f"http://{NET}.2:30777",
                        str(ckpt), str(out), KEY], check=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        kill_group(engine)
    import json

    res = json.loads(out.read_text())
    assert res["mode"] == "distributed" and res["bytes"] >= 200e6 and res["buckets"] >= 3
    assert res["version"] == "netns-1"
    assert res["served"] == res["reference"]
    print(f"push across namespaces: {res['bytes'] / 1e6:.0f} MB in {res['buckets']} buckets, "
          f"{res['gbps']:.2f} GB/s")
