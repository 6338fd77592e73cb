"""Settings precedence (flags > env > YAML > defaults) and pass-through flag collection."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from slime_server.cli import SUBCOMMANDS, build_parser, settings_from_args
from slime_server.config import ConfigError, ServerSettings, load_settings, split_passthrough


def _settings(argv: list[str]) -> ServerSettings:
    parser, _ = build_parser()
    rest, passthrough = split_passthrough(argv)
    return settings_from_args(parser.parse_args(rest), passthrough)


@pytest.fixture
def yaml_file(tmp_path: Path) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(
        "engine:\n  model: /models/from-yaml\n  num_engines: 3\n  max_running_requests: 7\n"
        "  sglang_args:\n    tp_size: 2\n    mem_fraction_static: 0.5\n"
        "router:\n  policy: random\n  port: 1111\n"
    )
    return p


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k.startswith("SLIME_"):
            monkeypatch.delenv(k)


def test_defaults() -> None:
    s = _settings(["engines"])
    assert s == ServerSettings()
    assert (s.engine.model, s.engine.num_engines, s.engine.kind) == ("tiny", 1, "cpu")
    assert s.router.policy == "round_robin" and s.ray.address is None and s.engine.sglang_args == {}


def test_yaml_over_defaults(yaml_file: Path) -> None:
    s = _settings(["engines", "--config", str(yaml_file)])
    assert s.engine.model == "/models/from-yaml"
    assert s.engine.num_engines == 3
    assert s.router.policy == "random"
    assert s.engine.kind == "cpu"  # untouched default survives the partial YAML section


def test_env_over_yaml(yaml_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIME_ENGINE__NUM_ENGINES", "5")
    monkeypatch.setenv("SLIME_ROUTER__POLICY", "cache_aware")
    s = _settings(["engines", "--config", str(yaml_file)])
    assert (s.engine.num_engines, s.router.policy) == (5, "cache_aware")
    assert s.engine.max_running_requests == 7  # from YAML, env did not set it
    assert s.router.port == 1111


def test_flags_over_env_and_yaml(yaml_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIME_ENGINE__NUM_ENGINES", "5")
    monkeypatch.setenv("SLIME_ENGINE__MODEL", "/models/from-env")
    s = _settings(["engines", "--config", str(yaml_file), "--num-engines", "2", "--router-policy", "power_of_two"])
    assert s.engine.num_engines == 2
    assert s.router.policy == "power_of_two"
    assert s.engine.model == "/models/from-env"  # no --model flag: env wins over YAML


def test_sglang_passthrough_lands_in_sglang_args(yaml_file: Path) -> None:
    s = _settings(["engines", "--config", str(yaml_file), "--sglang-mem-fraction-static", "0.7",
                   "--sglang-enable-torch-compile", "--model", "m", "--sglang-chunked-prefill-size=512"])
    assert s.engine.sglang_args == {
        "tp_size": 2,  # from YAML, merged, not replaced
        "mem_fraction_static": "0.7",  # the flag beats YAML's 0.5
        "enable_torch_compile": True,
        "chunked_prefill_size": "512",
    }
    assert s.engine.model == "m"


def test_split_passthrough_repeated_flag_collects_list() -> None:
    rest, found = split_passthrough(["a", "--sglang-x", "1", "--sglang-x", "2", "--router-extra-queue-size", "8"])
    assert rest == ["a"]
    assert found == {"engine": {"sglang_args": {"x": ["1", "2"]}}, "router": {"extra_args": {"queue_size": "8"}}}


def test_bad_values_are_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError):
        _settings(["engines", "--router-policy", "nonsense"])
    with pytest.raises(ValidationError):
        _settings(["engines", "--num-engines", "-1"])
    bad = tmp_path / "typo.yaml"
    bad.write_text("engine:\n  num_engine: 2\n")
    with pytest.raises(ValidationError):
        load_settings(bad)
    with pytest.raises(ConfigError):
        load_settings(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError):
        load_settings(tmp_path / "list.yaml")
    monkeypatch.setenv("SLIME_ENGINE__NUM_ENGINES", "many")
    with pytest.raises(ValidationError):
        load_settings()


def test_cli_reports_bad_settings_as_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from slime_server.cli import main

    with pytest.raises(SystemExit) as e:
        main(["engines", "--router-policy", "nonsense"])
    assert e.value.code == 2
    assert "router.policy" in capsys.readouterr().err


def test_online_settings_from_flags_env_and_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The online preset's settings are a section of the tree like any other: one flag, env or YAML each."""
    from slime_server.online.preset import feedback_settings, online_job_spec

    cfg = tmp_path / "online.yaml"
    cfg.write_text("online:\n  enabled: true\n  judge_votes: 3\n  lr: 0.001\n")
    monkeypatch.setenv("SLIME_ONLINE__JUDGE_URL", "http://judge:8001/v1")
    s = _settings(["serve", "--config", str(cfg), "--opd-weight", "0", "--online-batch-size", "8"])
    o = s.online
    assert (o.enabled, o.judge_votes, o.lr, o.judge_url, o.opd_weight, o.batch_size) == (
        True, 3, 0.001, "http://judge:8001/v1", 0.0, 8)
    fb = feedback_settings(o)
    assert (fb.judge.base_url, fb.judge.votes, fb.judge.temperature, fb.opd) == ("http://judge:8001/v1", 3, 0.7, False)
    job = online_job_spec(o)
    assert job["loop"]["batch_size"] == 8 and job["loop"]["opd"] is None and job["optimizer"]["lr"] == 0.001
    assert _settings(["gateway", "--router-url", "u", "--model-path", "m", "--online"]).online.enabled
    with pytest.raises(ValidationError, match="excludes online.judge_url"):  # one judge only (the CLI: exit 2)
        _settings(["serve", "--online", "--judge-url", "http://j/v1", "--judge-engine-model", "tiny"])


def test_core_lists_for_the_engines_and_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.cpus / trainer.cpus take taskset's list syntax from flags and env, or a YAML list; a bad list is
    refused with the setting's name, before anything starts."""
    s = _settings(["serve", "--engine-cpus", "0", "--trainer-cpus", "1-3,5,3"])
    assert (s.engine.cpus, s.trainer.cpus) == ([0], [1, 2, 3, 5])
    assert load_settings().engine.cpus is None  # default: any core
    monkeypatch.setenv("SLIME_TRAINER__CPUS", "2-3")
    assert load_settings().trainer.cpus == [2, 3]
    assert load_settings(None, {"engine": {"cpus": [4, 0]}}).engine.cpus == [0, 4]
    for bad in ("3-1", "a", "0,,-1", ""):
        with pytest.raises(ValidationError, match="cpus"):
            _settings(["serve", "--engine-cpus", bad])


@pytest.mark.parametrize("command", ["gateway", "keys", "export"])
def test_a_command_imports_its_own_module_not_every_commands(command: str) -> None:
    """A run of one command builds its own parser only: the others' modules (serve's deployment, the demo's
    learning set-up) stay unimported; without a command every command is listed."""
    import subprocess
    import sys

    others = ["slime_server.server.serve_cmd", "slime_server.demo", "slime_server.server.launch",
              "slime_server.server.engines_cmd"]
    code = ("import sys; from slime_server.cli import build_parser; "
            f"p, cmds = build_parser({command!r}); print(sorted(cmds)); "
            f"print([m for m in {others!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == [str([command]), "[]"]
    assert sorted(build_parser()[1]) == sorted(SUBCOMMANDS)
