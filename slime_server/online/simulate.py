"""A simulated user for online learning: short conversations that react badly to a behaviour.

Each conversation: the user asks a short question; if the answer shows the disliked behaviour
(``UserDislikes``: a forbidden letter, or more than ``max_chars`` characters) the user's next
message complains, else it thanks. That next message is the *next state* the server's judge
reads, so with ``serve --online`` the served model should show the behaviour less and less.
Used by the online tests and ``tools/bench_online.py``.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from pydantic import BaseModel, Field

QUESTIONS = ["hi", "Tell me about the sea.", "What is a cat?", "Say something.", "How are you?",
             "Name a colour.", "What is 2 + 2?", "Describe the sky.", "Who are you?", "Any news?"]
THANKS = "Thanks, great."


class UserDislikes(BaseModel):
    forbidden: str | None = Field("w", description="a letter the user does not want to see")
    max_chars: int | None = Field(None, description="answers longer than this are too long")

    def check(self, answer: str) -> str | None:
        """The complaint, or None when the user is happy."""
        if self.forbidden and self.forbidden in answer.lower():
            return f"Please do not use the letter {self.forbidden}."
        if self.max_chars is not None and len(answer) > self.max_chars:
            return "That is too long."
        return None


class Conversation(BaseModel):
    index: int
    started: float
    answer: str
    disliked: bool
    latency_s: list[float]
    error: str | None = None


async def conversation(client: Any, model: str, index: int, rng: random.Random, *, dislikes: UserDislikes,
                       max_tokens: int) -> Conversation:
    sid = f"sim-{index}-{rng.getrandbits(32):08x}"
    messages: list[dict[str, str]] = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    started, latencies = time.monotonic(), []
    try:
        t0 = time.monotonic()
        r = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                 temperature=1.0, extra_headers={"X-Session-Id": sid})
        latencies.append(time.monotonic() - t0)
        answer = r.choices[0].message.content or ""
        complaint = dislikes.check(answer)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": complaint or THANKS}]
        t0 = time.monotonic()
        await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=1.0,
                                             extra_headers={"X-Session-Id": sid})
        latencies.append(time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - counted, the run goes on
        return Conversation(index=index, started=started, answer="", disliked=False, latency_s=latencies,
                            error=repr(e))
    return Conversation(index=index, started=started, answer=answer, disliked=complaint is not None,
                        latency_s=latencies)


async def simulate(base_url: str, n: int, *, concurrency: int = 8, dislikes: UserDislikes | None = None,
                   max_tokens: int = 8, api_key: str = "none", seed: int = 0) -> list[Conversation]:
    """``n`` conversations, ``concurrency`` at a time; returned in start order."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    rng = random.Random(seed)
    dislikes = dislikes or UserDislikes()
    try:
        model = (await client.models.list()).data[0].id
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> Conversation:
            async with sem:
                return await conversation(client, model, i, random.Random(rng.random() + i), dislikes=dislikes,
                                          max_tokens=max_tokens)

        out = await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()
    return sorted(out, key=lambda c: c.started)


def disliked_rate(convs: list[Conversation]) -> float:
    ok = [c for c in convs if c.error is None]
    return sum(c.disliked for c in ok) / max(1, len(ok))
