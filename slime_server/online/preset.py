"""``slime-server serve --online``: a served model that learns from its own conversations (settings: the
tree's ``online`` section, ``config.OnlineSettingsSection``).

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

from typing import Any

from slime_server.config import OnlineSettingsSection
from slime_server.online.feedback import OnlineSettings
from slime_server.online.judge import JudgeSettings


def feedback_settings(online: OnlineSettingsSection) -> OnlineSettings:
    """What the gateway's implicit feedback needs of the ``online`` settings section."""
    judge = JudgeSettings(base_url=online.judge_url, model=online.judge_model, api_key=online.judge_api_key,
                          votes=online.judge_votes, temperature=0.0 if online.judge_votes == 1 else 0.7)
    return OnlineSettings(judge=judge, opd=online.opd_weight > 0)


def online_job_spec(online: OnlineSettingsSection) -> dict[str, Any]:
    """The live job the preset starts (a JobSpec body; POST /jobs takes the same)."""
    return {
        "name": "online",
        "algorithm": "reinforce_plus_plus",
        "data": {"source": "live"},
        "loop": {"batch_size": online.batch_size, "n_samples_per_prompt": 1, "max_staleness": 2,
                 "stale_policy": "downweight", "update_weights_interval": 1, "checkpoint_interval": 20,
                 "opd": {"w_rl": online.rl_weight, "w_opd": online.opd_weight} if online.opd_weight > 0 else None},
        "optimizer": {"lr": online.lr, "clip_grad": 1.0},
        # live traffic is never refused for training's sake: pacing only bounds what waits in the buffer
        "pacing": {"max_buffered": 100_000},
    }
