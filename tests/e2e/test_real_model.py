"""The real pretrained model (SmolLM2-135M-Instruct, tests/real_model.py) at the shapes users run:
chat prompts of ~46 tokens, hundreds of seeded requests in one engine call, 64-token answers.

These run the `hybridflow` command as a user would. On these 2-core machines without AVX-512 a
bfloat16 forward of this model is ~6x and a backward ~20x slower than float32 (docs/performance.md,
"Real model"), so the training runs here compute in float32 unless a test is about bfloat16."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.real_model import real_overrides

ROOT = Path(__file__).resolve().parents[2]
HYBRIDFLOW = str(Path(sys.executable).parent / "hybridflow")


def run_hybridflow(args: list[str], timeout_s: int = 900) -> subprocess.CompletedProcess:
    done = subprocess.run([HYBRIDFLOW, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # 135 s here; the same failure at the tiny model's cost: tests/e2e/test_vllm_rollout.py
def test_evaluate_samples_256_seeded_chat_requests_in_one_engine_call(tmp_path, real_model_dir, chat_addition):
    """recipe=evaluate with its default 8 samples per prompt: 32 prompts x 8 = 256 seeded requests of
    ~46 tokens in one engine call (11,800 prompt tokens, past vLLM's 4,096-token budget on the CPU).
    vLLM chunked the prefill and then crashed rewinding the seeded CPU generator ("CPU Generator does
    not use offset"); workers/rollout/vllm_rollout.py now never chunks a prefill on the CPU."""
    run_hybridflow([*real_overrides(real_model_dir, *chat_addition), "recipe=evaluate", "trainer.val_prompts=32",
                    "rollout.max_response_tokens=16", "placement.pools.global.devices_per_node=1",
                    f"logger.output_root={tmp_path}", "logger.run_name=eval"])
    row = metrics(tmp_path / "eval")[0]
    assert row["val/pass@1"] == pytest.approx(row["val/sampled_accuracy"])
    assert row["val/pass@1"] <= row["val/pass@8"]
    # the real model answers some of these right with 16 tokens, greedy and sampled (0.17 at 64 tokens)
    assert 0.0 < row["val/accuracy"] < 0.6 and 0.0 < row["val/pass@8"]


# 4 prompts x 4 samples of 64-token answers to ~46-token chat prompts, 2 training ranks, float32
# (see the module docstring); the update runs one micro-batch of 8 rows per rank.
REAL_RL = ["trainer.prompts_per_step=4", "rollout.samples_per_prompt=4", "trainer.val_prompts=16",
           "actor.samples_per_micro_batch=8", "critic.samples_per_micro_batch=8", "actor.optim.lr=1e-5",
           "model.dtype=float32", "rollout.dtype=float32", "trainer.export_hf=false"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_rl_on_the_real_model_reports_memory_and_parity(tmp_path, real_model_dir, chat_addition, recipe):
    extra = ["trainer.total_steps=2"] + (["algorithm=ppo"] if recipe == "ppo" else [])
    run_hybridflow([*real_overrides(real_model_dir, *chat_addition), f"recipe={recipe}", *REAL_RL, *extra,
                    f"logger.output_root={tmp_path}", "logger.run_name=run"], timeout_s=1500)
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # the model (134.5M float32 parameters: 0.54 GB) is held several times over by each process
        assert 1.0 < row["memory/global_peak_gib"] < 20.0 and row["memory/global_rss_gib"] <= row["memory/global_peak_gib"]
        assert row["weight_sync/probe_log_prob_gap_mean"] < 1e-3  # float32 on both sides: same weights, same model
    assert rows[0]["rollout/log_prob_diff"] < 1e-3 and rows[0]["response/length_mean"] > 8


@pytest.mark.slow
def test_grpo_in_bfloat16_on_the_real_model_passes_the_parity_checks(tmp_path, real_model_dir, chat_addition):
    """The model's own bfloat16 compute (float32 masters) against a float32 engine: the same weights
    pass the probe and the first-batch check at 30 layers; the first sync's probe stopped here before
    (a 0.119 worst-token gap against a 0.1 tolerance). 2 prompts x 2 samples of 16 tokens: a bfloat16
    backward is ~20x slower than float32 on these CPUs."""
    run_hybridflow([*real_overrides(real_model_dir, *chat_addition), "recipe=grpo", "trainer.total_steps=1",
                    "trainer.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_response_tokens=16",
                    "trainer.val_every_steps=0", "trainer.export_hf=false", "actor.samples_per_micro_batch=2",
                    "weight_sync.checksum_every_steps=1", f"logger.output_root={tmp_path}", "logger.run_name=bf16"],
                   timeout_s=1500)
    row = metrics(tmp_path / "bf16")[0]
    assert 1e-4 < row["weight_sync/probe_log_prob_gap_mean"] < 0.06  # rounding, within the 30-layer tolerance
    assert row["weight_sync/verified_tensors"] > 0 and row["rollout/log_prob_diff"] < 0.06
