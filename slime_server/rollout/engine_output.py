"""The CPU engine's answer for one sequence, shaped as SGLang's ``/generate`` output (text, ids, meta_info)."""

from __future__ import annotations

from typing import Any

import torch

from slime_server.rollout import engine_routes
from slime_server.rollout.engine_sequence import Sequence
from slime_server.rollout.protocol import GenerateOutput, LogprobEntry, MetaInfo, version_spans
from slime_server.rollout.sampling import logprobs_of, top_logprobs


def output_of(seq: Sequence, tokenizer: Any, current_version: str) -> GenerateOutput:
    """SGLang-shaped output of ``seq`` so far (cumulative; final once ``seq.finish`` is set).

    As SGLang's scheduler and tokenizer manager: ``weight_versions`` spans only on the final output (any
    finish, aborts included; a request with no output token yet gets one empty span of the current
    version), and then ``weight_version`` is the last span's; a stream chunk before the end carries the
    engine's current ``weight_version`` and no spans."""
    p, f = seq.params, seq.finish
    ids = list(seq.output_ids)
    spans = version_spans(seq.output_versions[:len(ids)], current_version) if f is not None else None
    text_ids = ids
    if f is not None and f.type == "stop" and isinstance(f.matched, int) and not p.no_stop_trim:
        text_ids = ids[:-1]
    text = tokenizer.decode(text_ids, skip_special_tokens=p.skip_special_tokens)
    if f is not None and isinstance(f.matched, str) and not p.no_stop_trim:
        cut = text.find(f.matched)
        text = text[:cut] if cut >= 0 else text
    if f is None:  # SGLang's detokenizer: a streamed text never ends in half a character (U+FFFD)
        text = text.rstrip("\ufffd")
    meta = MetaInfo(
        id=seq.rid, finish_reason=f, prompt_tokens=len(seq.prompt_ids), completion_tokens=len(ids),
        cached_tokens=seq.cached_tokens, weight_version=spans[-1].version if spans else current_version,
        weight_versions=spans,
        e2e_latency=None if seq.finished_at is None else seq.finished_at - seq.created,  # final only
        routed_experts=engine_routes.answer(seq) if f is not None else None,  # final only, as SGLang's
        image_tokens=seq.images.image_tokens if seq.images is not None else None,  # SGLang: only when > 0
    )
    if seq.return_logprob:
        named = (lambda e: _with_text(tokenizer, e)) if seq.logprob_text else _same
        meta.output_token_logprobs = named([(lp, t, None) for lp, t in zip(seq.output_logprobs, ids,
                                                                            strict=False)])
        if seq.top_logprobs_num:
            meta.output_top_logprobs = [named(top) for top in seq.output_top]
        if seq.logprob_start_len >= 0:
            meta.input_token_logprobs = named(seq.input_logprobs or [])
            meta.input_top_logprobs = (None if seq.input_top is None else
                                       [None if t is None else named(t) for t in seq.input_top])
    return GenerateOutput(text=text, output_ids=ids, meta_info=meta,
                          prompt_token_ids=list(seq.prompt_ids) if seq.return_prompt_token_ids else None)

def _with_text(tokenizer: Any, entries: list[LogprobEntry]) -> list[LogprobEntry]:
    """SGLang's ``return_text_in_logprobs``: the third element is the token's text."""
    texts = tokenizer.convert_ids_to_tokens([t for _, t, _ in entries])
    return [(lp, t, tokenizer.convert_tokens_to_string([s])) for (lp, t, _), s in
            zip(entries, texts, strict=True)]


def _same(entries: list[LogprobEntry]) -> list[LogprobEntry]:
    return entries


def input_logprobs(seq: Sequence, logits: torch.Tensor) -> None:
    """The prompt's log-probs from ``logprob_start_len`` on (SGLang's ``input_token_logprobs``; the first
    position has none), from the prefill's logits of every prompt position."""
    start = seq.logprob_start_len
    lp = logprobs_of(logits[:-1], seq.params)
    targets = torch.tensor(seq.prompt_ids[1:])
    chosen = lp.gather(-1, targets[:, None])[:, 0].tolist()
    entries: list[LogprobEntry] = [] if start > 0 else [(None, seq.prompt_ids[0], None)]
    tops: list[list[LogprobEntry] | None] = [] if start > 0 else [None]
    for pos in range(max(start, 1), len(seq.prompt_ids)):
        entries.append((chosen[pos - 1], seq.prompt_ids[pos], None))
        if seq.top_logprobs_num:
            tops.append(top_logprobs(lp[pos - 1], seq.top_logprobs_num))
    seq.input_logprobs = entries
    seq.input_top = tops if seq.top_logprobs_num else None
