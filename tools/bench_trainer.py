"""Step time of the Megatron-core trainer vs plain Hugging Face + torch AdamW, side by side.

Same checkpoint, same global batch, same packing into micro-batches, same GRPO loss
(``losses.policy_loss``), Adam with the same hyper-parameters and grad clipping. Steps of the
two trainers are interleaved so background load hits both alike; the median step time of each
and their ratio (Megatron / HF; target <= 1.2) are printed, plus both first-step losses and
gradient norms, which must agree because both start from the same weights (a correctness
cross-check of the whole Megatron path against an independent implementation).

    python tools/bench_trainer.py [--model HF_DIR] [--batch 8] [--seq-len 128] [--steps 6]

``--prefixes``: instead, the Megatron step with and without shared prefixes computed once
(``trainer/prefix_tree.py``) on a GRPO-shaped batch: ``--group`` samples per prompt, every prompt starting
with the same ``--system`` tokens; the rows each computes, the median step times and their ratio, and both
first losses and gradient norms (which must agree).

``--lora RANK``: instead, a full GRPO step vs a LoRA step (rank RANK on every projection, issue 43) on the same batch:
median step times, trainable parameters and the optimizer's state (Adam moments, and fp32 main copies where the
model is not fp32), one trainer after the other in this process.

``--push RANK``: instead, what a LoRA job (rank RANK on every projection) sends an engine per version: the merged
weights (``lora.publish = 'merged'``: the bucketed weight push, engine paused) vs the adapter alone (``'adapter'``:
``/load_lora_adapter_from_tensors`` under a new name, nothing paused, the old name unloaded after), alternating, to
one CPU engine started here with LoRA on: bytes and median wall time of each, and their ratios.

``--users N``: instead, N users' LoRA adapters (rank ``--user-rank``) trained on ``--batch`` samples each: one step of a
multi-adapter trainer over all N users' samples together (each sample through its own user's adapter, one shared
base forward and backward) vs N steps of a one-adapter trainer, each with one user's adapter swapped in (its
adapter and Adam moments copied in and out, as a trainer that serves users one at a time does); samples/s of each
and their ratio.

``--blocks``: instead, the Megatron step (trainer defaults: micro-batches of up to 8192 rows, shared prefixes) on a
GRPO-shaped batch (as ``--prefixes`` makes it) with its core attention computed block by block
(``trainer/block_attention.py``) vs Megatron's one [T, T] matrix per packed row, interleaved, same weights: the median
step times, their ratio, and both first losses and gradient norms (which must agree).

``--algorithms``: instead, one step of the policy alone vs one PPO step with a KL reference and a critic
(reference log-probs in the step, values, the critic's step) on the same batch, and the parameter memory
of each model: the cost of ``loss.kl_coef`` and ``algorithm: ppo``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def make_samples(vocab: int, batch: int, seq_len: int, seed: int, pad_id: int | None = None) -> list[Any]:
    """Random tokens, never ``pad_id``: HF builds the embedding with ``padding_idx`` (that row gets no gradient
    from its lookups) and Megatron does not, so a pad token in the batch made the two gradients differ in that
    one row (seen: grad norm 15.9 vs 0.73 at 32 x 245 on the tiny model, whose pad id is its BOS) and the
    cross-check meaningless."""
    from slime_server.trainer.types import TrainSample

    rng = random.Random(seed)
    allowed = [t for t in range(vocab) if t != pad_id]
    prompt = seq_len // 4
    out = []
    for i in range(batch):
        adv = rng.choice([-1.0, 1.0])
        mask = [0] * prompt + [1] * (seq_len - prompt)
        out.append(TrainSample(
            tokens=[rng.choice(allowed) for _ in range(seq_len)], loss_mask=mask,
            rollout_logprobs=[-3.0 * m for m in mask], reward=adv, group_id=f"g{i // 2}",
            weight_versions=[0 if m else -1 for m in mask], advantages=[adv * m for m in mask],
            sample_id=str(i),
        ))
    return out


def make_grouped_samples(vocab: int, batch: int, group: int, system: int, prompt: int, response: int,
                         seed: int) -> list[Any]:
    """A GRPO batch's shape: groups of ``group`` samples answering one prompt, all prompts opening with the same
    ``system`` tokens (a system prompt and tools), ``prompt`` more per group, ``response`` generated tokens."""
    from slime_server.trainer.types import TrainSample

    rng = random.Random(seed)
    head = [rng.randrange(vocab) for _ in range(system)]
    out = []
    for i in range(batch):
        if i % group == 0:
            ask = head + [rng.randrange(vocab) for _ in range(prompt)]
        adv = rng.choice([-1.0, 1.0])
        mask = [0] * len(ask) + [1] * response
        out.append(TrainSample(
            tokens=ask + [rng.randrange(vocab) for _ in range(response)], loss_mask=mask,
            rollout_logprobs=[-3.0 * m for m in mask], reward=adv, group_id=f"g{i // group}",
            weight_versions=[0 if m else -1 for m in mask], advantages=[adv * m for m in mask], sample_id=str(i)))
    return out


StepFn = Callable[[list[Any]], tuple[float, float]]  # samples -> (loss, grad norm before clipping)


def megatron_trainer(model_dir: str, args: argparse.Namespace, settings: Any) -> StepFn:
    from transformers import AutoConfig

    from slime_server.trainer.convert import load_hf_checkpoint_into
    from slime_server.trainer.model import build_gpt_model
    from slime_server.trainer.optimizer import build_optimizer
    from slime_server.trainer.parallel import init_parallel
    from slime_server.trainer.settings import OptimizerSettings
    from slime_server.trainer.train_step import train_step

    init_parallel(tp_size=1)
    model = build_gpt_model(AutoConfig.from_pretrained(model_dir))
    load_hf_checkpoint_into(model, model_dir)
    bundle = build_optimizer(model, OptimizerSettings(lr=args.lr, weight_decay=0.01, clip_grad=1.0))
    def step(samples: list[Any]) -> tuple[float, float]:
        metrics = train_step(bundle, samples, settings)
        return metrics["loss"], metrics["grad_norm"]

    return step


def hf_trainer(model_dir: str, args: argparse.Namespace, settings: Any) -> StepFn:
    from transformers import AutoModelForCausalLM

    from slime_server.trainer.losses import policy_loss
    from slime_server.trainer.model import build_attention_mask
    from slime_server.trainer.packing import pack_samples

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)

    def step(samples: list[Any]) -> tuple[float, float]:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in pack_samples(samples, settings.max_tokens_per_micro_batch):
            ids, pos = mb.tokens[None], mb.position_ids[None]
            allowed = ~build_attention_mask(pos)  # HF 4-D bool mask: True = may attend
            logits = model(input_ids=ids, position_ids=pos, attention_mask=allowed).logits[0]
            logp = torch.log_softmax(logits[:-1].float() / settings.temperature, dim=-1)
            lp = torch.cat([logp.new_zeros(1), logp.gather(-1, ids[0, 1:, None])[:, 0]])
            lp = lp.masked_fill(mb.position_ids == 0, 0.0)
            with torch.no_grad():  # the entropy metric, as the Megatron step reports it
                ent = -(logp.exp() * logp).sum(-1)
                ent = torch.cat([ent.new_zeros(1), ent]).masked_fill(mb.position_ids == 0, 0.0)
            loss, _ = policy_loss(
                settings.loss, logprobs=lp, old_logprobs=lp.detach(), rollout_logprobs=mb.rollout_logprobs,
                advantages=mb.advantages, loss_mask=mb.loss_mask, sample_lens=mb.sample_lens,
                entropy=ent, token_weights=mb.token_weights,
            )
            loss.backward()
            total += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return total, float(grad_norm)

    return step


def main() -> None:
    from slime_server.models.tiny import ensure_tiny_model
    from slime_server.trainer.settings import LossConfig
    from slime_server.trainer.train_step import TrainStepSettings

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the tiny model)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--max-tokens-per-micro-batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--algorithms", action="store_true", help="policy alone vs policy + KL reference + critic")
    ap.add_argument("--prefixes", action="store_true", help="the step with vs without shared prefixes once")
    ap.add_argument("--blocks", action="store_true", help="block-by-block core attention vs Megatron's dense one")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK", help="a full step vs a LoRA step of this rank")
    ap.add_argument("--push", type=int, default=0, metavar="RANK", help="merged push vs adapter push of this rank")
    ap.add_argument("--pushes", type=int, default=5, help="--push: pushes of each kind")
    ap.add_argument("--users", type=int, default=0, help="N users' adapters in one step vs one at a time")
    ap.add_argument("--user-rank", type=int, default=16, help="--users: the adapters' rank")
    ap.add_argument("--group", type=int, default=8, help="--prefixes: samples per prompt")
    ap.add_argument("--system", type=int, default=150, help="--prefixes: tokens every prompt starts with")
    ap.add_argument("--prompt", type=int, default=40, help="--prefixes: more prompt tokens per group")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(args.model or ensure_tiny_model())

    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    vocab = hf_config.vocab_size
    settings = TrainStepSettings(max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                                 loss=LossConfig(loss_type="grpo"), share_prefixes=False)  # HF's packing
    if args.prefixes:
        grouped = make_grouped_samples(vocab, args.batch, args.group, args.system, args.prompt, args.seq_len, seed=0)
        print(json.dumps({"model": model_dir, "batch": args.batch, "group": args.group, "system": args.system,
                          "prompt": args.prompt, "response": args.seq_len, "threads": args.threads,
                          **bench_prefixes(model_dir, args, settings, grouped)}))
        return
    if args.blocks:
        grouped = make_grouped_samples(vocab, args.batch, args.group, args.system, args.prompt, args.seq_len, seed=0)
        print(json.dumps({"model": model_dir, "batch": args.batch, "group": args.group, "system": args.system,
                          "prompt": args.prompt, "response": args.seq_len, "threads": args.threads,
                          "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch,
                          **bench_blocks(model_dir, args, grouped)}))
        return
    if args.push:
        print(json.dumps({"model": model_dir, "rank": args.push, "threads": args.threads,
                          **bench_push(model_dir, args)}))
        return
    samples = make_samples(vocab, args.batch, args.seq_len, seed=0, pad_id=getattr(hf_config, "pad_token_id", None))
    if args.users:
        print(json.dumps({"model": model_dir, "users": args.users, "rank": args.user_rank, "per_user": args.batch,
                          "seq_len": args.seq_len, "threads": args.threads,
                          **bench_users(model_dir, args, vocab, getattr(hf_config, "pad_token_id", None))}))
        return
    if args.lora:
        print(json.dumps({"model": model_dir, "batch": args.batch, "seq_len": args.seq_len, "threads": args.threads,
                          **bench_lora(model_dir, args, samples)}))
        return
    if args.algorithms:
        print(json.dumps({"model": model_dir, "batch": args.batch, "seq_len": args.seq_len,
                          **bench_algorithms(model_dir, args, samples)}))
        return
    trainers = {"megatron": megatron_trainer(model_dir, args, settings), "hf": hf_trainer(model_dir, args, settings)}
    med, _, first = interleaved(args, trainers, samples)
    report = {
        "model": model_dir, "params_m": round(sum(p.numel() for p in _hf_params(model_dir)) / 1e6, 2),
        "batch": args.batch, "seq_len": args.seq_len, "threads": args.threads,
        "megatron_step_s": round(med["megatron"], 4), "hf_step_s": round(med["hf"], 4),
        "ratio_megatron_over_hf": round(med["megatron"] / med["hf"], 3),
        "first_loss": {k: v[0] for k, v in first.items()}, "first_grad_norm": {k: v[1] for k, v in first.items()},
    }
    print(json.dumps(report))


def interleaved(args: argparse.Namespace, steps: dict[str, StepFn], samples: list[Any],
                before: Callable[[str], None] | None = None,
                ) -> tuple[dict[str, float], dict[str, list[float]], dict[str, tuple[float, float]]]:
    """Each of ``steps`` run ``args.warmup + args.steps`` times on ``samples``, in turn, so background load hits them
    alike (``before(name)`` ahead of each run): the median and every time of the timed runs, and each one's first
    (loss, grad norm)."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    first: dict[str, tuple[float, float]] = {}
    for i in range(args.warmup + args.steps):
        for name, step in steps.items():
            if before is not None:
                before(name)
            t0 = time.perf_counter()
            loss_and_norm = step(samples)
            dt = time.perf_counter() - t0
            first.setdefault(name, loss_and_norm)
            if i >= args.warmup:
                times[name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}, times, first


