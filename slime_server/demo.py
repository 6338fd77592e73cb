"""``slime-server demo``: the main job on the CPU default, end to end, with nothing to download.

It brings up what ``slime-server serve`` does (Ray, engines, the real sgl-router, the gateway),
then plays one agent episode through the real ``openai`` SDK exactly as a user's agent would:
open a session, chat with a tool offered, send the tool result back, post a reward, close the
session, and print the recorded token-exact trajectory. Then it keeps serving until Ctrl-C
(``--episodes-only`` exits instead, which is what the test uses).

Why a separate command and not a script: it is the first thing a new user runs (``make demo``),
so it must use the same code paths as production and shut down with no orphan processes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from slime_server.config import ServerSettings
from slime_server.demo_learning import DemoFailed, DemoLearningSettings, ensure_warm_start, run_rl
from slime_server.demo_vision import VisionDemoSettings, ensure_vision_warm_start, run_vision_rl
from slime_server.demo_vision import summary as vision_summary
from slime_server.server.launch import resolve_model_path
from slime_server.server.serve_cmd import RunningServer, start_server
from slime_server.utils.eval_args import parse_eval_data
from slime_server.utils.procs import run_until_signal

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def play_episode(base_url: str, api_key: str | None, *, seed: int = 0) -> dict[str, Any]:
    """One tool-using episode through the OpenAI SDK; returns the recorded trajectory summary."""
    from openai import OpenAI

    key = api_key or "none"
    rest = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    session = rest.post("/sessions", json={"metadata": {"source": "demo"}}).raise_for_status().json()
    sid = session["id"]
    client = OpenAI(base_url=base_url, api_key=key, default_headers={"X-Session-Id": sid})
    model = client.models.list().data[0].id
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL],
                                           max_tokens=48, temperature=1.0, seed=seed)
    msg = first.choices[0].message
    print(f"[demo] turn 1 ({first.choices[0].finish_reason}): {msg.content!r} tool_calls={len(msg.tool_calls or [])}",
          flush=True)
    messages.append(msg.model_dump(exclude_none=True))
    call_id = msg.tool_calls[0].id if msg.tool_calls else "call_demo"
    messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temp_c": 18, "sky": "clear"})})
    second = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL],
                                            max_tokens=48, temperature=1.0, seed=seed + 1)
    print(f"[demo] turn 2 ({second.choices[0].finish_reason}): {second.choices[0].message.content!r}", flush=True)
    rest.post(f"/sessions/{sid}/reward", json={"reward": 1.0, "idempotency_key": "demo"}).raise_for_status()
    rest.post(f"/sessions/{sid}/close").raise_for_status()
    trajs = rest.get(f"/sessions/{sid}/trajectory").raise_for_status().json()
    summary = {
        "session_id": sid,
        "segments": len(trajs),
        "tokens": sum(t["num_tokens"] for t in trajs),
        "trained_tokens": sum(sum(t["loss_mask"]) for t in trajs),
        "reward": trajs[0]["reward"] if trajs else None,
        "weight_versions": sorted({v for t in trajs for v, m in zip(t["weight_versions"], t["loss_mask"], strict=True) if m}),
    }
    print("[demo] trajectory: " + json.dumps(summary), flush=True)
    return summary


class DemoCommand:
    help = ("warm-start the tiny CPU model, train it by RL on the calculator environment through the whole "
            "stack (progress, plot, summary), then keep serving it")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--port", type=int, default=None, help="gateway port (default: a free one)")
        parser.add_argument("--db-path", default=None, help="SQLite trajectory store (default: a temp dir)")
        parser.add_argument("--log-dir", default=None, help="engine and router logs (default: a temp dir)")
        parser.add_argument("--work-dir", default=None, help="datasets, job files and the plot (default: a temp dir)")
        parser.add_argument("--steps", type=int, default=None, help="RL steps (default 40)")
        parser.add_argument("--sft-steps", type=int, default=None, help="warm-start SFT steps (default 400)")
        parser.add_argument("--eval-every", type=int, default=None, help="evaluate the held-out set every N steps")
        parser.add_argument("--lr", type=float, default=None, help="RL learning rate (default 1e-4)")
        parser.add_argument("--sft-lr", type=float, default=None, help="warm-start SFT peak learning rate (default 1e-3)")
        parser.add_argument("--eval-prompts", type=int, default=None, help="held-out problems per evaluation (default 64)")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--sft-seed", type=int, default=None,
                            help="the warm start's SFT batch order (default 0): another seed is another warm start")
        parser.add_argument("--eval-data", action="append", default=[], metavar="NAME=PATH",
                            help="extra JSONL eval set for the calculator environment (repeatable)")
        parser.add_argument("--vision", action="store_true",
                            help="the visual demo: the tiny vision-language model learns the shapes environment (its "
                                 "tool returns a picture; the answer is the shape's colour)")
        parser.add_argument("--no-learn", action="store_true",
                            help="skip the warm start and RL: play one recorded episode on the base model")
        parser.add_argument("--exit", action="store_true", help="exit at the end instead of serving")
        parser.add_argument("--episodes-only", action="store_true", help="same as --no-learn --exit")

    def learning_settings(self, args: argparse.Namespace) -> Any:
        if args.vision:
            return vision_settings(args)
        values = DemoLearningSettings(seed=args.seed).model_dump()
        if args.steps is not None:
            values["rl_steps"] = args.steps
        if args.eval_every is not None:
            values["eval_every"] = args.eval_every
        if args.sft_steps is not None:
            values["sft"]["steps"] = args.sft_steps
        if args.sft_lr is not None:
            values["sft"]["lr"] = args.sft_lr
        if args.sft_seed is not None:
            values["sft"]["seed"] = args.sft_seed
        if args.lr is not None:
            values["lr"] = args.lr
        if args.eval_prompts is not None:
            values["eval_prompts"] = args.eval_prompts
        return DemoLearningSettings.model_validate(values)

    def run(self, args: argparse.Namespace, settings: ServerSettings) -> int:
        import tempfile

        no_learn = args.no_learn or args.episodes_only
        if args.vision and (no_learn or args.eval_data):
            print("[demo] error: --vision always learns (warm start, then RL on shapes); --no-learn, "
                  "--episodes-only and --eval-data are the calculator demo's", file=sys.stderr, flush=True)
            return 2
        exit_at_end = args.exit or args.episodes_only
        work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="slime-demo-"))
        work.mkdir(parents=True, exist_ok=True)
        eval_sets = parse_eval_data(args.eval_data)
        learn = None if no_learn else self.learning_settings(args)
        if learn is not None:
            warm = (ensure_vision_warm_start(learn) if args.vision else
                    ensure_warm_start(resolve_model_path(settings.engine.model), learn))
            trainer = settings.trainer.model_copy(update={"work_dir": str(work / "jobs")})
            settings = settings.model_copy(update={"engine": settings.engine.model_copy(update={"model": str(warm)}),
                                                   "trainer": trainer})
        gw_settings = settings.gateway.model_copy(update={
            "port": args.port or 0, "db_path": args.db_path or str(work / "trajectories.db")})

        def start_and_play() -> RunningServer:
            t0 = time.monotonic()
            running = start_server(settings, gw_settings, args.log_dir or work / "logs")
            try:
                print(f"[demo] up in {time.monotonic() - t0:.1f}s: openai_base_url: {running.base_url} "
                      f"({len(running.deployment.engine_urls)} engine(s), db {gw_settings.db_path})", flush=True)
                if learn is None:
                    play_episode(running.base_url, gw_settings.api_key)
                else:
                    learn_and_report(running, gw_settings.admin_api_key or gw_settings.api_key, learn, work,
                                     eval_sets)
            except BaseException:
                running.stop()
                raise
            return running

        def start() -> RunningServer:
            running = start_and_play()
            print("[demo] serving; point any OpenAI client at the URL above. Ctrl-C stops.", flush=True)
            return running

        try:
            if exit_at_end:
                start_and_play().stop()
                print("[demo] stopped", flush=True)
                return 0
            code = run_until_signal(start, lambda running: running.stop())
        except DemoFailed as e:  # the server was stopped on the way out
            print(f"[demo] error: {e}", file=sys.stderr, flush=True)
            return 1
        print("[demo] stopped", flush=True)
        return code


def vision_settings(args: argparse.Namespace) -> VisionDemoSettings:
    """``--vision``'s settings: the flags that apply to it (steps, evaluation, RL lr, SFT steps, lr and seed)."""
    values = VisionDemoSettings(seed=args.seed).model_dump()
    for flag, key in (("steps", "rl_steps"), ("eval_every", "eval_every"), ("eval_prompts", "eval_prompts"),
                      ("lr", "lr")):
        if getattr(args, flag) is not None:
            values[key] = getattr(args, flag)
    for flag, key in (("sft_steps", "steps"), ("sft_lr", "lr"), ("sft_seed", "seed")):
        if getattr(args, flag) is not None:
            values["sft"][key] = getattr(args, flag)
    return VisionDemoSettings.model_validate(values)


def learn_and_report(running: Any, admin_key: str | None, learn: Any, work: Path,
                     eval_sets: list[tuple[str, str]]) -> None:
    root = running.base_url.removesuffix("/v1")
    if isinstance(learn, VisionDemoSettings):
        print("[demo] summary: " + vision_summary(run_vision_rl(root, admin_key, learn, work)), flush=True)
        return
    result = run_rl(root, admin_key, learn, work, extra_evals=eval_sets)
    held = [e for e in result.evals if e["name"] == "held_out"]
    print("[demo] summary: " + json.dumps({
        "job_id": result.job_id, "rl_steps": result.steps, "rl_seconds": round(result.seconds, 1),
        "success_before": result.before, "success_after": result.after,
        "gain_points": round(100 * (result.after - result.before), 1),
        "curve": [(e["step"], e["success_rate"]) for e in held],
        "other_evals": [(e["name"], e["step"], e["success_rate"]) for e in result.evals if e["name"] != "held_out"],
        "plot": result.plot}), flush=True)
