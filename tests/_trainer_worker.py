"""One trainer rank for the TP / DP / checkpoint-resume tests (run 1 or N copies).

Runs ``--steps`` train steps of ``TrainerRank`` on the batch in ``--batch`` (a JSON list of
TrainSample dicts). Optional: ``--load DIR`` resumes from a checkpoint first; ``--save-at K``
saves to ``--ckpt DIR`` after step K; ``--push-url URL --pushes N`` pushes the trained weights N times to one
engine through ``TrainerRank.push_weights`` (the GPU test's colocated path). Rank 0 writes per-step metrics and the final HF weights
to ``--out`` (torch.save). Multi-process runs get RANK/WORLD_SIZE/MASTER_* from the env. ``--plan FILE`` runs a
JSON list of such runs (keys as the flags: settings, batch, out, steps, save_at, ckpt, load) one after another in
this process, on one process group (Megatron's groups are rebuilt per run): one interpreter and one megatron import
per rank instead of one per run and rank.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

torch.set_num_threads(1)


RUN_DEFAULTS: dict[str, Any] = {"steps": 1, "save_at": -1, "ckpt": "", "load": "", "push_url": "", "pushes": 0,
                                "push_bucket": 0}


def run(job: dict[str, Any], rendezvous: Any, port_file: str | None) -> None:
    """One run: set a TrainerRank up, train ``steps`` steps, maybe save / push, write rank 0's result."""
    from slime_server.trainer.actor import TrainerRank, TrainerRankSettings
    from slime_server.trainer.types import TrainSample

    job = {**RUN_DEFAULTS, **job}
    settings = TrainerRankSettings.model_validate_json(open(job["settings"]).read())
    samples = [TrainSample.model_validate_json(json.dumps(s)) for s in json.load(open(job["batch"]))]
    rank = TrainerRank(settings, rendezvous)
    if port_file:  # rank 0 binds the rendezvous first and says where (run_ranks)
        _, port = rank.open_rendezvous(rendezvous.world_size if rendezvous else 1)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.replace(port_file + ".tmp", port_file)
    layout = rank.setup()
    resumed = rank.load_checkpoint(job["load"]) if job["load"] else None

    def masked_logprob_sum() -> float:
        # Log-prob of every sample's masked tokens under the current weights (exercises compute_logprobs).
        lps = rank.compute_logprobs(samples)
        return sum(lp * m for s, row in zip(samples, lps, strict=True) for lp, m in zip(row, s.loss_mask, strict=True))

    initial_logprob = masked_logprob_sum()
    metrics = []
    for i in range(job["steps"]):
        step_metrics = rank.train_step(samples)
        step_metrics["masked_logprob_sum"] = masked_logprob_sum()
        metrics.append(step_metrics)
        if i + 1 == job["save_at"]:
            rank.save_checkpoint(job["ckpt"])
    users = settings.lora.adapters if settings.lora is not None else 1
    weights = rank.hf_state_dict() if users == 1 else {}  # several users' adapters have no one merged model
    adapter, base = {}, {}
    if settings.lora is not None:  # a LoRA run: its adapter (PEFT names; "<user>/<name>" for several) and the base
        from slime_server.trainer.lora import adapters_disabled
        from slime_server.trainer.peft_io import peft_state_dict

        adapter = peft_state_dict(rank.bundle.model) if users == 1 else {
            f"{u}/{k}": v for u in range(users) for k, v in peft_state_dict(rank.bundle.model, u).items()}
        with adapters_disabled(rank.bundle.model):
            base = rank.hf_state_dict()
    pushes = []
    for k in range(job["pushes"]):  # device memory before and after each push: the IPC buckets must not pile up
        before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        stats = rank.push_weights([job["push_url"]], version=k + 1, bucket_bytes=job["push_bucket"] or None)
        after = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        pushes.append({"stats": stats, "allocated_before": before, "allocated_after": after})
    if layout["rank"] == 0:
        torch.save({"metrics": metrics, "weights": weights, "layout": layout, "resumed": resumed,
                    "initial_logprob": initial_logprob, "pushes": pushes, "adapter": adapter, "base": base,
                    "device": "cuda" if torch.cuda.is_available() else "cpu"}, job["out"])
    if getattr(rank, "_pusher", None) is not None:
        rank._pusher.close()


def main() -> None:
    from megatron.core import parallel_state

    from slime_server.trainer.actor import RendezvousInfo
    from slime_server.trainer.parallel import destroy_parallel

    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default="", help="a JSON list of runs (instead of the flags below)")
    ap.add_argument("--settings", help="TrainerRankSettings as JSON")
    ap.add_argument("--batch")
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--save-at", type=int, default=-1)
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--load", default="")
    ap.add_argument("--push-url", default="")
    ap.add_argument("--pushes", type=int, default=0)
    ap.add_argument("--push-bucket", type=int, default=0, help="bucket bytes (0: the default)")
    args = ap.parse_args()
    jobs = json.load(open(args.plan)) if args.plan else [
        {k: v for k, v in vars(args).items() if k != "plan"}]

    rendezvous = None
    if "WORLD_SIZE" in os.environ:
        rendezvous = RendezvousInfo(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                    master_addr=os.environ["MASTER_ADDR"],
                                    master_port=int(os.environ["MASTER_PORT"]))
    for i, job in enumerate(jobs):
        run(job, rendezvous, os.environ.get("SLIME_PORT_FILE") if i == 0 else None)
        parallel_state.destroy_model_parallel()  # the process group stays for the next run
    destroy_parallel()


if __name__ == "__main__":
    main()
