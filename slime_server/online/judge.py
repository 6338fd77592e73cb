"""The implicit-feedback judge: scores an assistant turn from what the user said next.

Why a judge and not only thumbs: in a live deployment most turns get no explicit feedback, but the
next user message usually says how the previous answer landed ("thanks" vs "no, shorter!"). The
judge reads (previous answer, next user message) and answers ``+1`` / ``-1`` / ``0``, optionally
with a *hint* (what the answer should have done), which on-policy distillation turns into a
per-token teacher signal.

The judge is any OpenAI-compatible chat endpoint: this server's own ``/v1`` (the served model
judging itself, serve-only so it is never paced or trained on), a second model served by the
same server, or an external URL. ``votes`` > 1 samples the judge several times and takes the
majority (ties -> 0).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, Field

from slime_server.utils.net import tls_context

JUDGE_SYSTEM = (
    "You judge an assistant's reply by what the user said next. Answer with one line 'SCORE: +1' if "
    "the user is satisfied or moves on, 'SCORE: -1' if the user is unhappy, complains or corrects the "
    "reply, 'SCORE: 0' if it is unclear. If the reply should have been different, add one line "
    "'HINT: <what the reply should have done>'."
)
_SCORE = re.compile(r"SCORE:\s*([+-]?\s*[01])", re.IGNORECASE)
_HINT = re.compile(r"HINT:\s*(.+)", re.IGNORECASE)


class JudgeSettings(BaseModel):
    """Where the judge lives and how it is asked (``serve --online`` flags / the online job)."""

    base_url: str | None = Field(None, description="OpenAI-compatible /v1 URL; None = this server's own /v1")
    model: str | None = Field(None, description="model id at that URL; None = the first one it lists")
    api_key: str = "none"
    votes: int = Field(1, ge=1, le=15, description="judge samples per turn; the majority wins, ties give 0")
    temperature: float = Field(0.0, ge=0, description="> 0 makes several votes differ")
    max_tokens: int = Field(64, ge=1)
    timeout_s: float = Field(60.0, gt=0)


class Verdict(BaseModel):
    score: int = Field(ge=-1, le=1)
    votes: list[int]
    hint: str | None = None


def judge_messages(assistant_text: str, next_user_text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": JUDGE_SYSTEM},
            {"role": "user", "content": f"Assistant reply:\n{assistant_text}\n\nUser's next message:\n{next_user_text}"}]


def parse_vote(text: str) -> tuple[int, str | None]:
    """``SCORE: +1`` / ``-1`` / ``0`` (anything else counts 0) and an optional ``HINT:`` line."""
    m = _SCORE.search(text or "")
    score = int(m.group(1).replace(" ", "")) if m else 0
    h = _HINT.search(text or "")
    hint = h.group(1).strip() if h else None
    return max(-1, min(1, score)), hint or None


def majority(votes: list[int]) -> int:
    total = sum(votes)
    return (total > 0) - (total < 0)


class Judge:
    """Asks the judge endpoint ``votes`` times; returns the majority and the first agreeing hint."""

    def __init__(self, settings: JudgeSettings, default_base_url: str | None = None) -> None:
        self.settings = settings
        self.base_url = settings.base_url or default_base_url
        if self.base_url is None:
            raise ValueError("the judge needs a base_url (or this server's /v1)")
        self._model: str | None = settings.model

    async def score(self, assistant_text: str, next_user_text: str) -> Verdict:
        from openai import AsyncOpenAI, DefaultAsyncHttpxClient

        s = self.settings
        client = AsyncOpenAI(base_url=self.base_url, api_key=s.api_key, timeout=s.timeout_s, max_retries=2,
                             http_client=DefaultAsyncHttpxClient(verify=tls_context()))  # a client per call, one TLS setup
        try:
            if self._model is None:
                self._model = (await client.models.list()).data[0].id
            votes: list[tuple[int, str | None]] = []
            for k in range(s.votes):
                r = await client.chat.completions.create(
                    model=self._model, messages=judge_messages(assistant_text, next_user_text),  # type: ignore[arg-type]
                    temperature=s.temperature, max_tokens=s.max_tokens, seed=k,
                    metadata={"serve_only": "true"}, extra_headers={"X-Turn-Type": "side"})
                votes.append(parse_vote(r.choices[0].message.content or ""))
        finally:
            await client.close()
        score = majority([v for v, _ in votes])
        hint = next((h for v, h in votes if h and (v == score or score == 0)), None)
        return Verdict(score=score, votes=[v for v, _ in votes], hint=hint)


def verdict_payload(v: Verdict) -> dict[str, Any]:
    return {"score": v.score, "votes": v.votes, **({"hint": v.hint} if v.hint else {})}
