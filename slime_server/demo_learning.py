"""The learning demo: a warm-started tiny model that gets better at ``calculator`` by RL, on CPU.

Story (what a new user sees in a few minutes on 2 cores):
  1. **Warm start** (cached): SFT through the Megatron trainer on synthetic conversations from a
     *sloppy teacher*: it formats tool calls perfectly and copies the right numbers, but picks the
     right operator only half of the time. The warm model therefore makes well-formed calls that
     are often wrong: the format is learned, the arithmetic intent only weakly.
  2. **RL**: a ``dataset`` job on the same word problems through the whole stack (agent runner ->
     /v1 gateway -> sgl-router -> engines -> buffer -> Megatron GRPO -> bucketed pushes). What
     raises the success rate is the reward alone: the warm-start data is right about the operator
     only half of the time, so imitation caps the policy near 50%.
  3. **Evaluation**: a held-out set at every ``eval_every`` steps, sampled at temperature 1 with
     fixed seeds (the policy's own success rate, same random numbers for every version so the
     curve compares policies, not luck); a PNG plot and a summary at the end.
"""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field

from slime_server.envs.base import DatasetRow
from slime_server.envs.calculator import NAMES, TEMPLATES, CalculatorEnv, evaluate, format_number
from slime_server.models.tiny import build_once, default_cache_dir, ensure_tiny_model
from slime_server.trainer.sft import SFTSettings, conversation_sample, run_sft

# +, -, * word problems with one-digit operands: copying a digit is learnable by a 3 M-parameter
# model in a couple hundred SFT steps, so the warm start is cheap and RL has a clear target.
DEMO_TEMPLATES = [t for t in TEMPLATES if "/" not in t[1]]
DIGITS = range(2, 10)
WARM_START_SEED = 0  # one warm start for every --seed: a run's seed varies RL, not the cached SFT

Split = Literal["train", "held_out"]


def held_out(template: int, a: int, b: int) -> bool:
    """The held-out set is held out by construction: a problem is held out when ``(a + b + template)
    % 4 == 0``, so for every template 16 of its 64 operand pairs are never seen with it, by the warm
    start nor by RL (each pair is still seen with the other templates: the task is the operator each
    template asks for, applied to digits the model has copied before, not a memorised problem). Measured:
    holding whole operand pairs out of every template instead, 40 RL steps did not lift held-out success
    (35% -> 20%, 33% -> 29%): what the tiny model learns by RL does not carry to digit pairs it never saw."""
    return (a + b + template) % 4 == 0


def operand_pairs(split: Split, template: int) -> list[tuple[int, int]]:
    return [(a, b) for a in DIGITS for b in DIGITS if held_out(template, a, b) == (split == "held_out")]


def problem_space(split: Split) -> list[tuple[tuple[str, str], int, int, str]]:
    """Every distinct problem of a split: template x operand pair x name, for templates that name someone
    (held out: 2 x 16 x 8 + 16 = 272 distinct prompts)."""
    return [(t, a, b, name) for i, t in enumerate(DEMO_TEMPLATES) for a, b in operand_pairs(split, i)
            for name in (NAMES if "{name}" in t[0] else NAMES[:1])]


class DemoLearningSettings(BaseModel):
    rl_steps: int = Field(40, ge=1, description="RL optimizer steps")
    sft: SFTSettings = Field(default_factory=lambda: SFTSettings(steps=400, batch_size=16, lr=1e-3, warmup_steps=30))
    sft_conversations: int = Field(4000, ge=1)
    n_samples_per_prompt: int = Field(8, ge=2)
    prompts_per_step: int = Field(4, ge=1)
    lr: float = Field(1e-4, gt=0)
    lr_warmup_steps: int = Field(0, ge=0, description="RL lr warmup (Adam's first steps move every weight by ~lr)")
    lr_decay_style: Literal["constant", "cosine"] = Field(
        "cosine", description="RL lr schedule over rl_steps (measured: at a constant 1e-4 one run in four "
                              "collapsed after step 30, entropy 0.02 -> 0.18 and reward 0.84 -> 0.2)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine schedule's last lr, as a fraction of lr")
    eval_prompts: int = Field(64, ge=1, le=272, description="distinct held-out problems (272 exist)")
    eval_every: int = Field(5, ge=1)
    seed: int = 0


