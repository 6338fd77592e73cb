"""The CPU engine serving a mixture-of-experts model (the tiny Qwen3-MoE built locally): answers as HF's model does,
batched, before and after a weight update by the checkpoint's per-expert names; and routed experts returned as
SGLang 0.5.23 returns them (``--enable-return-routed-experts``, ``return_routed_experts``,
``routed_experts_start_len``; base64 int32 [seqlen - 1 - start_len, layers, top-k], final answer only), equal to
the experts HF's router picks for the same tokens, kept through the prefix cache."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from slime_server.rollout import engine_routes
from slime_server.rollout.cpu_engine import CPUEngine, EngineConfig
from slime_server.rollout.protocol import SamplingParams
from tests._engine_helpers import engine_process

PROMPTS = [[5, 6, 7, 8], list(range(10, 50)), list(range(1, 100)) * 2, [3]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
NEAR_TIE = 1e-5  # router probabilities this close are a tie that float rounding may break either way


@pytest.fixture(scope="module")
def moe_path() -> Path:
    from slime_server.models.tiny import ensure_tiny_model, tiny_moe_spec

    return ensure_tiny_model(spec=tiny_moe_spec())


@pytest.fixture(scope="module")
def moe_config(moe_path: Path) -> dict:
    return json.loads((moe_path / "config.json").read_text())


def _answers(engine: CPUEngine) -> list:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return [o for outs in pool.map(lambda p: engine.generate(p, GREEDY, return_logprob=True,
                                                                 return_routed_experts=True), PROMPTS) for o in outs]


def _same_answers(got: list, want: list) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor([e[0] for e in a.meta_info.output_token_logprobs]),
                                   torch.tensor([e[0] for e in b.meta_info.output_token_logprobs]), atol=1e-4, rtol=0)


def _copy_with(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint directory: ``src``'s config and tokenizer, ``tensors`` as its weights."""
    from safetensors.torch import save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def test_the_lean_moe_forward_answers_as_hfs_model_before_and_after_an_update(moe_path: Path, tmp_path: Path) -> None:
    from slime_server.trainer.convert import read_hf_state_dict

    lean = CPUEngine(EngineConfig(model_path=str(moe_path), max_running_requests=8))
    hf = CPUEngine(EngineConfig(model_path=str(moe_path), max_running_requests=8, forward="hf"))
    try:
        assert lean.lean is not None and lean.lean.num_experts == 8 and hf.model is not None
        before = _answers(lean)
        _same_answers(before, _answers(hf))
        # an update by the checkpoint's (SGLang's) names: every expert, the routers and the rest
        torch.manual_seed(1)
        state = read_hf_state_dict(moe_path)
        assert "model.layers.3.mlp.experts.7.up_proj.weight" in state and "model.layers.0.mlp.gate.weight" in state
        updated = {n: t * (1 + 0.3 * torch.rand_like(t)) for n, t in state.items()}
        lean.load_weights(list(updated.items()), "v1")
        after = _answers(lean)
        assert [a.output_ids for a in after] != [b.output_ids for b in before]
        reference = CPUEngine(EngineConfig(model_path=str(_copy_with(moe_path, tmp_path / "v1", updated)),
                                           max_running_requests=8, forward="hf"))
        try:
            _same_answers(after, _answers(reference))
        finally:
            reference.shutdown()
    finally:
        lean.shutdown()
        hf.shutdown()


