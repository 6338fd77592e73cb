"""LoRA serving on the CPU engine, SGLang 0.5.23's contract (issue 43): adapters in PEFT's format loaded at start
(``--lora-paths``) or live (``/load_lora_adapter``), chosen per request by ``lora_path`` (the adapter's name), mixed
with each other and the base in one decode batch, never sharing prefix K/V, and served as HF PEFT computes them.

The adapters are PEFT's own (``get_peft_model`` + ``save_pretrained``) with random A and B on the tiny model, so a
layout mistake in any projection shows; one targets every projection at rank 8, one a few at rank 4.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests._engine_helpers import engine_process, hf_greedy, hf_logprobs, hf_model

PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]]
NEW = 12


def _save_adapter(base: Path, out: Path, seed: int, **lora: Any) -> Path:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf_model(base), LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("engine-lora")
    return {"full": _save_adapter(tiny_model_path, tmp / "full", 1, r=8, lora_alpha=16, target_modules="all-linear"),
            "few": _save_adapter(tiny_model_path, tmp / "few", 2, r=4, lora_alpha=4,
                                 target_modules=["k_proj", "o_proj", "up_proj"]),
            "big": _save_adapter(tiny_model_path, tmp / "big", 3, r=16, lora_alpha=16, target_modules=["q_proj"])}


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    with engine_process(tiny_model_path, tmp_path_factory.mktemp("engine-lora-logs"), "--enable-lora",
                        "--max-lora-rank", "8", "--max-loaded-loras", "3",
                        "--lora-paths", f"full={adapters['full']}",
                        json.dumps({"lora_name": "pinned-few", "lora_path": str(adapters["few"]), "pinned": True})
                        ) as url:
        yield url


def _generate(url: str, prompt: list[int], lora: str | None, **extra: Any) -> dict[str, Any]:
    body = {"input_ids": prompt, "return_logprob": True, "lora_path": lora,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}, **extra}
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _peft(base: Path, adapter: Path | None) -> Any:
    from peft import PeftModel

    model = hf_model(base)
    return model if adapter is None else PeftModel.from_pretrained(model, str(adapter)).eval()


def test_an_adapter_is_served_as_peft_computes_it(engine: str, tiny_model_path: Path, adapters: dict[str, Path]) -> None:
    """Greedy ids equal PEFT's and the log-probs PEFT's to 1e-4, for both adapters and the base, each distinct."""
    outs = {}
    for lora, adapter in ((None, None), ("full", adapters["full"]), ("pinned-few", adapters["few"])):
        model = _peft(tiny_model_path, adapter)
        for prompt in PROMPTS:
            got = _generate(engine, prompt, lora)
            ids = got["output_ids"]
            assert ids == hf_greedy(model, prompt, NEW), (lora, prompt)
            lps = [e[0] for e in got["meta_info"]["output_token_logprobs"]]
            torch.testing.assert_close(torch.tensor(lps), torch.tensor(hf_logprobs(model, prompt, ids, 1.0)),
                                       atol=1e-4, rtol=0)
            outs[(lora, tuple(prompt))] = lps
    for prompt in PROMPTS:  # the adapters change what is computed
        assert len({tuple(outs[(lora, tuple(prompt))]) for lora in (None, "full", "pinned-few")}) == 3


def test_one_batch_mixes_adapters_and_the_base(engine: str) -> None:
    """Requests of two adapters and the base, sent together (one decode batch), each get what they get alone."""
    alone = {(lora, i): _generate(engine, p, lora) for lora in (None, "full", "pinned-few")
             for i, p in enumerate(PROMPTS)}
    jobs = [(lora, i) for _ in range(2) for lora in (None, "full", "pinned-few") for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda j: _generate(engine, PROMPTS[j[1]], j[0]), jobs))
    for (lora, i), got in zip(jobs, together, strict=True):
        want = alone[(lora, i)]
        assert got["output_ids"] == want["output_ids"], (lora, i)
        got_lp = [e[0] for e in got["meta_info"]["output_token_logprobs"]]
        want_lp = [e[0] for e in want["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-5, rtol=0)


def test_prefix_kv_is_never_shared_across_adapters(engine: str) -> None:
    """A prompt that extends an answer reuses that answer's K/V under the same adapter only."""
    prompt = list(range(60, 90))
    first = _generate(engine, prompt, "full")
    follow = prompt + first["output_ids"] + [5, 6]
    assert _generate(engine, follow, "full")["meta_info"]["cached_tokens"] > 0
    assert _generate(engine, follow, "pinned-few")["meta_info"]["cached_tokens"] == 0
    assert _generate(engine, follow, None)["meta_info"]["cached_tokens"] == 0


