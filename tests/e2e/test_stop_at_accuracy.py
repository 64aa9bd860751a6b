"""trainer.stop_at_val_accuracy: a stage that hands its model on at a skill level, not at a step count
(recipe=agent_pipeline's SFT stage; issue 87). One process, the tiny model."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.test_rl_recipes import ONE_RANK, local, metrics

VARIED = Path(__file__).parent / "fixtures" / "varied_reward.py"  # val/accuracy: its mean score, above 0


def test_sft_ends_at_the_first_validation_that_reaches_the_target_with_that_steps_model(tmp_path):
    run = local(["recipe=sft", "trainer.total_steps=6", "trainer.val_every_steps=2", "trainer.stop_at_val_accuracy=0.01",
                 f"reward.fn={VARIED}:score", ONE_RANK], tmp_path, "sft")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = metrics(tmp_path / "sft")
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["val/accuracy"] >= 0.01
    assert "reached trainer.stop_at_val_accuracy=0.01; the run ends here" in run.stdout
    assert (tmp_path / "sft" / "final_model" / "config.json").exists()


def test_grpo_runs_its_steps_when_the_target_is_not_reached(tmp_path):
    run = local(["recipe=grpo", "trainer.total_steps=2", "trainer.val_every_steps=1", "trainer.stop_at_val_accuracy=1.0",
                 "trainer.export_hf=false", f"reward.fn={VARIED}:score", ONE_RANK], tmp_path, "grpo")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "grpo")] == [1, 2]
    assert "the run ends here" not in run.stdout