def bench_prefixes(model_dir: str, args: argparse.Namespace, settings: Any, samples: list[Any]) -> dict[str, Any]:
    """Median Megatron step time with the plain packed rows vs the token tree, interleaved, same weights."""
    from slime_server.trainer.packing import pack_samples

    variants = {"plain": settings, "shared": settings.model_copy(update={"share_prefixes": True})}
    steps = {name: megatron_trainer(model_dir, args, s) for name, s in variants.items()}
    med, _, first = interleaved(args, steps, samples)
    rows = {k: sum(mb.num_rows for mb in pack_samples(samples, s.max_tokens_per_micro_batch,
                                                      share_prefixes=s.share_prefixes)) for k, s in variants.items()}
    return {"rows": rows, "step_s": {k: round(v, 4) for k, v in med.items()},
            "speedup": round(med["plain"] / med["shared"], 2),
            "first_loss": {k: v[0] for k, v in first.items()}, "first_grad_norm": {k: v[1] for k, v in first.items()}}


def bench_blocks(model_dir: str, args: argparse.Namespace, samples: list[Any]) -> dict[str, Any]:
    """Median Megatron step time with the core attention block by block vs dense (every block plan refused, so
    Megatron's own forward runs), interleaved, two trainers from the same weights."""
    from slime_server.trainer import block_attention
    from slime_server.trainer.settings import LossConfig
    from slime_server.trainer.train_step import TrainStepSettings

    settings = TrainStepSettings(max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                                 loss=LossConfig(loss_type="grpo"))
    share = block_attention.DENSE_SHARE
    steps = {"dense": megatron_trainer(model_dir, args, settings), "blocks": megatron_trainer(model_dir, args, settings)}

    def before(name: str) -> None:
        block_attention.DENSE_SHARE = 0.0 if name == "dense" else share

    try:
        med, times, first = interleaved(args, steps, samples, before)
    finally:
        block_attention.DENSE_SHARE = share
    return {"step_s": {k: round(v, 4) for k, v in med.items()},
            "step_s_all": {k: [round(t, 3) for t in v] for k, v in times.items()},
            "speedup": round(med["dense"] / med["blocks"], 2),
            "first_loss": {k: v[0] for k, v in first.items()}, "first_grad_norm": {k: v[1] for k, v in first.items()}}


