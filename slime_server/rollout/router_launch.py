"""``python -m slime_server.rollout.router_launch ARGS``: sgl-router's own launcher, given the engine key.

Why a wrapper: sgl-router takes its key only as ``--api-key`` (it then demands it from its clients and
sends it to its workers), and a command line is readable by every local user through ``ps``. The key
comes in the environment (``SLIME_SERVER_ENGINE_KEY``, readable only by the owner) and is appended to the
arguments inside this process.
"""

from __future__ import annotations

import os
import sys

from slime_server.rollout.engine_auth import KEY_ENV
from slime_server.utils.procs import cli_flags


def router_args(argv: list[str], key: str | None) -> list[str]:
    """``argv`` plus the key as ``cli_flags`` writes it (joined to its flag when it starts with ``-``, which
    argparse would otherwise take for an option: "--api-key: expected one argument", once in 64 generated keys)."""
    return [*argv, *cli_flags({"api_key": key or None})]


def main(argv: list[str] | None = None) -> None:
    from sglang_router.launch_router import launch_router, parse_router_args

    key = os.environ.pop(KEY_ENV, None)
    launch_router(parse_router_args(router_args(list(sys.argv[1:] if argv is None else argv), key)))


if __name__ == "__main__":
    main()
