"""Token-exact multi-turn assembly: which earlier tokens a request extends, and what to record.

Why (ARCHITECTURE decision 3): a multi-turn agent conversation must become one training sequence
in which every token the model generated keeps loss mask 1 and its rollout logprob, and every
other token (system, user, tool results, template glue) has mask 0. Re-rendering the chat text is
not enough, since a model's sampled ids need not be the tokenizer's canonical split of their text
and templates rewrite history (e.g. drop old ``<think>`` blocks). So for each request:

a) merge:  the rendered prompt ids start with an open trajectory's ids -> extend it;
b) reuse:  the messages start with that trajectory's messages (request + the assistant message
           we returned) -> keep its exact ids and append only the rendered new messages;
c) split:  otherwise start a new segment of the session and count it
           (``slime_session_segment_splits_total`` and ``Session.segment_splits``).

``n > 1`` makes sibling branches (same group); a later request continues the branch whose
assistant message it carries. ``prepare_turn`` runs before the engine call, ``commit_turn`` after;
commit re-reads the store and forks instead of extending if another request extended the same
trajectory meanwhile, so concurrent requests can never interleave tokens.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import uuid
from typing import Any, Literal

from prometheus_client import Counter
from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from slime_server.buffer.routed_experts import RoutedExperts
from slime_server.buffer.schema import (
    ImageBlob,
    ImageSpan,
    NormalizedMessage,
    Session,
    SessionClosedError,
    StaleWriteError,
    StoreError,
    Trajectory,
    Turn,
)
from slime_server.buffer.store import ResponseRef, TrajectoryStore, TurnWrite
from slime_server.gateway.chat_template import (
    ChatRenderer,
    ChatTemplateError,
    PrefixMismatchError,
    normalize_message,
)
from slime_server.gateway.images import expand

SEGMENT_SPLITS = Counter("slime_session_segment_splits_total",
                         "Requests that could not extend any earlier trajectory of their session")
TURNS = Counter("slime_session_turns_total", "Committed chat turns by how they joined their session", ["mode"])

# Weight version recorded on tokens the model did not generate in that trajectory (loss mask 0).
NOT_GENERATED = -1
_COMMIT_ATTEMPTS = 5

TurnMode = Literal["new", "merge", "reuse", "split"]


class SessionRequestError(StoreError):
    """A request the session layer refuses (the gateway answers 400)."""


def _weight_version(v: Any) -> int:
    """Policy version as an int. Engines report strings (SGLang: "default" before any update, i.e.
    version 0); a trailing integer is the version ("7", "step-7", "v7"), anything else counts as 0."""
    if isinstance(v, bool):
        raise ValueError("weight_version must be an int or a string")
    if isinstance(v, int):
        return v
    if v is None:
        return 0
    if isinstance(v, str):
        match = re.search(r"(\d+)$", v.strip())
        return int(match.group(1)) if match else 0
    raise ValueError(f"weight_version must be an int or a string, got {v!r}")


class ChoiceResult(BaseModel):
    """One generated choice as the engine produced it and as the client saw it."""

    output_ids: list[int]
    output_logprobs: list[float]
    weight_version: int | str | list[int | str] | None = None
    finish_reason: str | None = None
    message: dict[str, Any] = Field(default_factory=dict)
    response_id: str
    usage: dict[str, Any] = Field(default_factory=dict)
    grammar: dict[str, str] | None = None
    lora_adapter: str | None = None
    routed_experts: RoutedExperts | None = None  # an MoE model's routes from PreparedTurn.routes_start on

    @field_validator("message", mode="before")
    @classmethod
    def _dump(cls, v: Any) -> Any:
        return v.model_dump(exclude_none=True) if hasattr(v, "model_dump") else v

    @model_validator(mode="after")
    def _aligned(self) -> ChoiceResult:
        if len(self.output_logprobs) != len(self.output_ids):
            raise ValueError(f"{len(self.output_ids)} output ids but {len(self.output_logprobs)} logprobs")
        if isinstance(self.weight_version, list) and len(self.weight_version) != len(self.output_ids):
            raise ValueError("per-token weight_version must have one entry per output id")
        return self

    def versions(self) -> list[int]:
        if isinstance(self.weight_version, list):
            return [_weight_version(v) for v in self.weight_version]
        return [_weight_version(self.weight_version)] * len(self.output_ids)

    def assistant(self) -> NormalizedMessage:
        return normalize_message({**self.message, "role": "assistant"})


class PreparedTurn(BaseModel):
    """What ``prepare_turn`` decided; the gateway may append prefill ids to ``prompt_ids``."""

    session_id: str
    ephemeral: bool = False  # a request without a session id: a one-turn session, closed on commit
    owner: str | None = None  # agent key recording this turn (api/auth.py); sessions it creates are its own
    mode: TurnMode
    base_trajectory_id: str | None = None  # the trajectory this turn extends (None: a new one)
    base_len: int = 0  # how many of the base's tokens ``prompt_ids`` starts with
    routes_start: int = 0  # an MoE model's routes held for the prompt's first positions: the engine's answer adds
    #                        the rest (SGLang's routed_experts_start_len)
    segment: int = 0
    prompt_ids: list[int]
    images: list[ImageSpan] = Field(default_factory=list)  # a vision-language model's images among prompt_ids
    messages: list[NormalizedMessage]
    tools_digest: str | None = None
    n: int = 1
    _read: list[Trajectory] | None = PrivateAttr(default=None)  # the session's trajectories as prepare read them
    _images: list[ImageBlob] = PrivateAttr(default_factory=list)  # image files to store with the turn (once each)

    @property
    def extends(self) -> str | None:
        return self.base_trajectory_id


class TurnRecord(BaseModel):
    """Where one choice was recorded."""

    session_id: str
    trajectory_id: str
    response_id: str
    choice: int
    segment: int
    branch: int
    turn_index: int
    mode: TurnMode
    prompt_start: int
    output_start: int
    output_end: int


def tools_digest(tools: list[dict[str, Any]] | None) -> str | None:
    if not tools:
        return None
    return hashlib.sha256(json.dumps(tools, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _same_arguments(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def same_message(ours: NormalizedMessage, theirs: NormalizedMessage) -> bool:
    """Whether a client's copy of a message is the one we have; ids and a dropped
    ``reasoning_content`` (most SDKs do not send it back) do not count as edits."""
    if (ours.role, ours.content, ours.name) != (theirs.role, theirs.content, theirs.name):
        return False
    if [i.sha256 for i in ours.images] != [i.sha256 for i in theirs.images]:
        return False
    if theirs.reasoning_content is not None and theirs.reasoning_content != ours.reasoning_content:
        return False
    if len(ours.tool_calls) != len(theirs.tool_calls):
        return False
    return all(a.name == b.name and _same_arguments(a.arguments, b.arguments)
               for a, b in zip(ours.tool_calls, theirs.tool_calls, strict=True))


def extends_conversation(prefix: list[NormalizedMessage], messages: list[NormalizedMessage]) -> bool:
    return (len(messages) > len(prefix)
            and all(same_message(a, b) for a, b in zip(prefix, messages[: len(prefix)], strict=True)))


class SessionManager:
    """Prepares prompt ids for a session's next request and records its results durably."""

    def __init__(self, store: TrajectoryStore, renderer: ChatRenderer, *, lock_stripes: int = 64) -> None:
        self.store = store
        self.renderer = renderer
        # Striped locks: one lock per session in effect, with bounded memory for millions of sessions.
        self._locks = [threading.Lock() for _ in range(lock_stripes)]

    def _lock(self, session_id: str) -> threading.Lock:
        digest = hashlib.blake2b(session_id.encode(), digest_size=8).digest()
        return self._locks[int.from_bytes(digest, "little") % len(self._locks)]

    # ---------------------------------------------------------------- prepare
    def prepare_turn(self, session_id: str | None, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None = None, *, n: int = 1,
                     owner: str | None = None) -> PreparedTurn:
        """Prompt ids for this request, token-exact with the session's earlier turns."""
        if n < 1:
            raise SessionRequestError("n must be at least 1")
        msgs = self.renderer.normalize(messages)
        digest = tools_digest(tools)
        ids = self.renderer.render_ids(msgs, tools)  # outside the lock: tokenizing long prompts takes ms
        ids, spans = self._expand(ids, msgs)
        if not session_id:
            return PreparedTurn(session_id=f"sess-{uuid.uuid4().hex}", ephemeral=True, mode="new", prompt_ids=ids,
                                images=spans, messages=msgs, tools_digest=digest, n=n, owner=owner)
        with self._lock(session_id):
            session = self.store.get_or_create_session(session_id, owner=owner)
            if session.status != "open":
                raise SessionClosedError(
                    f"session {session_id!r} is closed: it was closed, got a final reward (a scalar reward "
                    "finishes its session unless the reward says \"final\": false) or sat idle past "
                    "gateway.session_idle_timeout_s; start a new session for a new episode")
            trajectories = self.store.get_trajectories(session_id)
            prepared = self._decide(trajectories, ids, spans, msgs, tools,
                                    dict(session_id=session_id, messages=msgs, tools_digest=digest, n=n, owner=owner))
        prepared._read = trajectories  # what the commit starts from; its write checks they are still current
        return prepared

    def _expand(self, ids: list[int], msgs: list[NormalizedMessage], offset: int = 0) -> tuple[list[int], list[ImageSpan]]:
        """A vision-language model's rendered ids with each image's placeholder pad expanded (gateway/images.py), and
        the images' spans; text-only: as they are."""
        vision = getattr(self.renderer, "vision", None)
        if vision is None:
            return ids, []
        ids, spans = expand(ids, vision.pad_id, [im for m in msgs for im in m.images], offset)
        return ids, [ImageSpan(**s) for s in spans]

    def _decide(self, trajectories: list[Trajectory], ids: list[int], spans: list[ImageSpan],
                msgs: list[NormalizedMessage], tools: list[dict[str, Any]] | None, common: dict[str, Any]) -> PreparedTurn:
        """Decision 3's rules over the session's trajectories: merge, reuse, or a new segment."""
        open_ = sorted((t for t in trajectories if t.status == "open" and t.turns),
                       key=lambda t: (t.updated_at, t.segment, -t.branch), reverse=True)
        for t in open_:  # rule (a): the new prompt's ids extend the trajectory's ids
            if len(ids) > len(t.tokens) and ids[: len(t.tokens)] == t.tokens:
                return PreparedTurn(mode="merge", base_trajectory_id=t.id, base_len=len(t.tokens),
                                    segment=t.segment, prompt_ids=ids, images=spans, routes_start=_held(t), **common)
        for t in open_:  # rule (b): the messages extend the trajectory's messages
            if t.tools_digest != common["tools_digest"] or not extends_conversation(t.messages, msgs):
                continue
            full = list(t.messages) + msgs[len(t.messages):]
            try:
                suffix = self.renderer.encode_suffix(t.messages, full, tools, strict=False)
            except PrefixMismatchError:
                continue
            closing = [] if t.tokens[-1] in self.renderer.stop_token_ids else [self.renderer.eos_token_id]
            suffix, added = self._expand(suffix, msgs[len(t.messages):], len(t.tokens) + len(closing))
            return PreparedTurn(mode="reuse", base_trajectory_id=t.id, base_len=len(t.tokens),
                                segment=t.segment, prompt_ids=t.tokens + closing + suffix, images=t.images + added,
                                routes_start=_held(t), **common)
        segment = max((t.segment for t in trajectories), default=-1) + 1
        return PreparedTurn(mode="split" if trajectories else "new", segment=segment, prompt_ids=ids, images=spans,
                            **common)

    # ---------------------------------------------------------------- commit
    def commit_turn(self, prepared: PreparedTurn, choices: list[ChoiceResult]) -> list[TurnRecord]:
        """Record every choice durably (committed before this returns)."""
        if not choices:
            raise SessionRequestError("commit_turn needs at least one choice")
        choices = [c if isinstance(c, ChoiceResult) else ChoiceResult.model_validate(c) for c in choices]
        with self._lock(prepared.session_id):
            # First from what prepare read (current unless another turn of this session was recorded since: then
            # the write's revision check fails and the next attempt reads again), not a second read of the store.
            read = prepared._read
            for attempt in range(_COMMIT_ATTEMPTS):
                try:
                    return self._commit_once(prepared, choices, read)
                except StaleWriteError:
                    if attempt == _COMMIT_ATTEMPTS - 1:
                        raise
                    read = None
        raise AssertionError("unreachable")

    def _commit_once(self, prepared: PreparedTurn, choices: list[ChoiceResult],
                     read: list[Trajectory] | None) -> list[TurnRecord]:
        # a one-shot request (no session named) creates its session inside the turn's own transaction
        new_session = Session(id=prepared.session_id, owner=prepared.owner) if prepared.ephemeral else None
        if prepared.ephemeral:
            trajectories: list[Trajectory] = []
        else:
            trajectories = read if read is not None else self.store.get_trajectories(prepared.session_id)
        base = next((t for t in trajectories if t.id == prepared.base_trajectory_id), None)
        if prepared.base_trajectory_id is not None:
            if base is None:
                raise StoreError(f"trajectory {prepared.base_trajectory_id} vanished")
            if len(base.tokens) < prepared.base_len or \
                    base.tokens[: prepared.base_len] != prepared.prompt_ids[: prepared.base_len]:
                raise SessionRequestError("prompt ids no longer start with the trajectory they were prepared on")
        segment = base.segment if base is not None else prepared.segment
        next_branch = max((t.branch for t in trajectories if t.segment == segment), default=-1) + 1
        writes: list[Trajectory] = []
        for i, choice in enumerate(choices):
            in_place = (i == 0 and base is not None and base.status == "open"
                        and len(base.tokens) == prepared.base_len)
            if in_place:
                traj = base.model_copy()  # shallow: _append builds new lists, never mutates them
            else:
                traj = self._fork(prepared, base, segment, next_branch, new_session)
                next_branch += 1
            self._append(traj, prepared, choice, i)
            writes.append(traj)
        refs = [ResponseRef(response_id=c.response_id, choice=i, trajectory_id=t.id)
                for i, (c, t) in enumerate(zip(choices, writes, strict=True))]
        split = prepared.mode == "split"
        stored = self.store.write_turn(TurnWrite(session_id=prepared.session_id, trajectories=writes, responses=refs,
                                                 segment_split=split, close_session=prepared.ephemeral,
                                                 create_session=new_session, images=prepared._images))
        if split:
            SEGMENT_SPLITS.inc()
        TURNS.labels(mode=prepared.mode).inc()
        return [
            TurnRecord(session_id=t.session_id, trajectory_id=t.id, response_id=c.response_id, choice=i,
                       segment=t.segment, branch=t.branch, turn_index=len(t.turns) - 1, mode=prepared.mode,
                       prompt_start=t.turns[-1].prompt_start, output_start=t.turns[-1].output_start,
                       output_end=t.turns[-1].output_end)
            for i, (c, t) in enumerate(zip(choices, stored, strict=True))
        ]

    def _fork(self, prepared: PreparedTurn, base: Trajectory | None, segment: int, branch: int,
              session: Session | None = None) -> Trajectory:
        """A new trajectory holding ``base``'s first ``base_len`` tokens (or nothing)."""
        session = session or self.store.get_session(prepared.session_id)
        traj = Trajectory(session_id=prepared.session_id, segment=segment, branch=branch,
                          group_id=session.group_id or session.id)
        if base is not None and prepared.base_len:
            k = prepared.base_len
            turns = [t for t in base.turns if t.output_end <= k]
            traj.tokens, traj.loss_mask = base.tokens[:k], base.loss_mask[:k]
            traj.rollout_logprobs, traj.weight_versions = base.rollout_logprobs[:k], base.weight_versions[:k]
            traj.turns = [t.model_copy() for t in turns]
            traj.turn_rewards = list(base.turn_rewards[: len(turns)])
            traj.metadata = {"forked_from": base.id}
            traj.routed_experts = None if base.routed_experts is None else base.routed_experts.head(k)
            traj.images = [s for s in base.images if s.offset + s.length <= k]
        return traj

    @staticmethod
    def _append(traj: Trajectory, prepared: PreparedTurn, choice: ChoiceResult, index: int) -> None:
        """Append the turn's new context (mask 0) and its generated tokens (mask 1, logprobs, versions)."""
        context = prepared.prompt_ids[prepared.base_len:]
        prompt_start = len(traj.tokens)
        output_start = prompt_start + len(context)
        assistant = choice.assistant()
        tokens = traj.tokens + context + choice.output_ids
        # a turn decoded under a grammar is kept out of the loss (buffer/schema.py: Turn.grammar)
        mask = traj.loss_mask + [0] * len(context) + [0 if choice.grammar else 1] * len(choice.output_ids)
        logprobs = traj.rollout_logprobs + [0.0] * len(context) + list(choice.output_logprobs)
        versions = traj.weight_versions + [NOT_GENERATED] * len(context) + choice.versions()
        turn = Turn(response_id=choice.response_id, choice=index, prompt_start=prompt_start, output_start=output_start,
                    output_end=len(tokens), finish_reason=choice.finish_reason, tool_calls=assistant.tool_calls,
                    grammar=choice.grammar, lora_adapter=choice.lora_adapter)
        traj.tokens, traj.loss_mask, traj.rollout_logprobs, traj.weight_versions = tokens, mask, logprobs, versions
        traj.routed_experts = _joined_routes(traj.routed_experts, prepared.routes_start, choice.routed_experts)
        traj.turns = [*traj.turns, turn]
        traj.images = list(prepared.images)  # the prompt's (its first base_len tokens are the trajectory's own)
        traj.turn_rewards = [*traj.turn_rewards, None]
        traj.messages = [*prepared.messages, assistant]
        traj.tools_digest = prepared.tools_digest


def _held(t: Trajectory) -> int:
    """How many leading positions of ``t`` have routes (an MoE model's; 0 otherwise)."""
    return t.routed_experts.positions if t.routed_experts is not None else 0


def _joined_routes(held: RoutedExperts | None, start: int, answer: RoutedExperts | None) -> RoutedExperts | None:
    """The routes held for positions [0, start), then the turn's answer's (the engine's from ``start``). A turn
    answered without routes leaves none: routes that stop short of the tokens are never replayed as if whole."""
    if answer is None:
        return None
    if start == 0:
        return answer
    if held is None or held.positions < start:  # not what the answer continues: none rather than misaligned
        return None
    return held.extended(start, answer.array())


__all__ = [
    "ChatTemplateError", "ChoiceResult", "NOT_GENERATED", "PreparedTurn", "SEGMENT_SPLITS", "SessionManager",
    "SessionRequestError", "TurnRecord", "extends_conversation", "same_message", "tools_digest",
]