def timed(args: argparse.Namespace, run: Callable[[], object]) -> list[float]:
    """Seconds of each of ``args.steps`` calls of ``run``, after ``args.warmup`` untimed ones."""
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        run()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def one_rank(model_dir: str, args: argparse.Namespace, loss: Any, **extra: Any) -> Any:
    """A set-up single-process ``TrainerRank`` (Adam at ``args.lr``; ``extra``: more TrainerRankSettings)."""
    from slime_server.trainer.actor import RendezvousInfo, TrainerRank, TrainerRankSettings
    from slime_server.trainer.settings import OptimizerSettings
    from slime_server.trainer.train_step import TrainStepSettings
    from slime_server.utils.net import find_free_port

    rank = TrainerRank(TrainerRankSettings(
        hf_path=model_dir, torch_threads=args.threads, optimizer=OptimizerSettings(lr=args.lr),
        train=TrainStepSettings(max_tokens_per_micro_batch=args.max_tokens_per_micro_batch, loss=loss), **extra),
        RendezvousInfo(rank=0, world_size=1, master_port=find_free_port()))
    rank.setup()
    return rank


def bench_lora(model_dir: str, args: argparse.Namespace, samples: list[Any]) -> dict[str, Any]:
    """Median step time, trainable parameters and optimizer state of a full step vs a LoRA step."""
    from slime_server.trainer.parallel import destroy_parallel
    from slime_server.trainer.portable import _torch_optimizers
    from slime_server.trainer.settings import LoRASettings, LossConfig

    out: dict[str, Any] = {}
    for name, lora in (("full", None), (f"lora_r{args.lora}", LoRASettings(rank=args.lora, alpha=2 * args.lora))):
        rank = one_rank(model_dir, args, LossConfig(loss_type="grpo"), lora=lora)
        times = timed(args, lambda rank=rank: rank.train_step(samples))
        state = sum(t.numel() * t.element_size() for opt in _torch_optimizers(rank.bundle)
                    for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
        trainable = sum(p.numel() for p in rank.bundle.model.parameters() if p.requires_grad)
        out[name] = {"step_s": round(statistics.median(times), 3), "steps_s": [round(t, 3) for t in times],
                     "trainable_m": round(trainable / 1e6, 3), "optimizer_state_mib": round(state / 2**20, 1)}
        destroy_parallel()
    lora_name = f"lora_r{args.lora}"
    out["step_ratio_lora_over_full"] = round(out[lora_name]["step_s"] / out["full"]["step_s"], 3)
    out["optimizer_state_ratio"] = round(out[lora_name]["optimizer_state_mib"] / out["full"]["optimizer_state_mib"], 4)
    return out


def bench_push(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    """Bytes and median seconds of a merged push vs an adapter push (+ the old name's unload) to one engine."""
    from slime_server.trainer.engine_control import EngineControl
    from slime_server.trainer.parallel import destroy_parallel
    from slime_server.trainer.settings import LoRASettings, LossConfig
    from slime_server.utils.net import find_free_port, wait_http_ok
    from slime_server.utils.procs import kill_group, python_module_cmd, spawn

    port = find_free_port()
    engine = spawn(python_module_cmd("slime_server.rollout.engine_server", "--model-path", model_dir, "--host",
                                     "127.0.0.1", "--port", str(port), "--num-threads", "1", "--enable-lora",
                                     "--max-lora-rank", str(args.push)), env={"OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    rank = None
    engines = EngineControl(lambda: [url])
    try:
        wait_http_ok(f"{url}/health", timeout=300, proc=engine)
        rank = one_rank(model_dir, args, LossConfig(loss_type="grpo"),
                        lora=LoRASettings(rank=args.push, alpha=2 * args.push))
        runs: dict[str, list[float]] = {"merged": [], "adapter": []}
        sent: dict[str, int] = {}
        previous = None
        for i in range(args.pushes + 1):  # the first of each is a warm-up (buffers, connections)
            t0 = time.perf_counter()
            stats = rank.push_weights([url], i + 1)
            if i:
                runs["merged"].append(time.perf_counter() - t0)
            sent["merged"] = stats["bytes"]
            name = f"bench.v{i}"
            t0 = time.perf_counter()
            stats = rank.push_adapter([url], name)
            if previous is not None:
                engines.unload_adapter(previous)  # as the job's loop does (there, off its thread)
            if i:
                runs["adapter"].append(time.perf_counter() - t0)
            sent["adapter"], previous = stats["bytes"], name
    finally:
        if rank is not None:
            rank.shutdown()
            destroy_parallel()
        engines.close()
        kill_group(engine)
    out: dict[str, Any] = {k: {"bytes": sent[k], "median_s": round(statistics.median(v), 4),
                               "seconds": [round(t, 4) for t in v]} for k, v in runs.items()}
    out["bytes_ratio"] = round(sent["adapter"] / sent["merged"], 4)
    out["time_ratio"] = round(out["adapter"]["median_s"] / out["merged"]["median_s"], 4)
    return out


def bench_users(model_dir: str, args: argparse.Namespace, vocab: int, pad_id: int | None) -> dict[str, Any]:
    """samples/s: N users' adapters in one multi-adapter step vs N one-adapter steps, adapters swapped in."""
    from slime_server.trainer.adapter_isolation import stacked_adapters
    from slime_server.trainer.parallel import destroy_parallel
    from slime_server.trainer.portable import _torch_optimizers
    from slime_server.trainer.settings import LoRASettings, LossConfig

    users = args.users
    per_user = [make_samples(vocab, args.batch, args.seq_len, seed=u, pad_id=pad_id) for u in range(users)]
    mixed = [s.model_copy(update={"adapter": u}) for u, batch in enumerate(per_user) for s in batch]
    lora = LoRASettings(rank=args.user_rank, alpha=2 * args.user_rank)
    loss = LossConfig(loss_type="grpo")
    out: dict[str, Any] = {}

    rank = one_rank(model_dir, args, loss, lora=lora.model_copy(update={"adapters": users}))
    times = timed(args, lambda: rank.train_step(mixed))
    out["together"] = {"step_s": round(statistics.median(times), 3), "samples_per_s": round(
        len(mixed) / statistics.median(times), 3), "adapters": len(stacked_adapters(rank.bundle.model))}
    destroy_parallel()

    rank = one_rank(model_dir, args, loss, lora=lora)
    params = [p for p in rank.bundle.model.parameters() if p.requires_grad]
    opt = _torch_optimizers(rank.bundle)[0]

    def state_of() -> list[torch.Tensor]:
        return [p.data for p in params] + [t for p in params for t in opt.state.get(p, {}).values()
                                           if isinstance(t, torch.Tensor) and t.shape == p.shape]

    rank.train_step(per_user[0])  # the moments exist from here on
    saved = [[t.clone() for t in state_of()] for _ in range(users)]

    def one_at_a_time() -> None:
        for u in range(users):  # swap user u's adapter and moments in, step on their samples, swap out
            for t, mine in zip(state_of(), saved[u], strict=True):
                t.copy_(mine)
            rank.train_step(per_user[u])
            for t, mine in zip(state_of(), saved[u], strict=True):
                mine.copy_(t)

    times = timed(args, one_at_a_time)
    out["one_at_a_time"] = {"round_s": round(statistics.median(times), 3), "samples_per_s": round(
        len(mixed) / statistics.median(times), 3)}
    destroy_parallel()
    out["ratio"] = round(out["together"]["samples_per_s"] / out["one_at_a_time"]["samples_per_s"], 3)
    return out


def bench_algorithms(model_dir: str, args: argparse.Namespace, samples: list[Any]) -> dict[str, Any]:
    """Median step time: policy alone vs policy + KL reference + critic (same batch, same process)."""
    from slime_server.trainer.parallel import destroy_parallel
    from slime_server.trainer.settings import CriticSettings, LossConfig

    def mbytes(module: torch.nn.Module | None) -> float:
        return 0.0 if module is None else sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20

    out: dict[str, Any] = {}
    for name, extra in (("policy", {}), ("policy+reference+critic", {"reference": True, "critic": CriticSettings()})):
        loss = LossConfig(loss_type="ppo", kl_coef=0.01 if extra else 0.0)
        rank = one_rank(model_dir, args, loss, **extra)

        def step(rank: Any = rank) -> None:
            rank.train_step(samples)
            if rank.critic is not None:
                values = rank.compute_values(samples)
                rank.train_critic([s.model_copy(update={"returns": [float(s.reward)] * len(s.tokens)}) for s in samples],
                                  values)

        times = timed(args, step)
        out[name] = {"step_s": round(statistics.median(times), 4), "policy_mib": round(mbytes(rank.bundle.model), 1),
                     "reference_mib": round(mbytes(rank.reference), 1),
                     "critic_mib": round(mbytes(rank.critic.model if rank.critic else None), 1)}
        destroy_parallel()
    out["ratio"] = round(out["policy+reference+critic"]["step_s"] / out["policy"]["step_s"], 3)
    return out


def _hf_params(model_dir: str) -> list[torch.Tensor]:
    from slime_server.trainer.convert import read_hf_state_dict

    return list(read_hf_state_dict(model_dir).values())


if __name__ == "__main__":
    main()
