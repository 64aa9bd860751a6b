"""recipe=agent_pipeline for a few steps: SFT on calculator demonstrations -> GRPO with
multi-turn tool rollouts, through the `hybridflow` command in one process without Ray
(placement=local, Ray's import blocked: tests/e2e/cli_in_one_process.py `without_ray`)."""

from __future__ import annotations

import json

import pytest

from hybridflow.output.tracking import read_metrics
from hybridflow.precision import native_bfloat16
from tests.e2e.cli_in_one_process import without_ray

# the smaller data for every stage; each stage's length (its batch sizes are the recipe's own)
SMALL = ["trainer.val_prompts=8", "data.synthetic.train_rows=200", "data.synthetic.val_rows=16",
         "stages.sft.trainer.total_steps=3", "stages.sft.trainer.val_every_steps=3",
         "stages.grpo.trainer.total_steps=2", "stages.grpo.trainer.val_every_steps=2",
         "stages.grpo.rollout.samples_per_prompt=2", "stages.grpo.actor.samples_per_micro_batch=8"]


@pytest.mark.slow  # ~36 s; agent rollouts run end to end in test_agent_rollout.py
def test_agent_pipeline_runs_sft_then_grpo_with_the_calculator(tmp_path):
    done = without_ray(["recipe=agent_pipeline", *SMALL], tmp_path, "agent")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    run_dir = tmp_path / "agent"
    sft, grpo = (json.loads((run_dir / d / "STAGE_COMPLETE").read_text()) for d in ("00-sft", "01-grpo"))
    assert sft["final_accuracy"] is not None and grpo["final_accuracy"] is not None
    rows = read_metrics(run_dir / "01-grpo")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("agent/turns_mean", "agent/tool_errors", "agent/truncated", "reward/accuracy", "actor/loss",
                "val/agent/turns_mean"):
        assert key in rows[-1], f"{key} missing from the GRPO metrics"
    assert rows[0]["rollout/log_prob_diff"] < 1e-3  # sampler and actor agree on the model's tokens
    sft_rows = read_metrics(run_dir / "00-sft")
    assert "val/agent/turns_mean" in sft_rows[-1]  # SFT validates with the tool too


@pytest.mark.slow  # the recipe as documented, GRPO cut to 25 steps: 1.5-5 minutes on 2 cores
@pytest.mark.skipif(not native_bfloat16("cpu")[0], reason=(
    "known failure, issue 87 item 0: on a 2-core EPYC with AVX2 only (2026-12-07) the SFT stage was at 0.11 held-out "
    "at step 1074 when the 600 s timeout stopped it, far past the 75-825 steps to 0.3 on CPUs with bfloat16 "
    "instructions: the hand-off point moves with the CPU's arithmetic, the fragility that issue names"))
def test_agent_pipeline_learns_its_sft_stage_to_the_target_and_grpo_keeps_it(tmp_path):
    """The shortened twin of docs/results/learning.md's agent pipeline (issue 87): its SFT stage, from
    0.000, hands on a model at 0.3 held-out or more (trainer.stop_at_val_accuracy) wherever the CPU's
    arithmetic puts that step (75 to 825 on the documented seeds), and GRPO's first 25 steps keep it
    there (0.370, 0.753, 0.827 on seeds 0-2). GRPO's own gain needs hundreds of steps: bench only."""
    done = without_ray(["recipe=agent_pipeline", "stages.grpo.trainer.total_steps=25"], tmp_path, "agent",
                       timeout_s=1500)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    run_dir = tmp_path / "agent"
    sft, grpo = (json.loads((run_dir / d / "STAGE_COMPLETE").read_text()) for d in ("00-sft", "01-grpo"))
    assert read_metrics(run_dir / "00-sft")[0]["step"] == 1 and sft["final_accuracy"] >= 0.3, sft
    assert "reached trainer.stop_at_val_accuracy=0.3" in done.stdout
    assert grpo["final_accuracy"] >= 0.3, (sft, grpo)
