"""One trainer rank for the TP / DP / checkpoint-resume tests (run 1 or N copies).

Runs ``--steps`` train steps of ``TrainerRank`` on the batch in ``--batch`` (a JSON list of
TrainSample dicts). Optional: ``--load DIR`` resumes from a checkpoint first; ``--save-at K``
saves to ``--ckpt DIR`` after step K; ``--push-url URL --pushes N`` pushes the trained weights N times to one
engine through ``TrainerRank.push_weights`` (the GPU test's colocated path). Rank 0 writes per-step metrics and the final HF weights
to ``--out`` (torch.save). Multi-process runs get RANK/WORLD_SIZE/MASTER_* from the env.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

torch.set_num_threads(1)


def main() -> None:
    from slime_server.trainer.actor import RendezvousInfo, TrainerRank, TrainerRankSettings
    from slime_server.trainer.types import TrainSample

    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", required=True, help="TrainerRankSettings as JSON")
    ap.add_argument("--batch", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--save-at", type=int, default=-1)
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--load", default="")
    ap.add_argument("--push-url", default="")
    ap.add_argument("--pushes", type=int, default=0)
    ap.add_argument("--push-bucket", type=int, default=0, help="bucket bytes (0: the default)")
    args = ap.parse_args()

    settings = TrainerRankSettings.model_validate_json(open(args.settings).read())
    rendezvous = None
    if "WORLD_SIZE" in os.environ:
        rendezvous = RendezvousInfo(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                    master_addr=os.environ["MASTER_ADDR"],
                                    master_port=int(os.environ["MASTER_PORT"]))
    samples = [TrainSample.model_validate(s) for s in json.load(open(args.batch))]
    rank = TrainerRank(settings, rendezvous)
    if os.environ.get("SLIME_PORT_FILE"):  # rank 0 binds the rendezvous first and says where (run_ranks)
        _, port = rank.open_rendezvous(rendezvous.world_size if rendezvous else 1)
        tmp = os.environ["SLIME_PORT_FILE"] + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, os.environ["SLIME_PORT_FILE"])
    layout = rank.setup()
    resumed = rank.load_checkpoint(args.load) if args.load else None
    def masked_logprob_sum() -> float:
        # Log-prob of every sample's masked tokens under the current weights (exercises compute_logprobs).
        lps = rank.compute_logprobs(samples)
        return sum(lp * m for s, row in zip(samples, lps, strict=True) for lp, m in zip(row, s.loss_mask, strict=True))

    initial_logprob = masked_logprob_sum()
    metrics = []
    for i in range(args.steps):
        step_metrics = rank.train_step(samples)
        step_metrics["masked_logprob_sum"] = masked_logprob_sum()
        metrics.append(step_metrics)
        if i + 1 == args.save_at:
            rank.save_checkpoint(args.ckpt)
    weights = rank.hf_state_dict()
    pushes = []
    for k in range(args.pushes):  # device memory before and after each push: the IPC buckets must not pile up
        before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        stats = rank.push_weights([args.push_url], version=k + 1, bucket_bytes=args.push_bucket or None)
        after = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        pushes.append({"stats": stats, "allocated_before": before, "allocated_after": after})
    if layout["rank"] == 0:
        torch.save({"metrics": metrics, "weights": weights, "layout": layout, "resumed": resumed,
                    "initial_logprob": initial_logprob, "pushes": pushes,
                    "device": "cuda" if torch.cuda.is_available() else "cpu"}, args.out)
    rank.shutdown()


if __name__ == "__main__":
    main()
