"""``slime-server`` entry point.

Subcommands live in ``SUBCOMMANDS`` as lazy ``"module:attr"`` references to objects with
``help``, ``add_arguments(parser)`` and ``run(args, settings) -> int``; adding one (serve, demo,
train, ...) is one line here plus the object in its own module. Every subcommand gets ``--config``,
the common settings flags in ``SETTINGS_FLAGS`` and the ``--sglang-*`` pass-through.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import ValidationError

from slime_server.config import ConfigError, ServerSettings, SetupError, load_settings, split_passthrough
from slime_server.utils.logs import setup_logging
from slime_server.utils.torch_free import transformers_without_torch


class Subcommand(Protocol):
    help: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace, settings: ServerSettings) -> int: ...


SUBCOMMANDS: dict[str, str] = {
    "engines": "slime_server.server.engines_cmd:EnginesCommand",
    "serve": "slime_server.server.serve_cmd:ServeCommand",
    "gateway": "slime_server.server.gateway_cmd:GatewayCommand",
    "demo": "slime_server.demo:DemoCommand",
    "export": "slime_server.buffer.export:ExportCommand",
    "keys": "slime_server.buffer.keys_cli:KeysCommand",
    "agent": "slime_server.agents.cli:AgentCommand",
    "model": "slime_server.models.registry:ModelCommand",
    "train": "slime_server.server.jobs_cmd:TrainCommand",
    "jobs": "slime_server.server.jobs_cmd:JobsCommand",
}
# commands whose transformers needs no torch: run as the process's own command line, they load it without
# (utils/torch_free.py: a gateway's start is then ~1.4 CPU-s shorter)
TORCH_FREE = {"gateway"}

# flag -> (dotted settings path, type). Values left at None do not override env/YAML.
SETTINGS_FLAGS: dict[str, tuple[str, type]] = {
    "--model": ("engine.model", str),
    "--num-engines": ("engine.num_engines", int),
    "--engine-kind": ("engine.kind", str),
    "--max-running-requests": ("engine.max_running_requests", int),
    "--engine-host": ("engine.host", str),
    "--engine-cpus": ("engine.cpus", str),
    "--engine-threads": ("engine.torch_threads", int),
    "--insecure-engines": ("engine.insecure", bool),
    "--enable-lora": ("engine.enable_lora", bool),
    "--enable-return-routed-experts": ("engine.enable_return_routed_experts", bool),
    "--lora-paths": ("engine.lora_paths", str),
    "--max-lora-rank": ("engine.max_lora_rank", int),
    "--insecure-gateway": ("gateway.insecure", bool),
    "--router-policy": ("router.policy", str),
    "--router-host": ("router.host", str),
    "--router-port": ("router.port", int),
    "--ray-address": ("ray.address", str),
    "--ray-num-cpus": ("ray.num_cpus", int),
    "--ray-auth-token-file": ("ray.auth_token_file", str),
    "--trainer-num-ranks": ("trainer.num_ranks", int),
    "--trainer-tp-size": ("trainer.tp_size", int),
    "--trainer-work-dir": ("trainer.work_dir", str),
    "--trainer-cpus": ("trainer.cpus", str),
    "--trainer-threads": ("trainer.torch_threads", int),
    "--colocate": ("trainer.colocate", bool),
    "--log-level": ("log.level", str),
    "--log-format": ("log.format", str),
    "--online": ("online.enabled", bool),
    "--judge-url": ("online.judge_url", str),
    "--judge-engine-model": ("online.judge_engine_model", str),
    "--judge-engines": ("online.judge_engines", int),
    "--judge-model": ("online.judge_model", str),
    "--judge-api-key": ("online.judge_api_key", str),
    "--judge-votes": ("online.judge_votes", int),
    "--online-batch-size": ("online.batch_size", int),
    "--online-lr": ("online.lr", float),
    "--opd-weight": ("online.opd_weight", float),
    "--rl-weight": ("online.rl_weight", float),
}


def _dest(flag: str) -> str:
    return "setting:" + SETTINGS_FLAGS[flag][0]


def _setting_help(path: str) -> str:
    """``sets engine.cpus: <the setting's own description>`` (argparse's % signs escaped)."""
    section, field = path.split(".")
    model = ServerSettings.model_fields[section].annotation
    info = getattr(model, "model_fields", {}).get(field)
    description = info.description if info is not None and info.description else ""
    return f"sets {path}" + (f": {description}".replace("%", "%%") if description else "")


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML settings file (below env vars and flags in precedence)")
    group = parser.add_argument_group("settings (override SLIME_* env vars and --config)")
    for flag, (path, typ) in SETTINGS_FLAGS.items():
        if typ is bool:  # a switch: absent leaves the setting alone, present sets it True
            group.add_argument(flag, dest=_dest(flag), action="store_const", const=True, default=None,
                               help=_setting_help(path))
            continue
        group.add_argument(flag, dest=_dest(flag), type=typ, default=None, metavar=path.split(".")[-1].upper(),
                           help=_setting_help(path))


def settings_from_args(args: argparse.Namespace, passthrough: dict[str, dict[str, Any]]) -> ServerSettings:
    """Merge flags (and pass-through dicts) over env vars, YAML and defaults."""
    overrides: dict[str, Any] = {section: dict(fields) for section, fields in passthrough.items()}
    for flag, (path, _) in SETTINGS_FLAGS.items():
        value = getattr(args, _dest(flag))
        section, field = path.split(".")
        overrides.setdefault(section, {})[field] = value
    return load_settings(args.config, overrides)


def _load(ref: str) -> Subcommand:
    module, _, attr = ref.partition(":")
    obj = getattr(importlib.import_module(module), attr)
    return obj() if isinstance(obj, type) else obj


def build_parser(command: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, Subcommand]]:
    """The parser of every command, or of ``command`` alone: each command's module is imported to add its
    arguments, and a command run needs only its own (``slime-server jobs list`` imported all ten, serve's and the
    demo's included: 1.25 against 0.55 CPU-s; a gateway's 1.25 against 0.95)."""
    parser = argparse.ArgumentParser(prog="slime-server", description="Asynchronous agent RL server.",
                                     epilog="Any --sglang-KEY VALUE flag is passed to SGLang as --KEY VALUE.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands: dict[str, Subcommand] = {}
    for name, ref in SUBCOMMANDS.items():
        if command is not None and name != command:
            continue
        cmd = _load(ref)
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        add_settings_arguments(p)
        cmd.add_arguments(p)
        commands[name] = cmd
    return parser, commands


def main(argv: Sequence[str] | None = None) -> int:
    own_process = argv is None  # not main() called inside another program (a test, a tool): its imports are its own
    argv = list(sys.argv[1:] if argv is None else argv)
    if own_process and argv and argv[0] in TORCH_FREE:
        transformers_without_torch()
    # the command comes first (the top level has no options but --help); anything else gets every command's parser
    parser, commands = build_parser(argv[0] if argv and argv[0] in SUBCOMMANDS else None)
    try:
        rest, passthrough = split_passthrough(argv)
    except ConfigError as e:
        parser.error(str(e))
    args = parser.parse_args(rest)
    try:
        settings = settings_from_args(args, passthrough)
    except (ConfigError, ValidationError) as e:
        parser.error(f"invalid settings: {e}")

    setup_logging(settings.log.level, settings.log.format)
    try:
        return commands[args.command].run(args, settings)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
