"""``slime-server agent run``: play an environment's episodes against any slime-server's /v1."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from slime_server.agents.runner import AgentRunner, RunnerSettings
from slime_server.envs.base import get_environment, load_jsonl


class AgentCommand:
    help = "run environment episodes against a slime-server through the openai SDK (agent run --env ...)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("action", choices=["run"])
        parser.add_argument("--env", required=True, help="built-in environment (calculator) or module:attr")
        parser.add_argument("--base-url", required=True, help="the server's /v1 URL")
        parser.add_argument("--api-key", default="none")
        parser.add_argument("--data", default=None, help="JSONL dataset (slime rows); default: the env's own")
        parser.add_argument("--num-prompts", type=int, default=8, help="rows to play (default dataset size)")
        parser.add_argument("--n-samples", type=int, default=4, help="episodes per row, one group")
        parser.add_argument("--concurrency", type=int, default=8)
        parser.add_argument("--temperature", type=float, default=1.0)
        parser.add_argument("--max-tokens", type=int, default=64)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--no-rewards", action="store_true", help="do not post rewards (evaluation)")

    def run(self, args: argparse.Namespace, settings: Any) -> int:
        try:
            env = get_environment(args.env)
        except (ValueError, ImportError, AttributeError, TypeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        rows = load_jsonl(args.data)[: args.num_prompts] if args.data else env.default_dataset(args.num_prompts,
                                                                                                 seed=args.seed)
        runner = AgentRunner(env, RunnerSettings(
            base_url=args.base_url, api_key=args.api_key, n_samples_per_prompt=args.n_samples,
            concurrency=args.concurrency, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
            post_rewards=not args.no_rewards))
        summary = asyncio.run(runner.run(rows, on_episode=lambda r: print(
            f"[agent] {r.session_id} reward={r.reward:.2f} turns={r.turns} tool_calls={r.tool_calls}"
            + (f" error={r.error}" if r.error else ""), flush=True)))
        print(json.dumps(summary.model_dump(exclude={"results"})), flush=True)
        return 0 if summary.errors == 0 else 1