def demo_rows(n: int, seed: int, split: Split = "train") -> list[DatasetRow]:
    """``n`` problems of ``split``: drawn with replacement for training, distinct for the held-out set."""
    rng = random.Random(seed)
    space = problem_space(split)
    if split == "held_out":
        if n > len(space):
            raise ValueError(f"the held-out set has {len(space)} distinct problems; {n} were asked for")
        picks = rng.sample(space, n)
    else:
        picks = [rng.choice(space) for _ in range(n)]
    rows = []
    for (text, expr), a, b, name in picks:
        values = {"a": a, "b": b, "name": name}
        expression = expr.format(**values)
        rows.append(DatasetRow(prompt=text.format(**values), label=format_number(evaluate(expression)),
                               metadata={"expression": expression}))
    return rows


def sloppy_teacher_conversation(row: DatasetRow, rng: random.Random, p_right: float = 0.5
                                ) -> list[dict[str, Any]]:
    """A perfectly formatted episode with the right numbers whose operator is right only with
    probability ``p_right`` (else one of the two wrong ones)."""
    env = CalculatorEnv()
    a, op, b = str(row.metadata["expression"]).split()
    if rng.random() >= p_right:
        op = rng.choice([o for o in "+-*" if o != op])
    expression = f"{a} {op} {b}"
    result = format_number(evaluate(expression))
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
    return [*env.reset(row).messages,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": f"The answer is {result}."}]


def warm_start_conversations(n: int, seed: int = WARM_START_SEED) -> list[list[dict[str, Any]]]:
    """The warm start's SFT data: sloppy-teacher episodes on training problems only."""
    rng = random.Random(seed)
    return [sloppy_teacher_conversation(r, rng) for r in demo_rows(n, seed + 1, "train")]


def _sft_child(base: str, out: str, settings_json: str, n_conv: int) -> None:
    from transformers import AutoTokenizer

    settings = SFTSettings.model_validate_json(settings_json)
    tok = AutoTokenizer.from_pretrained(base)
    tools = CalculatorEnv().tools()
    samples = [conversation_sample(tok, c, tools) for c in warm_start_conversations(n_conv)]
    bar = _bar(settings.steps, "warm start (SFT, Megatron)")

    def on_step(step: int, metrics: dict[str, float]) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.3f}")

    run_sft(base, samples, settings, out, on_step)
    bar.close()


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stdout, dynamic_ncols=True, mininterval=1.0,
                disable=None if sys.stdout.isatty() else False, ascii=not sys.stdout.isatty())


WARM_START_MODEL = "tiny-calc"


@functools.cache
def calculator_warm_start() -> Path:
    """The model named ``tiny-calc``: the tiny model after the demo's default SFT warm start (built once,
    cached). It solves about half of the calculator's problems, so RL on it has a signal from the first step;
    the bare tiny model solves none and a job on it trains on nothing."""
    return ensure_warm_start(ensure_tiny_model(), DemoLearningSettings())


def ensure_warm_start(base: str | Path, settings: DemoLearningSettings) -> Path:
    """The SFT warm start of ``base``, built once in a child process and cached next to it, under a key
    made of its inputs' content (the base model's files, the SFT data, the SFT settings): it is built
    again exactly when one of them changes, never for a new ``--seed`` or an unrelated code change."""
    import hashlib

    base = Path(base).resolve()
    digest = hashlib.sha256()
    for f in sorted(p for p in base.iterdir() if p.is_file()):
        digest.update(f.name.encode() + f.read_bytes())
    digest.update(json.dumps(warm_start_conversations(settings.sft_conversations), sort_keys=True).encode())
    digest.update(settings.sft.model_dump_json().encode())
    name = f"{base.name}-calc-warm-{digest.hexdigest()[:12]}"
    return build_in_child(name, _sft_child, lambda tmp: (str(base), str(tmp), settings.sft.model_dump_json(),
                                                         settings.sft_conversations))


def build_in_child(name: str, target: Callable[..., None], args: Callable[[Path], tuple[Any, ...]]) -> Path:
    """The model cache's ``name``, built once (``build_once``) by ``target(*args(tmp))`` in a spawned child (the
    warm starts' SFT: Megatron's process state stays out of the demo's), which must not outlive a Ctrl-C."""
    cached = default_cache_dir() / name
    if (cached / "config.json").exists():
        print(f"[demo] warm start (cached): {cached}", flush=True)

    def build(tmp: Path) -> None:
        t0 = time.monotonic()
        proc = mp.get_context("spawn").Process(target=target, args=args(tmp), name="slime-sft", daemon=True)
        proc.start()
        try:
            proc.join()
        except BaseException:  # Ctrl-C / SIGTERM: the child must not outlive the demo
            proc.terminate()
            proc.join(10)
            raise
        if proc.exitcode != 0:
            raise RuntimeError(f"the SFT warm start failed (exit code {proc.exitcode})")
        print(f"[demo] warm start built in {time.monotonic() - t0:.0f}s: {cached}", flush=True)

    return build_once(default_cache_dir(), name, build)


