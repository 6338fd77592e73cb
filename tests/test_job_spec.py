"""Job specs ask only for what the trainer does (issue 19): what is not implemented is a clear error at
submit, and the defaults that matter (off-policy correction for asynchronous jobs) are stated."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from slime_server.jobs.spec import JobSpec


def test_ppo_trains_a_critic_with_gae() -> None:
    spec = JobSpec(algorithm="ppo", critic={"optimizer": {"lr": 2e-5}, "value_clip": 0.5},
                   loop={"advantage": {"lam": 0.9}})  # groups of one: the critic is the baseline
    assert spec.estimator() == "gae" and spec.loop_settings().advantage.estimator == "gae"
    assert spec.loss_config()["loss_type"] == "ppo" and spec.critic.optimizer.lr == 2e-5
    with pytest.raises(pydantic.ValidationError):
        JobSpec(algorithm="ppo", critic={"value_clip": -1})


def test_kl_reward_shaping_only_where_the_estimator_uses_it() -> None:
    with pytest.raises(pydantic.ValidationError, match="use loss.kl_coef"):
        JobSpec(algorithm="grpo", loop={"n_samples_per_prompt": 2, "advantage": {"kl_coef": 0.1}})
    spec = JobSpec(algorithm="reinforce_plus_plus", loop={"advantage": {"kl_coef": 0.1}})
    assert spec.needs_reference()


def test_off_policy_correction_is_on_for_asynchronous_jobs_only() -> None:
    assert JobSpec().loss_config()["use_tis"] is True
    assert JobSpec(loop={"sync": True}).loss_config()["use_tis"] is False
    assert JobSpec(loss={"use_tis": False}).loss_config()["use_tis"] is False  # an explicit choice wins
    assert JobSpec(loss={"tis_mode": "mask", "tis_level": "geometric"}).loss_config()["tis_mode"] == "mask"
    with pytest.raises(pydantic.ValidationError):
        JobSpec(loss={"tis_level": "per-word"})


def test_a_kl_loss_keeps_a_reference_model() -> None:
    assert not JobSpec().needs_reference()
    assert JobSpec(loss={"kl_coef": 0.001}).needs_reference()
    with pytest.raises(pydantic.ValidationError):
        JobSpec(loss={"kl_type": "k9"})


def test_the_objective_is_a_choice_apart_from_the_estimator() -> None:
    spec = JobSpec(algorithm="grpo", loop={"n_samples_per_prompt": 4,
                                           "advantage": {"overlong_max_len": 512, "overlong_cache_len": 128}},
                   loss={"loss_type": "cispo", "eps_clip_high": 0.28})
    assert spec.estimator() == "grpo" and spec.loss_config()["loss_type"] == "cispo"
    assert spec.loop_settings().advantage.overlong_max_len == 512


def test_the_example_job_configs_are_valid_specs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every example validates as written, run from the repository root (their data paths are relative to it);
    the replay example's export is what ``slime-server export`` would have written there."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    examples = {p.stem: p for p in (root / "examples").glob("*.yaml")}
    assert {"grpo_calculator", "sft", "rejection_sampling", "rollout_only", "replay", "online"} <= set(examples)
    monkeypatch.chdir(root)
    for name, path in sorted(examples.items()):
        body = yaml.safe_load(path.read_text())
        if name == "replay":
            assert body["data"]["dataset"] == "trajectories.jsonl"
            (tmp_path / "trajectories.jsonl").write_text("")
            body["data"]["dataset"] = str(tmp_path / "trajectories.jsonl")
        spec = JobSpec.model_validate(body)
        assert name != "sft" or Path(spec.data.dataset or "").is_file()


def test_a_named_reference_or_critic_start_must_be_a_checkpoint_the_job_uses(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    spec = JobSpec.model_validate({"reference_model": str(ckpt), "loss": {"kl_coef": 0.01}})
    assert spec.needs_reference() and spec.reference_model == str(ckpt)
    JobSpec.model_validate({"algorithm": "ppo", "critic": {"init_from": str(ckpt)}})
    for body, message in [
        ({"reference_model": str(tmp_path), "loss": {"kl_coef": 0.01}}, "no config.json"),
        ({"reference_model": str(ckpt)}, "set loss.kl_coef"),
        ({"critic": {"init_from": str(ckpt)}}, "critic.init_from is for algorithm 'ppo'"),
    ]:
        with pytest.raises(pydantic.ValidationError, match=message):
            JobSpec.model_validate(body)


def test_a_data_field_its_source_never_reads_is_refused_by_name(tmp_path: Path) -> None:
    """Set to other than its default, a data field the job's source does not read is a 400 naming it, not ignored;
    a whole spec sent back (every field at its default, as GET /jobs shows it) is still accepted."""
    conv = tmp_path / "c.jsonl"
    conv.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    refused = [
        ({"source": "live", "temperature": 0.5, "environment": "calculator"},
         "data.environment is for data.source 'dataset' or 'verifiers'; data.temperature is for"),
        ({"source": "dataset", "environment": "calculator", "input_key": "prompt"}, "data.input_key"),
        ({"source": "dataset", "environment": "calculator", "epochs": 2}, "with train false"),
        ({"source": "conversations", "dataset": str(conv), "max_tokens": 9}, "data.max_tokens"),
        ({"source": "replay", "dataset": str(conv), "system_prompt": "be brief"}, "data.system_prompt"),
        ({"source": "replay", "dataset": str(conv), "epochs": 3}, "data.epochs"),
    ]
    refused.append(({"source": "dataset", "environment": "calculator", "dataset": str(conv), "seed": 3},
                    "a dataset file's rows are played in their order"))
    for data, named in refused:
        algorithm = "sft" if data["source"] == "conversations" else "reinforce_plus_plus"
        with pytest.raises(ValueError, match=named):
            JobSpec.model_validate({"algorithm": algorithm, "data": data})
    JobSpec.model_validate({"train": False, "data": {"source": "dataset", "environment": "calculator", "epochs": 2}})
    JobSpec.model_validate({"algorithm": "sft", "data": {"source": "conversations", "dataset": str(conv), "epochs": 2,
                                                         "input_key": "messages", "system_prompt": "be brief"}})
    whole = JobSpec.model_validate({"data": {"source": "live"}}).model_dump(mode="json")
    assert JobSpec.model_validate(whole).data.source == "live"
