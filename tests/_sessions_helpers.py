"""Helpers for the session/buffer tests: engine-like outputs from the real tiny tokenizer, and the
mask invariant every recorded trajectory must satisfy."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from slime_server.buffer.schema import Trajectory
from slime_server.gateway.chat_template import ChatRenderer
from slime_server.gateway.sessions import NOT_GENERATED, ChoiceResult

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def assistant_text(content: str = "", tool_calls: list[tuple[str, str]] | None = None,
                   reasoning: str | None = None) -> str:
    """The text a Qwen-style model generates for this assistant message (what the template renders
    between ``<|im_start|>assistant\\n`` and ``<|im_end|>``)."""
    text = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
    text += content
    for i, (name, args) in enumerate(tool_calls or []):
        text += ("\n" if i or content else "") + f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
    return text


def noncanonical_ids(renderer: ChatRenderer, text: str) -> list[int]:
    """Ids that decode to ``text`` but are not its BPE split: one token per character."""
    return [i for ch in text for i in renderer.encode(ch)]


@dataclass
class FakeEngine:
    """Produces engine-shaped choices: output ids ending in EOS, full-precision made-up logprobs."""

    renderer: ChatRenderer
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    counter: int = 0
    # (response_id, choice) -> (output_ids, logprobs, versions): the ledger the invariant checks against
    ledger: dict[tuple[str, int], tuple[list[int], list[float], list[int]]] = field(default_factory=dict)

    def response_id(self) -> str:
        self.counter += 1
        return f"chatcmpl-{self.counter:06d}"

    def choice(self, response_id: str, index: int, content: str = "", *,
               tool_calls: list[tuple[str, str]] | None = None, reasoning: str | None = None,
               canonical: bool = True, version: int = 0, finish: str = "stop") -> ChoiceResult:
        text = assistant_text(content, tool_calls, reasoning)
        ids = self.renderer.encode(text) if canonical else noncanonical_ids(self.renderer, text)
        if finish == "stop":
            ids = ids + [self.renderer.eos_token_id]
        logprobs = [-self.rng.random() * 7.0 for _ in ids]  # arbitrary mantissa bits
        self.ledger[(response_id, index)] = (ids, logprobs, [version] * len(ids))
        calls = [{"id": f"call_{response_id}_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                 for i, (n, a) in enumerate(tool_calls or [])]
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return ChoiceResult(output_ids=ids, output_logprobs=logprobs, weight_version=str(version),
                            finish_reason=finish, message=message, response_id=response_id,
                            usage={"completion_tokens": len(ids)})


def client_message(choice: ChoiceResult) -> dict[str, Any]:
    """The assistant message as an OpenAI client echoes it back (no reasoning_content)."""
    msg = {"role": "assistant", "content": choice.message.get("content")}
    if choice.message.get("tool_calls"):
        msg["tool_calls"] = json.loads(json.dumps(choice.message["tool_calls"]))
    return msg


def assert_mask_invariant(traj: Trajectory, ledger: dict[tuple[str, int], tuple[list[int], list[float], list[int]]]
                          ) -> None:
    """Every generated token has mask 1 and its exact logprob and version; every other token mask 0."""
    n = len(traj.tokens)
    assert len(traj.loss_mask) == len(traj.rollout_logprobs) == len(traj.weight_versions) == n
    expected_mask = [0] * n
    pos = 0
    for turn in traj.turns:
        assert turn.prompt_start == pos, "turns must tile the trajectory"
        assert turn.prompt_start <= turn.output_start <= turn.output_end <= n
        ids, logprobs, versions = ledger[(turn.response_id, turn.choice)]
        assert traj.tokens[turn.output_start:turn.output_end] == ids
        got = traj.rollout_logprobs[turn.output_start:turn.output_end]
        assert [x.hex() for x in got] == [x.hex() for x in logprobs], "logprobs must be bit-equal"
        assert traj.weight_versions[turn.output_start:turn.output_end] == versions
        for i in range(turn.output_start, turn.output_end):
            expected_mask[i] = 1
        pos = turn.output_end
    assert pos == n, "the last turn must end the trajectory"
    assert traj.loss_mask == expected_mask
    for i in range(n):
        if expected_mask[i] == 0:
            assert traj.rollout_logprobs[i] == 0.0 and traj.weight_versions[i] == NOT_GENERATED