def _hf_routes(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's top-k experts of every position of ``ids`` [positions, layers, k], and the gap between the k-th and the
    next probability (where it is tiny, float rounding may pick either)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    probs = torch.stack([logits.float().softmax(-1) for logits in out.router_logits], dim=1)  # [pos, layers, E]
    top = probs.topk(k + 1, dim=-1)
    return top.indices[..., :k], top.values[..., k - 1] - top.values[..., k]


def test_routed_experts_are_the_experts_hfs_router_picks(moe_path: Path, moe_config: dict) -> None:
    from transformers import AutoModelForCausalLM

    layers, k = moe_config["num_hidden_layers"], moe_config["num_experts_per_tok"]
    model = AutoModelForCausalLM.from_pretrained(moe_path).eval()
    engine = CPUEngine(EngineConfig(model_path=str(moe_path), max_running_requests=8,
                                    enable_return_routed_experts=True))
    try:
        for prompt, out in zip(PROMPTS, _answers(engine), strict=True):
            routes = engine_routes.decode(out.meta_info.routed_experts, layers, k)
            ids = prompt + out.output_ids
            assert routes.shape == (len(ids) - 1, layers, k) and routes.dtype == torch.int32
            want, gap = _hf_routes(model, ids[:-1])
            clear = gap > NEAR_TIE
            assert clear.float().mean() > 0.99
            assert torch.equal(routes[clear], want[clear].to(torch.int32))
    finally:
        engine.shutdown()


def test_routed_experts_over_http_as_sglang_answers_them(moe_path: Path, moe_config: dict, tmp_path: Path) -> None:
    layers, k = moe_config["num_hidden_layers"], moe_config["num_experts_per_tok"]
    system = list(range(200, 260))  # a shared prefix long enough for the prefix cache
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with engine_process(moe_path, tmp_path, "--enable-return-routed-experts") as url, httpx.Client(timeout=60) as c:
        assert c.get(f"{url}/server_info").json()["enable_return_routed_experts"] is True
        first = c.post(f"{url}/generate", json={"input_ids": system + [7], "sampling_params": sp,
                                                "return_routed_experts": True}).json()
        full = engine_routes.decode(first["meta_info"]["routed_experts"], layers, k)
        assert full.shape == (len(system) + 1 + 6 - 1, layers, k)
        # the next turn extends the first: its prefix comes from the cache, with the routes computed then
        turn = system + [7] + first["output_ids"] + [9, 10]
        second = c.post(f"{url}/generate", json={"input_ids": turn, "sampling_params": sp,
                                                 "return_routed_experts": True,
                                                 "routed_experts_start_len": len(system)}).json()
        assert second["meta_info"]["cached_tokens"] >= len(system)
        tail = engine_routes.decode(second["meta_info"]["routed_experts"], layers, k)
        assert tail.shape == (len(turn) + 6 - 1 - len(system), layers, k)
        assert torch.equal(tail[: full.shape[0] - len(system)], full[len(system):])
        # streamed: the routes come with the final chunk only
        with c.stream("POST", f"{url}/generate", json={"input_ids": system + [8], "sampling_params": sp,
                                                       "return_routed_experts": True, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert [ch["meta_info"].get("routed_experts") is not None for ch in chunks] == [False] * 5 + [True]
        # not asked: not answered; asked outside [0, prompt tokens]: refused in SGLang's words
        plain = c.post(f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": sp}).json()
        assert "routed_experts" not in plain["meta_info"]
        for start, words in ((-1, "lower than 0"), (4, "higher than the number of input tokens")):
            bad = c.post(f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": sp,
                                                  "return_routed_experts": True, "routed_experts_start_len": start})
            assert bad.status_code == 400 and words in bad.text


def test_routed_experts_are_only_answered_by_a_server_started_for_them(moe_path: Path, tiny_model_path: Path,
                                                                       tmp_path: Path) -> None:
    with engine_process(moe_path, tmp_path) as url:  # without the flag: a request asking gets none, as from SGLang
        answer = httpx.post(f"{url}/generate", json={"input_ids": [1, 2, 3], "return_routed_experts": True,
                                                     "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert answer.status_code == 200 and "routed_experts" not in answer.json()["meta_info"]
    for path, forward in ((tiny_model_path, "lean"), (moe_path, "hf")):
        with pytest.raises(ValueError, match="enable-return-routed-experts needs a mixture-of-experts model"):
            CPUEngine(EngineConfig(model_path=str(path), forward=forward, enable_return_routed_experts=True))


def test_the_routed_experts_flag_and_fields_are_sglangs() -> None:
    """The engine's flag is a field of SGLang 0.5.23's ServerArgs with its default; the request fields are its
    GenerateReqInput's, with its defaults (read from the wheel)."""
    from slime_server.rollout.engine_server import build_parser
    from slime_server.rollout.protocol import GenerateReqInput
    from tests._sglang_source import io_struct_classes, io_struct_defaults
    from tests.test_sglang_launcher import sglang_0_5_23_server_arg_names

    flag = next(a for a in build_parser()._actions if a.dest == "enable_return_routed_experts")
    assert flag.default is False and flag.dest in sglang_0_5_23_server_arg_names()
    theirs, defaults = io_struct_classes()["GenerateReqInput"], io_struct_defaults()["GenerateReqInput"]
    for name in ("return_routed_experts", "routed_experts_start_len"):
        assert name in theirs and GenerateReqInput.model_fields[name].default == defaults[name]


def test_an_moe_engine_serves_attention_adapters_as_peft_computes_them(moe_path: Path, tmp_path: Path) -> None:
    """LoRA on the MoE engine: an adapter on the attention projections is served as HF PEFT computes it over the
    HF MoE model; one on the MLP (the experts) is refused by name (the trainer trains none there either)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.test_engine_lora import _save_adapter

    attention = _save_adapter(moe_path, tmp_path / "attention", 3, r=4, lora_alpha=8,
                              target_modules=["q_proj", "v_proj", "o_proj"])
    engine = CPUEngine(EngineConfig(model_path=str(moe_path), enable_lora=True, lora_paths=[f"att={attention}"]))
    try:
        prompt = list(range(30, 46))
        (out,) = engine.generate(prompt, GREEDY, return_logprob=True, lora=engine.adapters.resolve("att"))
        (base,) = engine.generate(prompt, GREEDY, return_logprob=True)
        assert out.output_ids != base.output_ids
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moe_path), str(attention)).eval()
        ids = torch.tensor([prompt + out.output_ids])
        with torch.no_grad():
            lp = peft(ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
        want = lp.gather(-1, torch.tensor(out.output_ids)[:, None])[:, 0]
        got = torch.tensor([e[0] for e in out.meta_info.output_token_logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        from slime_server.lora_format import AdapterError

        mlp = tmp_path / "mlp"  # PEFT cannot put an adapter on transformers' fused experts: its config says so
        shutil.copytree(attention, mlp)
        config = json.loads((mlp / "adapter_config.json").read_text())
        (mlp / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "up_proj"]}))
        with pytest.raises(AdapterError, match="up_proj"):
            engine.adapters.load("mlp", str(mlp))
    finally:
        engine.shutdown()
