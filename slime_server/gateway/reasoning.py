"""``<think>…</think>`` -> ``reasoning_content``, for whole texts and for streams.

Why: reasoning models (Qwen3, DeepSeek-R1, GLM) write their chain of thought between think
markers; OpenAI-compatible servers (SGLang ``--reasoning-parser``) return it separately as
``reasoning_content`` so that agents do not show or re-send it as the answer. The session layer
still records the exact generated tokens, so nothing is lost for training.

Rule (as SGLang's Qwen3 parser): a text is reasoning only when it starts with the start marker
(after whitespace), or when ``force`` is set because the chat template already opened the block
in the prompt. An unterminated block is all reasoning (the model ran out of tokens while thinking).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReasoningSplit:
    reasoning: str | None
    content: str


class ReasoningParser:
    def __init__(self, start: str = "<think>", end: str = "</think>", force: bool = False) -> None:
        self.start = start
        self.end = end
        self.force = force

    def parse(self, text: str) -> ReasoningSplit:
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not self.force:
            return ReasoningSplit(None, text)
        reasoning, sep, content = body.partition(self.end)
        if not sep:
            return ReasoningSplit(reasoning.strip() or None, "")
        return ReasoningSplit(reasoning.strip() or None, content.lstrip())

    def streaming(self) -> StreamingReasoningParser:
        return StreamingReasoningParser(self)


class StreamingReasoningParser:
    """``feed(delta) -> (reasoning_delta, content_delta)``; concatenated, equals ``parse`` of the text.

    State machine: ``undecided`` (could still be the start marker) -> ``reasoning`` -> ``content``
    (or directly ``content`` when the text does not open with the marker).
    """

    def __init__(self, parser: ReasoningParser) -> None:
        self.p = parser
        self.state = "undecided"
        self.buf = ""
        self._lead = True  # strip whitespace at the start of reasoning / of content after the block
        self._pending_ws = ""  # whitespace inside reasoning held back (reasoning is stripped at its end)

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning, content = "", ""
        if self.state == "undecided":
            body = self.buf.lstrip()
            if not body:
                return "", ""
            if body.startswith(self.p.start):
                self.buf = body[len(self.p.start):]
                self.state = "reasoning_open"
            elif self.p.start.startswith(body):
                return "", ""
            elif self.p.force:  # the template opened the block: everything up to the end marker is reasoning
                self.state = "reasoning_open"
            else:
                self.state = "content"
        if self.state == "reasoning_open":
            i = self.buf.find(self.p.end)
            if i >= 0:
                reasoning = self._reason(self.buf[:i], final=True)
                self.buf = self.buf[i + len(self.p.end):]
                self.state = "after"
            else:
                keep = _partial_suffix(self.buf, self.p.end)
                chunk, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                reasoning = self._reason(chunk, final=False)
                return reasoning, ""
        if self.state == "after":
            self.buf = self.buf.lstrip()
            if not self.buf:
                return reasoning, ""
            self.state = "content"
        if self.state == "content":
            content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flush held-back text at end of generation."""
        rest, self.buf = self.buf, ""
        if self.state == "undecided" and self.p.force:
            self.state = "reasoning_open"
        if self.state == "undecided":
            return "", rest  # never became a marker: plain content, as parse() returns it
        if self.state == "reasoning_open":
            return self._reason(rest, final=True), ""
        return "", rest if self.state == "content" else ""

    def _reason(self, text: str, final: bool) -> str:
        if self._lead:
            text = text.lstrip()
            if not text:
                return ""
            self._lead = False
        text = self._pending_ws + text
        stripped = text.rstrip()
        self._pending_ws = "" if final else text[len(stripped):]
        return stripped


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


REASONING_PARSERS: dict[str, dict[str, object]] = {
    "qwen3": {"start": "<think>", "end": "</think>", "force": False},
    "deepseek-r1": {"start": "<think>", "end": "</think>", "force": True},
    "glm45": {"start": "<think>", "end": "</think>", "force": False},
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return ReasoningParser(**REASONING_PARSERS[name])  # type: ignore[arg-type]
    except KeyError:
        raise KeyError(f"unknown reasoning parser {name!r}; known: {sorted(REASONING_PARSERS)}") from None