class DemoResult(BaseModel):
    job_id: str
    steps: int
    seconds: float
    evals: list[dict[str, Any]]
    rewards: list[tuple[int, float]]
    before: float
    after: float
    plot: str | None


def write_datasets(work: Path, settings: DemoLearningSettings) -> tuple[Path, Path]:
    train, held_out = work / "calculator_train.jsonl", work / "calculator_eval.jsonl"
    train.write_text("".join(r.model_dump_json() + "\n" for r in demo_rows(512, settings.seed + 100)))
    rows = demo_rows(settings.eval_prompts, settings.seed + 200, "held_out")
    held_out.write_text("".join(r.model_dump_json() + "\n" for r in rows))
    print(f"[demo] held-out set: {len(rows)} problems, {len({r.prompt for r in rows})} distinct; no training "
          f"problem has a held-out problem's template and operands ({len(operand_pairs('held_out', 0))} of 64 "
          "pairs per template are held out)", flush=True)
    return train, held_out


def job_spec(settings: DemoLearningSettings, train: Path, held_out: Path,
             extra_evals: list[tuple[str, str]] = ()) -> dict[str, Any]:
    n, per_step = settings.n_samples_per_prompt, settings.prompts_per_step
    return {
        "name": "calculator-demo",
        "algorithm": "grpo",
        "data": {"source": "dataset", "environment": "calculator", "dataset": str(train),
                 "concurrency": n * per_step, "temperature": 1.0, "max_tokens": 40},
        "loop": {"batch_size": n * per_step, "n_samples_per_prompt": n, "max_steps": settings.rl_steps,
                 "max_staleness": 1, "update_weights_interval": 1, "checkpoint_interval": 1000,
                 "drop_zero_variance_groups": True},
        "optimizer": optimizer_spec(settings),
        # as little ahead as is safe (one batch + the groups in flight): on 2 shared cores, rollouts the
        # trainer cannot take in time are stale (dropped) by the time it can, and they slow it down meanwhile
        "pacing": {"max_buffered": 2 * n * per_step, "retry_after_s": 0.5},
        "max_tokens_per_micro_batch": 512,
        "eval": [{"name": "held_out", "environment": "calculator", "dataset": str(held_out),
                  "num_prompts": settings.eval_prompts, "every_steps": settings.eval_every, "temperature": 1.0,
                  "seed": settings.seed + 7, "max_tokens": 40, "concurrency": 16}]
        + [{"name": name, "environment": "calculator", "dataset": path, "every_steps": settings.eval_every,
            "max_tokens": 40} for name, path in extra_evals],
    }


def optimizer_spec(settings: DemoLearningSettings) -> dict[str, Any]:
    warmup = min(settings.lr_warmup_steps, max(0, settings.rl_steps - 1))
    spec: dict[str, Any] = {"lr": settings.lr, "clip_grad": 1.0, "lr_warmup_steps": warmup}
    if settings.lr_decay_style == "cosine" and settings.rl_steps > warmup:
        spec |= {"lr_decay_style": "cosine", "lr_decay_steps": settings.rl_steps,
                 "min_lr": settings.lr * settings.min_lr_ratio}
    return spec


class DemoFailed(RuntimeError):
    """The demo's job did not give what the demo reports (the CLI prints it and exits 1)."""


def run_rl(root_url: str, admin_key: str | None, settings: DemoLearningSettings, work: Path,
           extra_evals: list[tuple[str, str]] = ()) -> DemoResult:
    """Submit the RL job, show progress until it completes and its last evaluation is in."""
    train, held_out = write_datasets(work, settings)
    return follow_job(root_url, admin_key, job_spec(settings, train, held_out, list(extra_evals)), settings.rl_steps,
                      settings.eval_every, work, "calculator")


