"""The SGLang command line built from settings + --sglang-* pass-through (run for real only on GPU)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import shutil
import sys
import types
from typing import Any

import pytest

from slime_server.cli import build_parser, settings_from_args
from slime_server.config import EngineSettings, split_passthrough
from slime_server.rollout.actors import EngineSpec, engine_command
from slime_server.rollout.sglang_launcher import (
    SGLangArgsError,
    build_sglang_command,
    check_sglang_args,
    server_arg_names,
    sglang_flag_args,
)
from tests._sglang_source import sglang_file


def test_command_from_cli_flags_exactly() -> None:
    parser, _ = build_parser()
    rest, passthrough = split_passthrough([
        "engines", "--engine-kind", "sglang", "--model", "/models/qwen3-8b", "--max-running-requests", "64",
        "--sglang-mem-fraction-static", "0.7", "--sglang-tp-size", "2", "--sglang-enable-torch-compile",
        "--sglang-cuda-graph-bs", "1", "--sglang-cuda-graph-bs", "2",
    ])
    settings = settings_from_args(parser.parse_args(rest), passthrough)
    cmd = build_sglang_command(settings.engine, settings.engine.model, port=30001, python="/py")
    assert cmd == [
        "/py", "-m", "sglang.launch_server",
        "--model-path", "/models/qwen3-8b", "--host", "127.0.0.1", "--port", "30001",
        "--max-running-requests", "64",
        "--mem-fraction-static", "0.7", "--tp-size", "2", "--enable-torch-compile",
        "--cuda-graph-bs", "1", "2",
    ]


def test_passthrough_max_running_requests_wins_and_false_drops_flag() -> None:
    engine = EngineSettings(kind="sglang", max_running_requests=8,
                            sglang_args={"max_running_requests": 128, "disable_radix_cache": False})
    cmd = build_sglang_command(engine, "/m", port=1, python="py")
    assert cmd.count("--max-running-requests") == 1
    assert cmd[cmd.index("--max-running-requests") + 1] == "128"
    assert "--disable-radix-cache" not in cmd


@pytest.mark.parametrize("key", ["port", "host", "model-path", "model_path"])
def test_reserved_keys_are_refused(key: str) -> None:
    with pytest.raises(SGLangArgsError):
        sglang_flag_args({key: "x"})


def test_nested_mapping_refused() -> None:
    with pytest.raises(SGLangArgsError):
        sglang_flag_args({"json_model_override_args": {"a": 1}})


def test_engine_actor_uses_launcher_for_sglang_kind() -> None:
    spec = EngineSpec(kind="sglang", model_path="/m", sglang_args={"tp_size": 4}, max_running_requests=16)
    cmd = engine_command(spec, 4242)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert cmd[3:] == ["--model-path", "/m", "--host", "127.0.0.1", "--port", "4242",
                       "--max-running-requests", "16", "--tp-size", "4"]
    cpu = engine_command(EngineSpec(model_path="/m"), 4243)
    assert cpu[1:3] == ["-m", "slime_server.rollout.engine_server"]


def test_importing_launcher_does_not_import_sglang() -> None:
    import subprocess

    code = ("import sys, slime_server.rollout.sglang_launcher, slime_server.server.launch, slime_server.cli; "
            "sys.exit(1 if 'sglang' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs an NVIDIA GPU and the gpu extra")
def test_passthrough_names_are_real_sglang_args() -> None:
    pytest.importorskip("sglang")
    from slime_server.rollout.sglang_launcher import check_sglang_args

    assert check_sglang_args({"mem_fraction_static": 0.7, "tp_size": 1}) == []
    assert check_sglang_args({"no_such_option_xyz": 1}) == ["no_such_option_xyz"]


# ---------------------------------------------------------------- ServerArgs of the pinned release (0.5.23)

SERVER_ARGS = "sglang/srt/server_args.py"
FIELDS_PKG = "sglang.srt.arg_groups.fields."


def _annotated_names(cls: ast.ClassDef) -> list[str]:
    return [st.target.id for st in cls.body if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
            and "ClassVar" not in ast.unparse(st.annotation)]


@functools.cache
def sglang_0_5_23_server_arg_names() -> tuple[str, ...]:
    """The field names of 0.5.23's ``ServerArgs``, read with ``ast`` from the wheel (never imported).

    0.5.23 builds ``ServerArgs`` with ``msgspec.defstruct`` from the fields of the namespace Structs listed
    in ``_INPUT_NAMESPACES`` (each imported from ``sglang.srt.arg_groups.fields.<module>``) plus any
    annotation of the ``ServerArgs`` class body itself.
    """
    tree = ast.parse(sglang_file(SERVER_ARGS).read_text(encoding="utf-8"))
    module_of: dict[str, str] = {}
    namespaces: list[str] = []
    own: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(FIELDS_PKG):
            module_of.update({a.asname or a.name: node.module for a in node.names})
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
                                                  for t in node.targets):
            assert isinstance(node.value, ast.List)
            namespaces = [e.id for e in node.value.elts if isinstance(e, ast.Name)]
        elif isinstance(node, ast.ClassDef) and node.name == "ServerArgs":
            own = _annotated_names(node)
    assert namespaces, "_INPUT_NAMESPACES not found: did SGLang change how ServerArgs is built?"
    names = list(own)
    for ns in namespaces:
        rel = module_of[ns].replace(".", "/") + ".py"
        mod = ast.parse(sglang_file(rel).read_text(encoding="utf-8"))
        cls = next(n for n in mod.body if isinstance(n, ast.ClassDef) and n.name == ns)
        names += _annotated_names(cls)
    assert len(names) == len(set(names)), "a field declared twice"
    return tuple(names)


def _fake_sglang(monkeypatch: pytest.MonkeyPatch, server_args_cls: type) -> None:
    """Make ``from sglang.srt.server_args import ServerArgs`` give ``server_args_cls`` (no CUDA needed)."""
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    mod = types.ModuleType("sglang.srt.server_args")
    mod.ServerArgs = server_args_cls  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", mod)


def test_tp_size_is_a_server_args_field() -> None:
    """The weight pusher reads each engine's ``tp_size`` from ``GET /server_info``, which reports ``ServerArgs``."""
    assert "tp_size" in sglang_0_5_23_server_arg_names()


