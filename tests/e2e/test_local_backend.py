"""The one-process backend for real (placement=local: the driver and every role in one process on one
device, hybridflow/controller/local.py), each run a `hybridflow` command of its own with Ray's import
blocked (`sys.modules["ray"] = None`), as on a machine without Ray: real vLLM on the CPU, a real FSDP2
actor over a gloo group of one, the colocated weight sync."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WITHOUT_RAY = "import sys; sys.modules['ray'] = None; from hybridflow.cli import main; sys.exit(main())"
SMALL = ["trainer.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_response_tokens=4",
         "trainer.val_prompts=8", "data.synthetic.train_rows=200", "data.synthetic.val_rows=16",
         "actor.samples_per_micro_batch=8"]


def without_ray(args: list[str], output_root: Path, run_name: str, timeout_s: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_RAY, "placement=local", *args,
                           f"logger.output_root={output_root}", f"logger.run_name={run_name}"],
                          capture_output=True, text=True, timeout=timeout_s)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_cli_every_recipe_and_every_worker_import_without_ray():
    modules = ["hybridflow.cli", "hybridflow.launch", "hybridflow.lifecycle", "hybridflow.runner", "hybridflow.faults",
               "hybridflow.controller.worker_group", "hybridflow.controller.pools", "hybridflow.controller.runtime",
               "hybridflow.resharding.sync", "recipes.ppo", "recipes.sft", "recipes.dpo", "recipes.pipeline",
               "recipes.pretrain", "recipes.evaluate", "recipes.demo", "recipes.roles", "workers.actor",
               "workers.critic", "workers.reference", "workers.reward", "workers.rollout.hf_rollout",
               "workers.rollout.vllm_rollout"]
    code = "import sys, importlib; sys.modules['ray'] = None\n" + "".join(
        f"importlib.import_module({m!r})\n" for m in modules) + "print('imported', len(sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-4000:]


def test_grpo_in_one_process_without_ray_learns_what_its_reward_asks_for(tmp_path):
    """tests/e2e/test_rl_recipes.py's learning run (the tiny model rewarded for the distinct characters
    of its answer) in one process: its mean reward rises within 10 steps, as under Ray."""
    reward = Path(__file__).parent / "fixtures" / "varied_reward.py"
    done = without_ray(["recipe=grpo", "trainer.total_steps=10", "actor.optim.lr=1e-3", f"reward.fn={reward}:score",
                        "trainer.export_hf=false", "trainer.val_every_steps=0", "trainer.save_every_steps=0"],
                       tmp_path, "learn")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = metrics(tmp_path / "learn")
    scores = [r["reward/score"] for r in rows]
    assert len(scores) == 10 and sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.25, scores
    for row in rows:  # the sampler's log-probs are the actor's; the one process's memory is read each step
        assert row["rollout/log_prob_diff"] < 1e-3 and row["memory/global_peak_gib"] > 0, row


@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (docs/results/ci_times.md)
def test_the_default_pipeline_runs_its_stages_in_one_process_without_ray(tmp_path):
    """SFT -> PMA merge -> GRPO, shortened, in one process: each stage frees its models before the
    next starts (the stages' engines and actors are built anew), and each reports its accuracy."""
    done = without_ray([*SMALL,  # a plain key reaches every stage that reads it
                        "stages.sft.trainer.total_steps=8", "stages.sft.trainer.save_every_steps=2",
                        "stages.grpo.trainer.total_steps=2", "stages.grpo.actor.samples_per_mini_batch=16"],
                       tmp_path, "pipe", timeout_s=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    run_dir = tmp_path / "pipe"
    stages = sorted(p.parent.name for p in run_dir.glob("*/STAGE_COMPLETE"))
    assert stages == ["00-sft", "01-grpo"], stages
    grpo = json.loads((run_dir / "01-grpo" / "STAGE_COMPLETE").read_text())
    assert grpo["final_accuracy"] is not None and grpo["init_accuracy"] is not None
