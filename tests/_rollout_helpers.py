"""Helpers for the rollout tests (router, launch, CLI): request bodies, engine-side traffic counts,
and /proc-based process-tree checks (psutil is not a dependency)."""

from __future__ import annotations

import os

import httpx

from slime_server.utils.procs import pid_alive, proc_stat

__all__ = ["pid_alive", "proc_tree", "generate_body", "served_generate_count"]

PROMPT = [11, 12, 13, 14, 15, 16]


def generate_body(seed: int = 0, max_new_tokens: int = 4) -> dict:
    """An SGLang-native /generate body that always produces exactly ``max_new_tokens`` tokens."""
    return {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0.7, "max_new_tokens": max_new_tokens, "ignore_eos": True,
                            "sampling_seed": seed},
        "return_logprob": True,
    }


def served_generate_count(engine) -> int:
    """How many /generate requests the engine itself says it has served (not the router's word)."""
    url = engine if isinstance(engine, str) else engine.url()
    r = httpx.get(f"{url}/get_server_info", timeout=10)
    r.raise_for_status()
    return int(r.json()["num_generate_requests"])


def proc_tree(root: int) -> dict[int, str]:
    """All live descendants of ``root`` (any depth, across sessions): pid -> start time."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None:
                children.setdefault(int(st[1]), []).append(int(entry))
                starts[int(entry)] = st[19]
    out: dict[int, str] = {}
    stack = [root]
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in out:
                out[c] = starts[c]
                stack.append(c)
    return out
