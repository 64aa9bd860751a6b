"""recipe=agent_pipeline for a few steps: SFT on calculator demonstrations -> GRPO with
multi-turn tool rollouts, through the same entry point as the command line."""

from __future__ import annotations

import pytest
import json

from hybridflow.config import compose
from hybridflow.tracking import read_metrics
from tests.e2e.test_rl_recipes import ONE_RANK

pytestmark = pytest.mark.usefixtures("shared_ray_head")  # its runs join one Ray head (tests/ray_head.py)

SMALL = ["trainer.prompts_per_step=4", "trainer.val_prompts=8", "data.synthetic.train_rows=200",
         "data.synthetic.val_rows=16", "actor.samples_per_micro_batch=8", ONE_RANK]


@pytest.mark.slow  # ~36 s; agent rollouts run end to end in test_agent_rollout.py
def test_agent_pipeline_runs_sft_then_grpo_with_the_calculator(tmp_path):
    import ray

    from hybridflow.cli import run

    config = compose(["recipe=agent_pipeline", f"logger.output_root={tmp_path}", "logger.run_name=agent"])
    config.pipeline.common_overrides += SMALL
    config.pipeline.stages[0].overrides += ["trainer.total_steps=3", "trainer.val_every_steps=3"]
    config.pipeline.stages[1].overrides += ["trainer.total_steps=2", "trainer.val_every_steps=2",
                                            "rollout.samples_per_prompt=2", "actor.samples_per_micro_batch=8"]
    try:
        run(config)
    finally:
        ray.shutdown()
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
