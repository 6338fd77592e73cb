"""Checkpoint save -> a FRESH process loads it -> the next steps are bit-identical on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._trainer_helpers import load_result, make_batch, run_ranks, write_inputs


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> dict[str, dict]:
    from transformers import AutoConfig

    from slime_server.trainer.actor import TrainerRankSettings
    from slime_server.trainer.settings import OptimizerSettings
    from slime_server.trainer.train_step import TrainStepSettings

    tmp = tmp_path_factory.mktemp("ckpt")
    vocab = AutoConfig.from_pretrained(tiny_model_path).vocab_size
    # Warmup + cosine decay so a scheduler that failed to restore would change the LR.
    settings = TrainerRankSettings(
        hf_path=str(tiny_model_path),
        optimizer=OptimizerSettings(lr=2e-3, lr_warmup_init=1e-4, lr_warmup_steps=2, lr_decay_steps=6,
                                    lr_decay_style="cosine", weight_decay=0.1),
        train=TrainStepSettings(max_tokens_per_micro_batch=80),
    )
    settings_path, batch_path = write_inputs(tmp, settings, make_batch(vocab_size=vocab, n=4, seed=5))
    common = ["--settings", str(settings_path), "--batch", str(batch_path)]
    ckpt = tmp / "ckpt" / "step_00000002"
    run_ranks(1, [*common, "--out", str(tmp / "straight.pt"), "--steps", "4",
                  "--save-at", "2", "--ckpt", str(ckpt)])
    run_ranks(1, [*common, "--out", str(tmp / "resumed.pt"), "--steps", "2", "--load", str(ckpt)])
    return {"straight": load_result(tmp / "straight.pt"), "resumed": load_result(tmp / "resumed.pt"),
            "ckpt": {"path": str(ckpt)}}


def test_resume_in_fresh_process_is_bit_identical(resume_runs: dict[str, dict]) -> None:
    straight, resumed = resume_runs["straight"], resume_runs["resumed"]
    assert resumed["resumed"] == {"step": 2, "policy_version": 2}
    for after, before in zip(resumed["metrics"], straight["metrics"][2:], strict=True):
        assert after["loss"] == before["loss"]
        assert after["lr"] == before["lr"]
        assert after["grad_norm"] == before["grad_norm"]
        assert after["masked_logprob_sum"] == before["masked_logprob_sum"]
        assert after["step"] == before["step"]
    assert straight["weights"].keys() == resumed["weights"].keys()
    for name, w in straight["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name


def test_schedule_and_training_actually_progressed(resume_runs: dict[str, dict]) -> None:
    lrs = [m["lr"] for m in resume_runs["straight"]["metrics"]]
    assert lrs[0] == pytest.approx(1e-4) and lrs[2] == pytest.approx(2e-3) and lrs[3] < lrs[2]
    logprob = [m["masked_logprob_sum"] for m in resume_runs["straight"]["metrics"]]
    assert len(set(logprob)) == len(logprob), "weights must change every step"


def test_checkpoint_directory_is_complete(resume_runs: dict[str, dict]) -> None:
    from slime_server.trainer.checkpoint import latest_checkpoint, read_meta

    path = Path(resume_runs["ckpt"]["path"])
    meta = read_meta(path)
    assert (meta.step, meta.policy_version, meta.world_size, meta.tp_size) == (2, 2, 1, 1)
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "portable.pt", "rank_00000.pt"]
    assert latest_checkpoint(path.parent) == path
    assert not path.with_name(path.name + ".tmp").exists()


def test_incomplete_checkpoint_is_rejected(tmp_path: Path) -> None:
    from slime_server.trainer.checkpoint import latest_checkpoint, read_meta

    broken = tmp_path / "step_00000009"
    broken.mkdir()
    (broken / "rank_00000.pt").write_bytes(b"partial")
    with pytest.raises(FileNotFoundError):
        read_meta(broken)
    assert latest_checkpoint(tmp_path) is None
