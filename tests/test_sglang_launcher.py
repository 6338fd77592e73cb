"""The SGLang command line built from settings + --sglang-* pass-through (run for real only on GPU)."""

from __future__ import annotations

import shutil
import sys

import pytest

from slime_server.cli import build_parser, settings_from_args
from slime_server.config import EngineSettings, split_passthrough
from slime_server.rollout.actors import EngineSpec, engine_command
from slime_server.rollout.sglang_launcher import SGLangArgsError, build_sglang_command, sglang_flag_args


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

    code = ("import sys, slime_server.rollout.sglang_launcher, slime_server.launch, slime_server.cli; "
            "sys.exit(1 if 'sglang' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs an NVIDIA GPU and the gpu extra")
def test_passthrough_names_are_real_sglang_args() -> None:
    pytest.importorskip("sglang")
    from slime_server.rollout.sglang_launcher import check_sglang_args

    assert check_sglang_args({"mem_fraction_static": 0.7, "tp_size": 1}) == []
    assert check_sglang_args({"no_such_option_xyz": 1}) == ["no_such_option_xyz"]