def test_0_5_23_server_args_fields_parse() -> None:
    names = set(sglang_0_5_23_server_arg_names())
    assert len(names) > 300
    # what build_sglang_command always passes, and what the docs' examples pass through
    assert {"model_path", "host", "port", "max_running_requests", "mem_fraction_static", "tp_size",
            "cuda_graph_bs_decode", "enable_torch_compile", "disable_radix_cache", "api_key", "weight_version"} <= names


def test_check_sglang_args_on_0_5_23_msgspec_struct(monkeypatch: pytest.MonkeyPatch) -> None:
    import msgspec

    names = sglang_0_5_23_server_arg_names()
    # built as 0.5.23 builds it: msgspec.defstruct(..., dict=True); not a dataclass
    server_args = msgspec.defstruct("ServerArgs", [(n, Any, None) for n in names], dict=True)
    assert not dataclasses.is_dataclass(server_args)
    _fake_sglang(monkeypatch, server_args)
    assert server_arg_names(server_args) == frozenset(names)
    assert check_sglang_args({"mem_fraction_static": 0.7, "tp-size": 1}) == []
    assert check_sglang_args({"no_such_option_xyz": 1, "tp_size": 2}) == ["no_such_option_xyz"]
    # 0.5.23 split --cuda-graph-bs into --cuda-graph-bs-decode / --cuda-graph-bs-prefill: caught before launch
    assert check_sglang_args({"cuda_graph_bs": [1, 2], "cuda_graph_bs_decode": [1, 2]}) == ["cuda_graph_bs"]


def test_check_sglang_args_on_a_dataclass_server_args(monkeypatch: pytest.MonkeyPatch) -> None:
    """Releases up to 0.5.15 declare ServerArgs as a dataclass."""
    server_args = dataclasses.make_dataclass("ServerArgs", [("tp_size", int, 1), ("mem_fraction_static", float, 0.8)])
    _fake_sglang(monkeypatch, server_args)
    assert check_sglang_args({"mem_fraction_static": 0.7, "tp_size": 1}) == []
    assert check_sglang_args({"no_such_option_xyz": 1}) == ["no_such_option_xyz"]
    with pytest.raises(TypeError):
        server_arg_names(dict)


def test_api_key_is_passed_only_where_the_release_has_it() -> None:
    engine = EngineSettings(kind="sglang")
    known = sglang_0_5_23_server_arg_names()
    cmd = build_sglang_command(engine, "/m", port=1, python="py", api_key="k", known_args=known)
    assert cmd[cmd.index("--api-key") + 1] == "k"
    without = [n for n in known if n != "api_key"]
    assert "--api-key" not in build_sglang_command(engine, "/m", port=1, python="py", api_key="k", known_args=without)
    # an explicit --sglang-api-key wins over slime-server's own
    mine = EngineSettings(kind="sglang", sglang_args={"api_key": "user"})
    cmd = build_sglang_command(mine, "/m", port=1, python="py", api_key="k", known_args=known)
    assert cmd.count("--api-key") == 1 and cmd[cmd.index("--api-key") + 1] == "user"
    # optional flags the release lacks are dropped; known ones kept
    cmd = build_sglang_command(engine, "/m", port=1, python="py", known_args=known,
                               optional_args={"weight_version": "0", "health_check_timeout": 5})
    assert cmd[-2:] == ["--weight-version", "0"] and "--health-check-timeout" not in cmd


