"""Command line for a real SGLang server (GPU path).

Every ``--sglang-foo-bar v`` flag given to ``slime-server`` becomes ``--foo-bar v`` here, as slime
does, so any SGLang option is reachable without us mirroring SGLang's ~300 flags. SGLang itself is
imported only inside ``check_sglang_args`` (the CPU install does not have it).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from slime_server.config import EngineSettings
from slime_server.utils.procs import cli_flags

# Set by the launcher from EngineSettings/actor placement; a pass-through copy would be ambiguous.
RESERVED_KEYS = frozenset({"model_path", "host", "port"})


class SGLangArgsError(ValueError):
    """A pass-through argument cannot be turned into an SGLang flag."""


def sglang_flag_args(args: Mapping[str, Any]) -> list[str]:
    """``{"mem_fraction_static": 0.7, "enable_x": True, "y": [1, 2]}`` -> SGLang CLI tokens.

    True is a bare switch, False/None drop the flag, lists become several values after one flag.
    """
    normalized: dict[str, Any] = {}
    for key, value in args.items():
        norm = key.replace("-", "_")
        if norm in RESERVED_KEYS:
            raise SGLangArgsError(f"--sglang-{key.replace('_', '-')} is set by slime-server itself")
        if isinstance(value, dict):
            raise SGLangArgsError(f"--{norm.replace('_', '-')}: nested mappings cannot be passed on a command line")
        normalized[norm] = value
    return cli_flags(normalized)


def build_sglang_command(engine: EngineSettings, model_path: str, port: int,
                         python: str = sys.executable) -> list[str]:
    """The exact ``python -m sglang.launch_server`` command for one engine on ``port``."""
    args = dict(engine.sglang_args)
    cmd = [
        python, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", engine.host,
        "--port", str(port),
    ]
    if "max_running_requests" not in args:
        cmd += ["--max-running-requests", str(engine.max_running_requests)]
    return cmd + sglang_flag_args(args)


def check_sglang_args(args: Mapping[str, Any]) -> list[str]:
    """Names in ``args`` that SGLang's ``ServerArgs`` does not know (needs sglang installed)."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs  # lazy: GPU extra only

    known = {f.name for f in dataclasses.fields(ServerArgs)}
    return sorted(k.replace("-", "_") for k in args if k.replace("-", "_") not in known)
