"""TP=2, DP=2 and PP=2 trainer groups (separate gloo processes) reproduce the single-process run.

The model has an odd vocabulary (101), so TP=2 pads the vocab and the vocab-parallel
log-softmax must ignore the padding column; DP=2 checks that the global loss normaliser and
the DDP gradient scaling give the same update as one process seeing the whole batch.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from slime_server.models.tiny_vl import ensure_tiny_vl_model
from slime_server.server.local_ray import start_local_ray
from slime_server.trainer.packing import pack_samples
from tests._engine_helpers import thread_affinities
from tests._megatron_helpers import make_config, save_random_hf_model
from tests._trainer_helpers import load_result, make_batch, run_plan, write_inputs

STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from slime_server.trainer.actor import TrainerRankSettings
    from slime_server.trainer.settings import LoRASettings, LossConfig, OptimizerSettings
    from slime_server.trainer.train_step import TrainStepSettings

    tmp = tmp_path_factory.mktemp("trainer_tp")
    hf_dir = tmp / "hf"
    save_random_hf_model(make_config("qwen3", num_key_value_heads=2), hf_dir, seed=3)
    settings = TrainerRankSettings(
        hf_path=str(hf_dir), optimizer=OptimizerSettings(lr=3e-3, clip_grad=1.0, weight_decay=0.01),
        train=TrainStepSettings(max_tokens_per_micro_batch=64, temperature=0.9,
                                loss=LossConfig(loss_type="grpo", entropy_coef=0.01)),
    )
    samples = make_batch(vocab_size=101, n=6, seed=1, shared=True)  # the token tree on every layout
    assert sum(mb.tree is not None for mb in pack_samples(samples, 64, share_prefixes=True)) >= 2
    out: dict[str, Any] = {"settings": settings.model_dump(), "samples": samples, "hf": hf_dir}
    # tied embeddings across stages (the last stage's output layer is the first stage's embedding: its
    # gradient is summed over both), two layers per stage
    tied_dir = tmp / "hf-tied"
    save_random_hf_model(make_config("qwen3", num_key_value_heads=2, num_hidden_layers=4, tie_word_embeddings=True),
                         tied_dir, seed=4)
    tied = settings.model_copy(update={"hf_path": str(tied_dir)})
    # a KL term to a frozen reference: the reference model is pipelined like the policy
    kl = tied.model_copy(update={"reference": True, "train": tied.train.model_copy(update={
        "loss": LossConfig(loss_type="grpo", kl_coef=0.5, kl_type="low_var_kl")})})
    # LoRA (issue 43): an adapter over the frozen base; its KL reference is the base with the adapter off
    lora = settings.model_copy(update={"lora": LoRASettings(rank=4, alpha=8.0)})
    lora_kl = kl.model_copy(update={"lora": LoRASettings(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj",
                                                                                          "o_proj", "down_proj"])})
    users = settings.model_copy(update={"lora": LoRASettings(rank=4, alpha=8.0, adapters=3)})
    # a vision-language model (issue 45): samples with images, the language model under mRoPE and the tower's embeddings
    vl = settings.model_copy(update={"hf_path": str(ensure_tiny_vl_model())})
    vl_samples = image_batch(ensure_tiny_vl_model())
    user_samples = [s.model_copy(update={"adapter": i % 3}) for i, s in enumerate(samples)]
    # name, world size, settings, extra keys of the run; grouped by world size, each group one set of rank processes
    runs: list[tuple[str, int, Any, dict[str, Any]]] = [
        ("tp1", 1, settings, {"save_at": 1, "ckpt": tmp / "ckpt-tp1"}),
        ("tied_pp1", 1, tied, {}), ("kl_pp1", 1, kl, {}),
        ("tp2", 2, settings.model_copy(update={"tp_size": 2}), {}), ("dp2", 2, settings, {}),
        ("pp2", 2, settings.model_copy(update={"pp_size": 2}), {"save_at": 1, "ckpt": tmp / "ckpt-pp2"}),
        ("tied_pp2", 2, tied.model_copy(update={"pp_size": 2}), {}),
        ("kl_pp2", 2, kl.model_copy(update={"pp_size": 2}), {}),
        # resharding: the checkpoint after step 1 resumed on another layout takes steps 2 and 3
        ("tp1_to_pp2", 2, settings.model_copy(update={"pp_size": 2}),
         {"steps": STEPS - 1, "load": tmp / "ckpt-tp1"}),
        ("pp2_to_tp2", 2, settings.model_copy(update={"tp_size": 2}), {"steps": STEPS - 1, "load": tmp / "ckpt-pp2"}),
        ("tp2pp2", 4, settings.model_copy(update={"tp_size": 2, "pp_size": 2}), {}),
        ("lora_tp1", 1, lora, {"save_at": 1, "ckpt": tmp / "ckpt-lora-tp1"}),
        ("lora_tp1_resumed", 1, lora, {"steps": STEPS - 1, "load": tmp / "ckpt-lora-tp1"}),
        ("lora_kl_pp1", 1, lora_kl, {}),
        ("lora_tp2", 2, lora.model_copy(update={"tp_size": 2}), {}),
        ("lora_kl_pp2", 2, lora_kl.model_copy(update={"pp_size": 2}), {}),
        ("lora_tp1_to_pp2", 2, lora.model_copy(update={"pp_size": 2}), {"steps": STEPS - 1, "load": tmp / "ckpt-lora-tp1"}),
        ("lora_kl_tp2pp2", 4, lora_kl.model_copy(update={"tp_size": 2, "pp_size": 2}), {}),
        # several users' adapters in one step: each sample through its user's adapter, on every layout
        ("users_tp1", 1, users, {"batch_samples": user_samples}),
        ("users_tp2", 2, users.model_copy(update={"tp_size": 2}), {"batch_samples": user_samples}),
        ("users_pp2", 2, users.model_copy(update={"pp_size": 2}), {"batch_samples": user_samples}),
        ("vl_tp1", 1, vl, {"batch_samples": vl_samples}),
        ("vl_tp2", 2, vl.model_copy(update={"tp_size": 2}), {"batch_samples": vl_samples}),
    ]
    for world in (1, 2, 4):
        jobs = []
        for name, w, run_settings, extra in runs:
            if w != world:
                continue
            run_dir = tmp / name
            run_dir.mkdir()
            extra = dict(extra)
            settings_path, batch_path = write_inputs(run_dir, run_settings, extra.pop("batch_samples", samples))
            jobs.append({"settings": settings_path, "batch": batch_path, "out": run_dir / "out.pt", "steps": STEPS,
                         **extra})
        run_plan(world, tmp, jobs)
    for name, *_ in runs:
        out[name] = load_result(tmp / name / "out.pt")
    out["hf_tied"], out["ckpt_lora"] = tied_dir, tmp / "ckpt-lora-tp1"
    return out


def image_batch(vl_path: Any) -> list[Any]:
    """Four samples on the tiny VLM: text, an image's pads (1 or 2 images of 4 and 8 pads, as the processor counts
    them), more text, then a response (mask 1) with advantages of both signs."""
    import random

    from transformers import AutoConfig

    from slime_server.trainer.types import SampleImage, TrainSample
    from tests.test_gateway_vision import PICS

    cfg = AutoConfig.from_pretrained(str(vl_path))
    pad, start, end = cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id
    rng = random.Random(5)
    out = []
    for i in range(4):
        tokens, images = [rng.randrange(1000) for _ in range(5)], []
        for pic, length in [(PICS[0], 4), (PICS[1], 8)][: 1 + i % 2]:
            tokens.append(start)
            images.append(SampleImage(offset=len(tokens), length=length, sha256=f"{i}-{length}", data=pic))
            tokens += [pad] * length + [end] + [rng.randrange(1000) for _ in range(3)]
        prompt = len(tokens)
        tokens += [rng.randrange(1000) for _ in range(6 + i)]
        n = len(tokens)
        out.append(TrainSample(tokens=tokens, loss_mask=[0] * prompt + [1] * (n - prompt),
                               rollout_logprobs=[0.0] * prompt + [-2.0 - 0.1 * k for k in range(n - prompt)],
                               weight_versions=[-1] * prompt + [0] * (n - prompt), reward=float(i % 2),
                               advantages=[0.0] * prompt + [1.0 if i % 2 else -1.0] * (n - prompt), images=images))
    return out


def _series(run: dict, key: str) -> list[float]:
    return [m[key] for m in run["metrics"]]


def test_single_process_run_learns(runs: dict[str, dict]) -> None:
    logprob = _series(runs["tp1"], "masked_logprob_sum")
    losses = _series(runs["tp1"], "loss")
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses + logprob)))
    assert len(set(logprob)) == STEPS and len(set(losses)) == STEPS, "the weights must change between steps"


@pytest.mark.parametrize("name", ["tp2", "dp2", "pp2", "tied_pp2", "tp2pp2", "kl_pp2", "vl_tp2"])
def test_parallel_run_matches_single_process(runs: dict[str, dict], name: str) -> None:
    """Issue 19: PP = 2 (Megatron's 1F1B schedule over gloo p2p, 3 micro-batches per step) gives PP = 1's loss,
    grad norm, log-probs and updated weights, as TP = 2 and DP = 2 do; with tied embeddings too; and (issue 45)
    TP = 2 on a vision-language model's image samples."""
    ref, run = runs[{"tied_pp2": "tied_pp1", "kl_pp2": "kl_pp1", "vl_tp2": "vl_tp1"}.get(name, "tp1")], runs[name]
    if name == "kl_pp2":  # the KL term is 0 on the first step (policy = reference), then part of the loss
        kl = _series(ref, "kl")
        assert kl[0] == pytest.approx(0.0, abs=1e-9) and kl[-1] > 0
        assert _series(run, "kl") == pytest.approx(kl, abs=1e-7, rel=1e-5)
    if name.endswith("pp2"):  # the same micro-batches, through the pipeline (and TP inside each stage)
        assert _series(run, "micro_batches") == _series(ref, "micro_batches") and _series(ref, "micro_batches")[0] > 1
    assert run["layout"]["tp_size"] == (2 if "tp2" in name else 1)
    assert run["layout"]["dp_size"] == (2 if name == "dp2" else 1)
    assert run["layout"]["pp_size"] == (2 if name.endswith("pp2") else 1)
    assert run["initial_logprob"] == pytest.approx(ref["initial_logprob"], abs=1e-3, rel=1e-6)
    assert _series(run, "loss") == pytest.approx(_series(ref, "loss"), abs=1e-5, rel=0)
    assert _series(run, "masked_logprob_sum") == pytest.approx(_series(ref, "masked_logprob_sum"), abs=1e-3, rel=1e-6)
    for key in ("grad_norm", "lr", "clip_fraction"):
        assert _series(run, key) == pytest.approx(_series(ref, key), abs=1e-5, rel=1e-5)
    assert ref["weights"].keys() == run["weights"].keys()
    for k, w in ref["weights"].items():
        # Adam divides by sqrt(v): where a gradient is ~0, float-rounding differences between the
        # sharded and unsharded matmuls become visible in single elements (seen: 7e-5 max, 1e-8 mean).
        diff = (run["weights"][k] - w).abs()
        assert diff.max() < 5e-4 and diff.mean() < 1e-6, (k, float(diff.max()), float(diff.mean()))



@pytest.mark.slow
@pytest.mark.parametrize("split", ["tp_size", "pp_size"])
def test_ray_trainer_group_of_two(runs: dict[str, dict], split: str) -> None:
    """The same TP=2 (or PP=2) job as Ray actors: HF weights round-trip exactly (every stage's, for PP), and one
    step matches the run above. The ranks are pinned to one core (trainer.cpus): every thread of each runs there."""
    import ray

    from slime_server.trainer.actor import TrainerGroup, TrainerRankSettings
    from slime_server.trainer.convert import read_hf_state_dict

    core = max(os.sched_getaffinity(0))
    settings = TrainerRankSettings.model_validate(runs["settings"]).model_copy(update={split: 2, "cpus": [core]})
    if ray.is_initialized():  # the session's (conftest): this test sizes its own
        ray.shutdown()
    start_local_ray(2, include_dashboard=False, log_to_driver=False)  # never a stale cluster
    try:
        group = TrainerGroup(settings, world_size=2)
        layouts = group.setup()
        assert sorted(lay[split.replace("size", "rank")] for lay in layouts) == [0, 1]
        for pid in group.pids():
            assert set(map(frozenset, thread_affinities(pid).values())) == {frozenset({core})}, pid
        exported = group.hf_state_dict()
        original = read_hf_state_dict(settings.hf_path)
        assert exported.keys() == original.keys()
        assert all(torch.equal(exported[k], original[k]) for k in original)
        metrics = group.train_step(runs["samples"])
        assert metrics["loss"] == pytest.approx(runs["tp1"]["metrics"][0]["loss"], abs=1e-5, rel=0)
        assert metrics["policy_version"] == 1.0
        after = group.compute_logprobs(runs["samples"])
        total = sum(lp * m for s, row in zip(runs["samples"], after, strict=True)
                    for lp, m in zip(row, s.loss_mask, strict=True))
        assert total == pytest.approx(runs["tp1"]["metrics"][0]["masked_logprob_sum"], abs=1e-3, rel=1e-6)
        group.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.parametrize("name", ["tp1_to_pp2", "pp2_to_tp2"])
def test_a_checkpoint_resumes_on_another_layout(runs: dict[str, dict], name: str) -> None:
    """Issue 19: checkpoints reshard. Saved after step 1 by TP=1 (or PP=2) and resumed by PP=2 (or TP=2), steps 2
    and 3 are the uninterrupted run's: same loss and grad norm (Adam's moments and step and the LR schedule came
    across), same weights at the end."""
    ref, run = runs["tp1"], runs[name]
    assert run["resumed"] == {"step": 1, "policy_version": 1}
    assert (run["layout"]["tp_size"], run["layout"]["pp_size"]) == ((1, 2) if name == "tp1_to_pp2" else (2, 1))
    assert _series(run, "loss") == pytest.approx(_series(ref, "loss")[1:], abs=1e-5, rel=0)
    for key in ("grad_norm", "lr"):
        assert _series(run, key) == pytest.approx(_series(ref, key)[1:], abs=1e-5, rel=1e-5)
    assert _series(run, "step") == [2.0, 3.0]
    for k, w in ref["weights"].items():
        diff = (run["weights"][k] - w).abs()
        assert diff.max() < 5e-4 and diff.mean() < 1e-6, (k, float(diff.max()), float(diff.mean()))


def _assert_close_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        diff = (got[k] - w).abs()
        assert diff.max() < 5e-4 and diff.mean() < 1e-6, (k, float(diff.max()), float(diff.mean()))


@pytest.mark.parametrize("name", ["lora_tp1", "lora_tp2", "lora_kl_pp1", "lora_kl_pp2", "lora_kl_tp2pp2"])
def test_lora_trains_the_adapter_alone_on_every_layout(runs: dict[str, dict], name: str) -> None:
    """Issue 43: a LoRA job trains only its adapter: the base under it is the HF checkpoint bit for bit after 3
    steps, the adapter moved, the policy learned; TP = 2 (B split by rows on qkv / fc1, A by columns on proj /
    fc2), PP = 2 (tied embeddings) and both give TP = 1's loss, grad norm, log-probs and adapter. The KL term's
    reference is the base with the adapter off: 0 at the first step (B starts at 0), then part of the loss."""
    from slime_server.trainer.convert import read_hf_state_dict

    run = runs[name]
    ref = runs["lora_kl_pp1" if "kl" in name else "lora_tp1"]
    original = read_hf_state_dict(runs["hf_tied" if "kl" in name else "hf"])
    original.pop("lm_head.weight", None) if "kl" in name else None
    assert run["base"].keys() == original.keys()
    assert all(torch.equal(run["base"][k], original[k]) for k in original), "the base weights changed"
    adapter = run["adapter"]
    bs = [t for k, t in adapter.items() if ".lora_B." in k]
    assert bs and all(float(b.abs().max()) > 0 for b in bs), "B starts at 0 and must have trained"
    assert any(not torch.equal(run["weights"][k], original[k]) for k in original)  # the push serves the merge
    logprob = _series(run, "masked_logprob_sum")
    assert len(set(logprob)) == STEPS  # the policy changes every step (advantages of both signs: no direction)
    if "kl" in name:
        kl = _series(run, "kl")
        assert kl[0] == pytest.approx(0.0, abs=1e-9) and kl[-1] > 0
        assert {k.split(".")[-3] for k in adapter} == {"q_proj", "v_proj", "o_proj", "down_proj"}
    if run is ref:
        return
    assert _series(run, "loss") == pytest.approx(_series(ref, "loss"), abs=1e-5, rel=0)
    assert _series(run, "masked_logprob_sum") == pytest.approx(logprob := _series(ref, "masked_logprob_sum"),
                                                               abs=1e-3, rel=1e-6)
    for key in ("grad_norm", "kl") if "kl" in name else ("grad_norm",):
        assert _series(run, key) == pytest.approx(_series(ref, key), abs=1e-5, rel=1e-5)
    _assert_close_tensors(run["adapter"], ref["adapter"])
    _assert_close_tensors(run["weights"], ref["weights"])


@pytest.mark.parametrize("name", ["users_tp1", "users_tp2", "users_pp2"])
def test_several_users_adapters_train_in_one_step_on_every_layout(runs: dict[str, dict], name: str) -> None:
    """Issue 43: three users' adapters in one trainer, each sample through its user's: the base stays the HF
    checkpoint, every user's adapter trained (and differently), and TP = 2 (the stacked A and B split as one
    adapter's) and PP = 2 give TP = 1's loss, grad norm, log-probs and every user's adapter."""
    from slime_server.trainer.convert import read_hf_state_dict

    run, ref = runs[name], runs["users_tp1"]
    original = read_hf_state_dict(runs["hf"])
    assert run["base"].keys() == original.keys()
    assert all(torch.equal(run["base"][k], original[k]) for k in original), "the base weights changed"
    by_user = [{k.split("/", 1)[1]: t for k, t in run["adapter"].items() if k.startswith(f"{u}/")} for u in range(3)]
    assert all(by_user) and by_user[0].keys() == by_user[1].keys() == by_user[2].keys()
    for user in by_user:
        assert all(float(t.abs().max()) > 0 for k, t in user.items() if ".lora_B." in k), "every user trained"
    assert any(not torch.equal(by_user[0][k], by_user[1][k]) for k in by_user[0])
    assert len(set(_series(run, "masked_logprob_sum"))) == STEPS
    if run is ref:
        return
    assert _series(run, "loss") == pytest.approx(_series(ref, "loss"), abs=1e-5, rel=0)
    assert _series(run, "masked_logprob_sum") == pytest.approx(_series(ref, "masked_logprob_sum"), abs=1e-3, rel=1e-6)
    assert _series(run, "grad_norm") == pytest.approx(_series(ref, "grad_norm"), abs=1e-5, rel=1e-5)
    _assert_close_tensors(run["adapter"], ref["adapter"])


@pytest.mark.parametrize("name", ["lora_tp1_resumed", "lora_tp1_to_pp2"])
def test_a_lora_checkpoint_resumes(runs: dict[str, dict], name: str) -> None:
    """A LoRA checkpoint holds the adapter and its Adam state (not the base); resumed on the same layout or on
    PP = 2 after step 1, steps 2 and 3 are the uninterrupted run's."""
    from slime_server.trainer.lora import is_adapter_name

    ref, run = runs["lora_tp1"], runs[name]
    saved = torch.load(runs["ckpt_lora"] / "rank_00000.pt", weights_only=True)
    portable = torch.load(runs["ckpt_lora"] / "portable.pt", weights_only=True)
    tensors = {k for k, v in saved["model"].items() if isinstance(v, torch.Tensor)}  # beside Megatron's _extra_state
    assert tensors and all(is_adapter_name(k) for k in tensors)
    assert portable["weights"].keys() == portable["exp_avg"].keys() == tensors
    assert run["resumed"] == {"step": 1, "policy_version": 1}
    assert _series(run, "loss") == pytest.approx(_series(ref, "loss")[1:], abs=1e-5, rel=0)
    assert _series(run, "grad_norm") == pytest.approx(_series(ref, "grad_norm")[1:], abs=1e-5, rel=1e-5)
    _assert_close_tensors(run["adapter"], ref["adapter"])