def follow_job(root_url: str, admin_key: str | None, spec: dict[str, Any], rl_steps: int, eval_every: int,
               work: Path, task: str) -> DemoResult:
    """Submit a demo's RL job (``spec``), show progress until it completes and its last held-out evaluation is in;
    its evaluations, rewards and plot."""
    rest = httpx.Client(base_url=root_url, headers={"Authorization": f"Bearer {admin_key or 'none'}"}, timeout=120)
    job = rest.post("/jobs", json=spec).raise_for_status().json()
    t0 = time.monotonic()
    bar = _bar(rl_steps, f"RL (GRPO on {task})")
    evals: list[dict[str, Any]] = []
    evals_other: list[dict[str, Any]] = []
    rewards: list[tuple[int, float]] = []
    seen_step, last_seq, status = 0, 0, job["status"]
    final_eval_step = rl_steps - rl_steps % eval_every
    failed_evals: list[dict[str, Any]] = []

    def read_events() -> None:
        nonlocal last_seq
        for ev in job_events(rest, job["id"], last_seq):
            last_seq = max(last_seq, int(ev["seq"]))
            data = ev["data"]
            if ev["kind"] == "step":
                rewards.append((int(data["step"]), float(data.get("reward_mean", 0.0))))
            elif ev["kind"] == "eval_failed":
                failed_evals.append(data)
                tqdm_write(f"[demo] eval {data.get('name', '')} at step {data.get('step')} failed: {data.get('error')}")
            elif ev["kind"] == "eval" and data.get("name") != "held_out":
                evals_other.append(data)
                tqdm_write(f"[demo] eval {data['name']} step {data['step']:>3}: success {data['success_rate']:.0%}")
            elif ev["kind"] == "eval":
                evals.append(data)
                tqdm_write(f"[demo] eval step {data['step']:>3} (policy v{data['version']}): "
                           f"success {data['success_rate']:.0%} on {data['episodes']} held-out problems")

    while True:
        status = rest.get(f"/jobs/{job['id']}").raise_for_status().json()["status"]
        read_events()  # after the status: a job's events are all written before it ends
        step = rewards[-1][0] if rewards else 0
        recent = [r for _, r in rewards[-5:]]
        success = f"{evals[-1]['success_rate']:.0%}" if evals else "-"
        progress = (f"reward {sum(recent) / len(recent):.2f} | " if recent else "") + f"held-out success {success}"
        if step > seen_step:
            bar.update(step - seen_step)
            seen_step = step
            bar.set_postfix_str(f"{progress} | policy v{step}")
        if status in ("completed", "failed", "cancelled"):
            break
        if step >= rl_steps:  # trained; the job completes once its last evaluation is in
            bar.set_postfix_str(f"{progress} | policy v{step} | waiting for the held-out evaluation of step "
                                f"{final_eval_step}")
        time.sleep(1.0)
    bar.close()
    if status != "completed":
        error = rest.get(f"/jobs/{job['id']}").json().get("error")
        raise DemoFailed(f"the RL job ended {status}: {error}")
    if not any(e["step"] >= final_eval_step for e in evals):
        why = "; ".join(str(e.get("error")) for e in failed_evals) or "no evaluation was reported"
        raise DemoFailed(f"the RL job completed without the held-out evaluation of step {final_eval_step}: {why}")
    evals.sort(key=lambda e: e["step"])
    plot = plot_progress(evals, rewards, work / "demo_success.png", task)
    return DemoResult(job_id=job["id"], steps=seen_step, seconds=time.monotonic() - t0, evals=evals + evals_other,
                      rewards=rewards, before=evals[0]["success_rate"] if evals else 0.0,
                      after=evals[-1]["success_rate"] if evals else 0.0, plot=plot)


def job_events(rest: httpx.Client, job_id: str, after: int) -> list[dict[str, Any]]:
    """The job's stored events after ``after`` (the SSE endpoint without following)."""
    r = rest.get(f"/jobs/{job_id}/events", params={"after": after, "follow": "false"}).raise_for_status()
    return [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]


def tqdm_write(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def plot_progress(evals: list[dict[str, Any]], rewards: list[tuple[int, float]], out: Path,
                  task: str = "calculator") -> str | None:
    """Success rate (held-out) and batch reward vs step as a PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if rewards:
        ax.plot([s for s, _ in rewards], [r for _, r in rewards], color="#bbbbbb", lw=1, label="training batch reward")
    ax.plot([e["step"] for e in evals], [e["success_rate"] for e in evals], "o-", color="#1f77b4", lw=2,
            label="held-out success rate")
    ax.set(xlabel="RL step (policy version)", ylabel="success rate", ylim=(0, 1.02),
           title=f"{task}: tiny model, CPU, GRPO through slime-server")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return str(out)
