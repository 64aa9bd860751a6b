"""A pipeline honours each stage's own trainer.max_restarts: an actor rank killed in the GRPO stage
is restarted from that stage's last checkpoint, the pipeline finishes, and the stage's metrics match
an uninterrupted pipeline's. Both runs go through the `hybridflow` command, with the stage-scoped
overrides (`stages.grpo.<key>=...`) that put the fault and the restarts in the GRPO stage only
(tests/unit/test_pipeline_overrides.py: a stage-scoped key reaches that stage only). The SFT stage is
the same in both: the faulted pipeline starts in a run directory holding the uninterrupted one's
finished SFT stage and skips it, as a re-run pipeline does (one whole-stack start less: CI's time)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.e2e import cli_in_one_process
from tests.e2e.test_rl_recipes import ONE_RANK

pytestmark = pytest.mark.usefixtures("shared_ray_head")  # its runs join one Ray head (tests/ray_head.py)

PIPELINE = ["trainer.prompts_per_step=4", "rollout.max_response_tokens=4", "trainer.val_prompts=8",
            "data.synthetic.train_rows=200", "data.synthetic.val_rows=16", "actor.samples_per_micro_batch=8",
            "actor.samples_per_mini_batch=0", "trainer.save_every_steps=1", "trainer.val_every_steps=0",
            "stages.sft.trainer.total_steps=4", "stages.grpo.trainer.total_steps=3",
            "stages.grpo.rollout.samples_per_prompt=4",
            # no held-out evaluation of the merged start (its own whole-stack start: tests/e2e/test_pipeline.py has it)
            "pipeline.stages.1.evaluate_init=false",
            ONE_RANK]  # the claim is the stage's restart, not its ranks: one process less per start
FAULT = ["stages.grpo.trainer.max_restarts=1", "stages.grpo.trainer.fault_injection=[{kind:kill,role:actor,rank:0,step:2}]"]
COMPARED = ["reward/score", "actor/loss", "actor/grad_norm", "actor/entropy", "response/length_mean"]


def pipeline(args: list[str], root: Path, name: str) -> tuple[dict[int, dict], str]:
    """The GRPO stage's metrics by step, and what the command printed."""
    done = cli_in_one_process.run([*PIPELINE, *args, f"logger.output_root={root}", f"logger.run_name={name}"])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "pipeline: stage grpo gets" in done.stdout
    lines = (root / name / "01-grpo" / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}, done.stdout


@pytest.mark.slow  # a short pipeline, then its GRPO stage again with the fault
def test_a_rank_killed_in_the_grpo_stage_restarts_that_stage_and_the_pipeline_finishes(tmp_path):
    straight, _ = pipeline([], tmp_path, "straight")
    shutil.copytree(tmp_path / "straight" / "00-sft", tmp_path / "restarted" / "00-sft")
    restarted, printed = pipeline([*FAULT, "trainer.resume=true"], tmp_path, "restarted")
    assert "pipeline: stage sft already complete, skipping" in printed
    restarts = (tmp_path / "restarted" / "01-grpo" / "restarts.jsonl").read_text().splitlines()
    restart = json.loads(restarts[0])
    assert len(restarts) == 1 and restart["step"] == 2 and "died" in restart["message"]
    # the GRPO stage restarted on its own: the finished stage before it was not run again
    assert not (tmp_path / "restarted" / "00-sft" / "restarts.jsonl").exists()
    assert ((tmp_path / "restarted" / "00-sft" / "metrics.jsonl").read_text()
            == (tmp_path / "straight" / "00-sft" / "metrics.jsonl").read_text())
    assert restarted[3]["trainer/restarts"] == 1
    for step in (2, 3):
        for key in COMPARED:
            assert restarted[step][key] == pytest.approx(straight[step][key], rel=1e-5, abs=1e-6), (step, key)
    assert (tmp_path / "restarted" / "report.md").is_file()
