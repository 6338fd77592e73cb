"""``slime-server serve --online``: a served model that learns from its own conversations.

What the preset wires together:
  * implicit feedback on the gateway (``online/feedback.py``): every user turn that follows an
    assistant turn in a session has the judge score that turn; judged turns become rewarded
    one-turn training samples (with teacher log-probs when the judge gave a hint);
  * a ``live`` job that trains on them continuously: REINFORCE++, whose returns are whitened over
    the batch (the batch mean is the baseline: live traffic has no GRPO groups, and a group
    baseline over groups of one would zero every advantage), small batches, a push after every
    step, bounded staleness, and on-policy distillation on the hinted samples.
Explicit feedback (``POST /v1/responses/{id}/feedback``) and session rewards keep working alongside.
"""

from __future__ import annotations

import argparse
from typing import Any

from slime_server.online.judge import JudgeSettings


def add_online_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("online learning (--online)")
    g.add_argument("--online", action="store_true", help="judge live turns and train on them continuously")
    g.add_argument("--judge-url", default=None, help="OpenAI-compatible /v1 of the judge (default: this server)")
    g.add_argument("--judge-engine-model", default=None, metavar="MODEL",
                   help="serve the judge from this model (HF dir or 'tiny') on engines of its own behind its own "
                        "sgl-router; never trained (excludes --judge-url)")
    g.add_argument("--judge-engines", type=int, default=1, help="engines for --judge-engine-model")
    g.add_argument("--judge-model", default=None, help="judge model id (default: the first the URL lists)")
    g.add_argument("--judge-api-key", default="none")
    g.add_argument("--judge-votes", type=int, default=1, help="judge samples per turn (majority vote)")
    g.add_argument("--online-batch-size", type=int, default=16, help="judged turns per optimizer step")
    g.add_argument("--online-lr", type=float, default=1e-5)
    g.add_argument("--opd-weight", type=float, default=1.0, help="w_opd of hinted turns (0 disables OPD)")
    g.add_argument("--rl-weight", type=float, default=1.0, help="w_rl: weight of the judge's scalar reward")


def judge_settings(args: argparse.Namespace) -> JudgeSettings:
    return JudgeSettings(base_url=args.judge_url, model=args.judge_model, api_key=args.judge_api_key,
                         votes=args.judge_votes, temperature=0.0 if args.judge_votes == 1 else 0.7)


def online_job_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The live job the preset starts (a JobSpec body; POST /jobs takes the same)."""
    return {
        "name": "online",
        "algorithm": "reinforce_plus_plus",
        "data": {"source": "live"},
        "loop": {"batch_size": args.online_batch_size, "n_samples_per_prompt": 1, "max_staleness": 2,
                 "stale_policy": "downweight", "update_weights_interval": 1, "checkpoint_interval": 20,
                 "opd": {"w_rl": args.rl_weight, "w_opd": args.opd_weight} if args.opd_weight > 0 else None},
        "optimizer": {"lr": args.online_lr, "clip_grad": 1.0},
        # live traffic is never refused for training's sake: pacing only bounds what waits in the buffer
        "pacing": {"max_buffered": 100_000},
    }