def test_a_key_starting_with_a_dash_is_joined_to_its_flag() -> None:
    """SGLang parses its command line with argparse, which takes ``--api-key -x`` for two options."""
    import argparse

    key = "-x3Gq_" + "a" * 38
    cmd = build_sglang_command(EngineSettings(kind="sglang"), "/m", port=1, python="py", api_key=key,
                               known_args=sglang_0_5_23_server_arg_names())
    assert f"--api-key={key}" in cmd
    parser = argparse.ArgumentParser()  # SGLang's ServerArgs.add_cli_args declares it this way (type str)
    parser.add_argument("--api-key", type=str)
    assert parser.parse_known_args(cmd[3:])[0].api_key == key


def test_no_optional_flag_means_no_sglang_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without optional flags the command is built without looking SGLang up (CPU driver, no gpu extra)."""
    monkeypatch.setitem(sys.modules, "sglang", None)  # any import of it would raise
    cmd = build_sglang_command(EngineSettings(kind="sglang"), "/m", port=1, python="py")
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    # with one and no SGLang here, it is passed unchecked (the engine's node has SGLang; the launch checks)
    cmd = build_sglang_command(EngineSettings(kind="sglang"), "/m", port=1, python="py", api_key="k")
    assert cmd[-2:] == ["--api-key", "k"]


def test_lora_settings_reach_both_engine_kinds_as_sglang_flags() -> None:
    """Issue 43: ``engine.lora_paths`` / ``max_lora_rank`` / ... become the same flags for SGLang (every one a field of
    0.5.23's ServerArgs) and for the CPU engine (whose parser reads them back to the same values); none without
    LoRA."""
    from slime_server.rollout.actors import lora_args
    from slime_server.rollout.engine_server import build_parser as engine_parser

    engine = EngineSettings(kind="sglang", lora_paths="a=/adapters/a,b=/adapters/b", max_lora_rank=32,
                            max_loaded_loras=16)
    args = lora_args(engine)
    cmd = build_sglang_command(engine, "m", 1, optional_args=args, known_args=sglang_0_5_23_server_arg_names())
    flags = cmd[cmd.index("--max-running-requests") + 2:]
    assert flags == ["--enable-lora", "--lora-paths", "a=/adapters/a", "b=/adapters/b", "--max-lora-rank", "32",
                     "--max-loras-per-batch", "8", "--max-loaded-loras", "16"]
    cpu = engine_command(EngineSpec(model_path="m", lora=args), 1)
    parsed = engine_parser().parse_args(cpu[cpu.index("--model-path"):])
    assert (parsed.enable_lora, parsed.lora_paths, parsed.max_lora_rank, parsed.max_loaded_loras) == (
        True, ["a=/adapters/a", "b=/adapters/b"], 32, 16)
    assert lora_args(EngineSettings()) == {}
    assert "--enable-lora" not in engine_command(EngineSpec(model_path="m"), 1)


def test_the_routed_experts_flag_reaches_both_engine_kinds() -> None:
    """Issue 44: ``engine.enable_return_routed_experts`` is SGLang's ``--enable-return-routed-experts`` (a field of
    0.5.23's ServerArgs) for SGLang and for the CPU engine, beside LoRA's flags or alone; and it turns the gateway's
    recording on."""
    from slime_server.config import load_settings
    from slime_server.rollout.actors import lora_args
    from slime_server.rollout.engine_server import build_parser as engine_parser

    for engine in (EngineSettings(kind="sglang", enable_return_routed_experts=True),
                   EngineSettings(kind="sglang", enable_return_routed_experts=True, enable_lora=True)):
        args = lora_args(engine)
        cmd = build_sglang_command(engine, "m", 1, optional_args=args, known_args=sglang_0_5_23_server_arg_names())
        assert "--enable-return-routed-experts" in cmd
        cpu = engine_command(EngineSpec(model_path="m", lora=args), 1)
        assert engine_parser().parse_args(cpu[cpu.index("--model-path"):]).enable_return_routed_experts is True
    assert "--enable-return-routed-experts" not in engine_command(EngineSpec(model_path="m"), 1)
    assert load_settings(None, {"engine": {"enable_return_routed_experts": True}}).gateway.record_routed_experts
    assert not load_settings(None, {}).gateway.record_routed_experts