def test_load_unload_and_refusals_are_sglangs(engine: str, adapters: dict[str, Path]) -> None:
    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{engine}{path}", json=body, timeout=120)

    r = post("/load_lora_adapter", {"lora_name": "full", "lora_path": str(adapters["full"])})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "already loaded" in r.json()["error_message"] and set(r.json()["loaded_adapters"]) == {"full", "pinned-few"}
    r = post("/load_lora_adapter", {"lora_name": "big", "lora_path": str(adapters["big"])})
    assert r.status_code == 400 and "rank 16" in r.json()["error_message"], r.text  # above --max-lora-rank 8
    r = post("/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 400 and "does not exist" in r.json()["error_message"] and r.json()["loaded_adapters"] is None
    r = httpx.post(f"{engine}/generate", json={"input_ids": PROMPTS[0], "lora_path": "nope",
                                                "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 400 and "never been loaded: nope" in r.json()["error"]["message"]
    # a second copy under a new name (how an update is published), then the old name unloaded
    r = post("/load_lora_adapter", {"lora_name": "full-v2", "lora_path": str(adapters["full"])})
    assert r.status_code == 200, r.text
    assert r.json() == {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                        "loaded_adapters": {"full": str(adapters["full"]), "pinned-few": str(adapters["few"]),
                                            "full-v2": str(adapters["full"])}}
    assert _generate(engine, PROMPTS[0], "full-v2")["output_ids"] == _generate(engine, PROMPTS[0], "full")["output_ids"]
    r = post("/unload_lora_adapter", {"lora_name": "full"})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"pinned-few", "full-v2"}
    # unloaded, it is loaded again when a request names it (SGLang's implicit reload): the request waits, works
    again = _generate(engine, PROMPTS[0], "full")
    assert again["output_ids"] == _generate(engine, PROMPTS[0], "full-v2")["output_ids"]
    # --max-loaded-loras 3: a fourth evicts the least recently requested unpinned one ("full": "full-v2" was asked
    # for after it), never the pinned one
    r = post("/load_lora_adapter", {"lora_name": "few-2", "lora_path": str(adapters["few"])})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"pinned-few", "full-v2", "few-2"}, r.text


def test_load_from_tensors_is_sglangs(engine: str, adapters: dict[str, Path]) -> None:
    """``/load_lora_adapter_from_tensors`` (0.5.23's fields): a PEFT config and its tensors by shared memory, a
    flattened bucket or SGLang's plain dict, serve as the same adapter loaded from its directory; a checksum that
    does not match, or added tokens, load nothing; an unloaded tensor adapter is not reloaded on demand
    (SGLang's refusal: it tries its path, ``__tensor__``)."""
    import hashlib

    from safetensors.torch import load_file

    from slime_server.weights import serialize, serialize_flattened_bucket

    config = json.loads((adapters["full"] / "adapter_config.json").read_text())
    tensors = load_file(str(adapters["full"] / "adapter_model.safetensors"))
    sums = {k: hashlib.sha256(v.contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in tensors.items()}

    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{engine}{path}", json=body, timeout=120)

    r = post("/load_lora_adapter_from_tensors", {
        "lora_name": "t-flat", "config_dict": config, "load_format": "flattened_bucket",
        "serialized_named_tensors": [serialize_flattened_bucket(sorted(tensors.items()))]})
    assert r.status_code == 200 and r.json()["loaded_adapters"]["t-flat"] == "__tensor__", r.text
    want = _generate(engine, PROMPTS[1], "full-v2")
    got = _generate(engine, PROMPTS[1], "t-flat")
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]
    assert post("/unload_lora_adapter", {"lora_name": "t-flat"}).status_code == 200
    r = httpx.post(f"{engine}/generate", json={"input_ids": PROMPTS[0], "lora_path": "t-flat",
                                                "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 400 and "Failed to implicitly load LoRA adapter t-flat" in r.json()["error"]["message"]

    bad = dict(sums, **{next(iter(sums)): "0" * 64})
    for body, words in (({"expected_checksums": bad}, "LORA-CHECK"),
                        ({"expected_checksums": {k: v for k, v in list(sums.items())[1:]}}, "1 extra"),
                        ({"added_tokens_config": {"<x>": 49152}}, "added tokens")):
        r = post("/load_lora_adapter_from_tensors", {"lora_name": "t-dict", "config_dict": config,
                                                     "serialized_named_tensors": [serialize(dict(tensors))], **body})
        assert r.status_code == 400 and words in r.json()["error_message"], r.text
        assert "t-dict" not in r.json()["loaded_adapters"]
    r = post("/load_lora_adapter_from_tensors", {"lora_name": "t-dict", "config_dict": config,
                                                 "serialized_named_tensors": [serialize(dict(tensors))],
                                                 "expected_checksums": sums})
    assert r.status_code == 200, r.text
    assert _generate(engine, PROMPTS[1], "t-dict")["output_ids"] == want["output_ids"]
    assert post("/unload_lora_adapter", {"lora_name": "t-dict"}).status_code == 200


def test_the_engines_lora_flags_are_sglangs() -> None:
    """Every LoRA flag of the CPU engine is a field of SGLang 0.5.23's ServerArgs, with SGLang's default where both
    have one (read from the wheel's arg_groups/fields/lora.py)."""
    import ast

    from slime_server.rollout.engine_server import build_parser
    from tests._sglang_source import sglang_file
    from tests.test_sglang_launcher import sglang_0_5_23_server_arg_names

    ours = {a.dest: a.default for a in build_parser()._actions if "lora" in a.dest}
    assert set(ours) == {"enable_lora", "max_lora_rank", "lora_target_modules", "lora_paths", "max_loras_per_batch",
                         "max_loaded_loras"}
    assert set(ours) <= set(sglang_0_5_23_server_arg_names())
    tree = ast.parse(sglang_file("sglang/srt/arg_groups/fields/lora.py").read_text())
    theirs = {n.target.id: ast.literal_eval(n.value) for c in tree.body if isinstance(c, ast.ClassDef)
              for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None
              and n.target.id in ours}
    assert theirs["max_loras_per_batch"] == ours["max_loras_per_batch"] == 8
    assert all(theirs[k] is None and ours[k] is None for k in ("max_lora_rank", "lora_target_modules", "max_loaded_loras"))


def test_the_real_router_forwards_the_adapter(engine: str, tmp_path: Path) -> None:
    """sgl-router 0.3.2 passes ``lora_path`` through to the engine (the gateway's path to an adapter), and the
    engine's refusal of an unknown adapter back."""
    import time

    from slime_server.config import RouterSettings
    from slime_server.rollout.router import RouterProcess

    with RouterProcess(RouterSettings(), log_path=tmp_path / "router.log") as router:
        router.start(worker_urls=[engine])
        deadline = time.monotonic() + 60
        while not router.worker_urls(healthy_only=True):
            assert time.monotonic() < deadline, "the router never saw the engine healthy"
            time.sleep(0.2)
        via = _generate(router.url, PROMPTS[0], "pinned-few")
        assert via["output_ids"] == _generate(engine, PROMPTS[0], "pinned-few")["output_ids"]
        base = _generate(engine, PROMPTS[0], None)["meta_info"]["output_token_logprobs"]
        assert via["meta_info"]["output_token_logprobs"] != base
        r = httpx.post(f"{router.url}/generate", json={"input_ids": PROMPTS[0], "lora_path": "nope",
                                                       "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 400 and "never been loaded: nope" in r.json()["error"]["message"]


def test_a_request_never_runs_on_an_unloaded_adapters_slot(tiny_model_path: Path, adapters: dict[str, Path]) -> None:
    """A request that resolved an adapter which is unloaded before it is queued is refused (its slot may hold
    another adapter by then), and naming the adapter again loads it anew (a new load: new slot contents, new
    prefix-cache namespace)."""
    from slime_server.rollout.cpu_engine import BadRequest, CPUEngine
    from slime_server.rollout.engine_config import EngineConfig
    from slime_server.rollout.protocol import SamplingParams

    engine = CPUEngine(EngineConfig(model_path=str(tiny_model_path), num_threads=1, enable_lora=True,
                                    max_lora_rank=8, lora_paths=[f"few={adapters['few']}"]))
    try:
        params = SamplingParams(max_new_tokens=3, temperature=0.0)
        stale = engine.adapters.resolve("few")
        seq = engine.new_sequences(PROMPTS[0], params, lora=stale)[0]
        engine.adapters.unload("few")
        with pytest.raises(BadRequest, match="unloaded"):
            engine.submit(seq)
        fresh = engine.adapters.resolve("few")
        assert fresh is not stale and fresh.uid != stale.uid
        again = engine.new_sequences(PROMPTS[0], params, lora=fresh)[0]
        engine.submit(again)
        assert again.done.wait(60) and len(again.output_ids) == 3
    finally:
        engine.shutdown()
