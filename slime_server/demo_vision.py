"""The visual learning demo (``slime-server demo --vision``): the tiny VLM gets better at ``shapes`` by RL, on CPU.

Story, as the calculator demo's (demo_learning.py), with a picture:
  1. **Warm start** (cached): SFT through the Megatron trainer on episodes of a *sloppy teacher*: it calls ``look``
     and answers in the right format every time, but names the shape's colour right only ``p_right`` of the time
     (else another colour). Imitation teaches the format and the tool, not the looking.
  2. **RL**: a ``dataset`` job on ``shapes`` through the whole stack: the runner plays each episode through /v1,
     ``look`` returns the picture (a user turn with the image), the gateway records it token-exactly, the trainer
     learns the language model over the frozen vision tower's embeddings and pushes. Only the reward says which
     colour was right.
  3. **Evaluation**: held-out pictures (never rendered for training) at every ``eval_every`` steps, at temperature
     1 with fixed seeds; a plot and a summary at the end.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from slime_server.demo_learning import DemoResult, _bar, build_in_child, follow_job
from slime_server.envs.base import DatasetRow
from slime_server.envs.shapes import COLOURS, ShapesEnv, render
from slime_server.gateway.images import VisionSpec
from slime_server.models.tiny_vl import ensure_tiny_vl_model
from slime_server.trainer.sft import SFTSettings, conversation_sample, run_sft

TRAIN_SEED, HELD_OUT_SEED = 1, 2  # the pictures' seed ranges (default_dataset: seed * 100000 + i): disjoint


class VisionDemoSettings(BaseModel):
    rl_steps: int = Field(30, ge=1)
    sft: SFTSettings = Field(default_factory=lambda: SFTSettings(steps=300, batch_size=16, lr=2e-3, warmup_steps=10))
    sft_conversations: int = Field(600, ge=1)
    p_right: float = Field(0.5, ge=0, le=1, description="how often the warm start's teacher names the right colour")
    n_samples_per_prompt: int = Field(8, ge=2)
    prompts_per_step: int = Field(4, ge=1)
    lr: float = Field(5e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    # two guards against the collapse seen without them (the tool-call format lost in one step, every reward 0 from
    # then on): grad norms run 0.1-0.2 and spike to 1-7 on a few broken episodes, and Adam's momentum carries a spike
    # on for steps, so the norm is clipped near the usual; and a KL term to the warm start holds the format.
    clip_grad: float = Field(0.3, gt=0, description="max gradient norm")
    kl_coef: float = Field(0.05, ge=0, description="KL to the warm start (low-variance k3)")
    eval_prompts: int = Field(64, ge=1)
    eval_every: int = Field(10, ge=1)
    seed: int = 0


def sloppy_conversation(row: DatasetRow, rng: random.Random, p_right: float) -> list[dict[str, Any]]:
    """A well-formed episode (``look`` called, the picture shown, one word in ``<answer>``) whose colour is the
    drawn one only with probability ``p_right``."""
    env = ShapesEnv()
    colour = row.label if rng.random() < p_right else rng.choice([c for c in sorted(COLOURS) if c != row.label])
    picture = render(row.metadata["colour"], row.metadata["shape"], row.metadata["seed"])
    call = {"id": "call_0", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    return [*env.reset(row).messages, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "Here is the picture."},
            {"role": "user", "content": [{"type": "text", "text": "The tool returned:"},
                                         {"type": "image", "image": picture}]},
            {"role": "assistant", "content": f"<answer>{colour}</answer>"}]


def _sft_child(base: str, out: str, settings_json: str) -> None:
    from transformers import AutoTokenizer  # heavy: the child only

    settings = VisionDemoSettings.model_validate_json(settings_json)
    tok, spec, env = AutoTokenizer.from_pretrained(base), VisionSpec(base), ShapesEnv()
    rng = random.Random(settings.sft.seed)
    rows = env.default_dataset(settings.sft_conversations, seed=TRAIN_SEED)
    samples = [conversation_sample(tok, sloppy_conversation(r, rng, settings.p_right), env.tools(), vision=spec)
               for r in rows]
    bar = _bar(settings.sft.steps, "warm start (SFT with images, Megatron)")

    def on_step(step: int, metrics: dict[str, float]) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.3f}")

    run_sft(base, samples, settings.sft, out, on_step)
    bar.close()


def ensure_vision_warm_start(settings: VisionDemoSettings) -> Path:
    """The SFT warm start of the tiny VLM, built once in a child process and cached under a key of its inputs (the
    base model's files and the warm start's settings)."""
    base = ensure_tiny_vl_model().resolve()
    digest = hashlib.sha256()
    for f in sorted(p for p in base.iterdir() if p.is_file()):
        digest.update(f.name.encode() + f.read_bytes())
    digest.update(settings.model_dump_json(include={"sft", "sft_conversations", "p_right"}).encode())
    name = f"{base.name}-shapes-warm-{digest.hexdigest()[:12]}"
    return build_in_child(name, _sft_child, lambda tmp: (str(base), str(tmp), settings.model_dump_json()))


def write_datasets(work: Path, settings: VisionDemoSettings) -> tuple[Path, Path]:
    """Training pictures and held-out pictures (other seeds: never rendered for training)."""
    env = ShapesEnv()
    train, held_out = work / "shapes_train.jsonl", work / "shapes_eval.jsonl"
    train.write_text("".join(r.model_dump_json() + "\n" for r in env.default_dataset(512, seed=TRAIN_SEED + 10)))
    rows = env.default_dataset(settings.eval_prompts, seed=HELD_OUT_SEED)
    held_out.write_text("".join(r.model_dump_json() + "\n" for r in rows))
    return train, held_out


def job_spec(settings: VisionDemoSettings, train: Path, held_out: Path) -> dict[str, Any]:
    n, per_step = settings.n_samples_per_prompt, settings.prompts_per_step
    return {
        "name": "shapes-demo", "algorithm": "grpo",
        "data": {"source": "dataset", "environment": "shapes", "dataset": str(train), "concurrency": n * per_step,
                 "temperature": 1.0, "max_tokens": 24},
        "loop": {"batch_size": n * per_step, "n_samples_per_prompt": n, "max_steps": settings.rl_steps,
                 "max_staleness": 1, "update_weights_interval": 1, "checkpoint_interval": 1000,
                 "drop_zero_variance_groups": True, "max_flat_groups_in_a_row": 32},
        "optimizer": {"lr": settings.lr, "clip_grad": settings.clip_grad, "lr_decay_style": "cosine", "lr_decay_steps": settings.rl_steps,
                      "min_lr": settings.lr * settings.min_lr_ratio},
        "pacing": {"max_buffered": 2 * n * per_step, "retry_after_s": 0.5},
        "loss": {"kl_coef": settings.kl_coef} if settings.kl_coef > 0 else {},
        "max_tokens_per_micro_batch": 1024,
        "eval": [{"name": "held_out", "environment": "shapes", "dataset": str(held_out),
                  "num_prompts": settings.eval_prompts, "every_steps": settings.eval_every, "temperature": 1.0,
                  "seed": settings.seed + 7, "max_tokens": 24, "concurrency": 16}],
    }


def run_vision_rl(root_url: str, admin_key: str | None, settings: VisionDemoSettings, work: Path) -> DemoResult:
    train, held_out = write_datasets(work, settings)
    print(f"[demo] shapes: {settings.eval_prompts} held-out pictures (seeds never rendered for training)", flush=True)
    return follow_job(root_url, admin_key, job_spec(settings, train, held_out), settings.rl_steps,
                      settings.eval_every, work, "shapes (vision)")


def summary(result: DemoResult) -> str:
    held = [e for e in result.evals if e["name"] == "held_out"]
    return json.dumps({"job_id": result.job_id, "rl_steps": result.steps, "rl_seconds": round(result.seconds, 1),
                       "success_before": result.before, "success_after": result.after,
                       "gain_points": round(100 * (result.after - result.before), 1),
                       "curve": [(e["step"], e["success_rate"]) for e in held], "plot": result.plot})
