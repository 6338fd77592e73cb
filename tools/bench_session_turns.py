"""What one turn of a long agent session costs the gateway's session layer, as the session grows.

An agent (Codex CLI, Claude Code) re-sends its whole conversation every turn; the gateway renders it, finds the
session's trajectory the new prompt extends (``SessionManager.prepare_turn``) and records the answer durably
(``commit_turn``). This drives one session of ``--turns`` turns (a tool result of ``--tool-words`` words each, the
assistant answering with ``--answer-words``) against a real SQLite store and the model's real tokenizer and chat
template, and prints prepare and commit times at points along the way. The engine is not involved: the answer's
tokens are its text tokenized. Then, on the last turn's prompt, what a long prompt costs on its way to the engine,
each old way beside the new (best of 7): the gateway's ``/generate`` body (``json.dumps`` vs pydantic-core), the
engine's parse of it (``json.loads`` + validation vs one-pass ``model_validate_json``), and the engine's prefix-cache
comparison of this prompt with the last one (an element loop vs ``utils.sequences.common_prefix``).

    python tools/bench_session_turns.py --model tiny --turns 40
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_server.buffer.open import open_store  # noqa: E402
from slime_server.gateway.chat_template import ChatRenderer  # noqa: E402
from slime_server.gateway.sessions import ChoiceResult, SessionManager  # noqa: E402
from slime_server.server.launch import resolve_model_path  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog file src main py error line import def return class value "
         "Traceback (most recent call last): assert == != {} [] () ; : , . é ü 漢字 ✓").split()
TOOLS = [{"type": "function", "function": {"name": "shell", "description": "run a command", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a registry name (tiny, smollm2) or a model directory")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--tool-words", type=int, default=600)
    ap.add_argument("--answer-words", type=int, default=60)
    ap.add_argument("--points", type=int, default=8, help="turns to print, evenly spaced")
    ap.add_argument("--repeat", type=int, default=3, help="each printed turn is the median of this many sessions")
    args = ap.parse_args()
    renderer = ChatRenderer(resolve_model_path(args.model))
    runs = [one_session(renderer, args, seed) for seed in range(args.repeat)]
    every = max(1, args.turns // args.points)
    print(f"model {args.model}, {args.turns} turns, tool results of {args.tool_words} words; median of {args.repeat}")
    print("| turn | prompt tokens | prepare ms | commit ms |")
    print("|---|---|---|---|")
    for k in sorted({*range(0, args.turns, every), args.turns - 1}):
        tokens = runs[0][k][0]
        prep = statistics.median(r[k][1][0] for r in runs)
        commit = statistics.median(r[k][2] for r in runs)
        print(f"| {k + 1} | {tokens} | {prep:.2f} | {commit:.2f} |")
    wire(runs[0][-2][1][1], runs[0][-1][1][1])


def best_ms(fn, times: int = 7) -> float:
    best = float("inf")
    for _ in range(times):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def wire(last: list[int], ids: list[int]) -> None:
    """A long prompt's way to the engine, old and new side by side."""
    import json

    import pydantic_core

    from slime_server.rollout.protocol import GenerateReqInput
    from slime_server.utils.sequences import common_prefix

    def element_loop(a: list[int], b: list[int]) -> int:
        n, i = min(len(a), len(b)), 0
        while i < n and a[i] == b[i]:
            i += 1
        return i

    body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": 256}, "return_logprob": True,
            "stream": False}
    raw = json.dumps(body).encode()
    assert element_loop(last, ids) == common_prefix(last, ids)
    rows = [("gateway: /generate body", best_ms(lambda: json.dumps(body).encode()),
             best_ms(lambda: pydantic_core.to_json(body))),
            ("engine: parse and validate it", best_ms(lambda: GenerateReqInput.model_validate(json.loads(raw))),
             best_ms(lambda: GenerateReqInput.model_validate_json(raw))),
            ("engine: prefix match with the last turn", best_ms(lambda: element_loop(last, ids)),
             best_ms(lambda: common_prefix(last, ids)))]
    print(f"\nthe last prompt ({len(ids)} tokens) on its way to the engine, best of 7")
    print("| step | before ms | now ms |")
    print("|---|---|---|")
    for name, old, new in rows:
        print(f"| {name} | {old:.2f} | {new:.2f} |")


def one_session(renderer: ChatRenderer, args: argparse.Namespace,
                seed: int) -> list[tuple[int, tuple[float, list[int]], float]]:
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    store = open_store(Path(tempfile.mkdtemp(prefix="bench_session_")) / "trajectories.db")
    sessions = SessionManager(store, renderer)
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the failing test. " + text(200)}]
    rows = []
    for k in range(args.turns):
        t0 = time.perf_counter()
        prepared = sessions.prepare_turn("bench-session", messages, TOOLS)
        t1 = time.perf_counter()
        answer = "I will run: " + text(args.answer_words)
        ids = renderer.encode(answer) + [renderer.eos_token_id]
        choice = ChoiceResult(output_ids=ids, output_logprobs=[-0.1] * len(ids), weight_version=1, finish_reason="stop",
                              message={"role": "assistant", "content": answer}, response_id=f"resp-{k}")
        t2 = time.perf_counter()
        sessions.commit_turn(prepared, [choice])
        t3 = time.perf_counter()
        rows.append((len(prepared.prompt_ids), ((t1 - t0) * 1000, list(prepared.prompt_ids)), (t3 - t2) * 1000))
        messages = [*messages, {"role": "assistant", "content": answer},
                    {"role": "user", "content": "Output:\n" + text(args.tool_words)}]
    store.close()
    return rows


if __name__ == "__main__":
    main()
