"""Stored trajectories as the trainer's samples: tokens, loss mask, rollout log-probs and reward as recorded;
turns decoded under a grammar trained under their rebuilt masks; online hints' teacher log-probs mixed into the
advantages (on-policy distillation)."""

from __future__ import annotations

import logging

from slime_server.buffer.schema import ImageBlob, Trajectory
from slime_server.trainer.advantages import opd_advantages
from slime_server.trainer.grammar_masks import GrammarMasker, GrammarReplayError
from slime_server.trainer.settings import OPDWeights
from slime_server.trainer.types import SampleImage, TrainSample

log = logging.getLogger(__name__)


def to_train_sample(t: Trajectory, masker: GrammarMasker | None = None, routes: bool = False,
                    images: dict[str, ImageBlob] | None = None) -> TrainSample:
    """The trainer's sample of a stored trajectory. Turns decoded under a grammar are stored at loss mask 0; with
    a ``masker`` their masks are rebuilt and they train, scored under the same masks (trainer/grammar_masks.py).
    ``routes``: carry its recorded MoE routes (routing replay). ``images``: the store's files of its images (a
    vision-language trajectory's, by content hash)."""
    teacher = t.metadata.get("teacher_logprobs")  # online hints (online/feedback.py), aligned to tokens
    mask, positions, bitmask = t.loss_mask, None, None
    if masker is not None and any(turn.grammar for turn in t.turns):
        try:
            rebuilt = masker.masks(t)
        except GrammarReplayError as e:  # never trained on a mask that is not the engine's
            log.warning("%s: its constrained turns stay out of the loss", e)
            rebuilt = None
        if rebuilt is not None:
            positions, bitmask = rebuilt
            mask = list(mask)
            for p in positions:
                mask[p] = 1
    return TrainSample(tokens=t.tokens, loss_mask=mask, rollout_logprobs=t.rollout_logprobs,
                       reward=float(t.reward or 0.0), group_id=t.group_id, weight_versions=t.weight_versions,
                       sample_id=t.id, grammar_positions=positions, grammar_bitmask=bitmask,
                       routed_experts=t.routed_experts if routes else None,
                       images=[SampleImage(offset=s.offset, length=s.length, sha256=s.sha256,
                                           data=(images or {})[s.sha256].data) for s in t.images],
                       teacher_logprobs=teacher if isinstance(teacher, list) and len(teacher) == len(t.tokens)
                       else None)


def with_opd(samples: list[TrainSample], weights: OPDWeights | None) -> list[TrainSample]:
    """Add the distillation term to the samples that carry teacher log-probs (others unchanged)."""
    if weights is None:
        return samples
    return [opd_advantages([s], w_rl=weights.w_rl, w_opd=weights.w_opd)[0] if s.teacher_logprobs is not None else s
            for s in samples]
