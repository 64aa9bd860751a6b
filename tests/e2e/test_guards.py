"""Silently wrong nowhere (issue 87): each guard seen to fire in a real run with its fault planted, and
the same run without the fault going through. Tiny model, one process (placement=local), hf engine."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.test_rl_recipes import ONE_RANK, local, metrics

FIXTURES = Path(__file__).parent / "fixtures"
GRPO = ["recipe=grpo", "trainer.export_hf=false", "trainer.val_every_steps=0", ONE_RANK]


def test_a_reward_without_signal_stops_the_run_and_one_with_signal_runs_on(tmp_path):
    """A constant reward: every advantage 0, gradient norm 0. The run says so at step 1 and stops at the
    limit with the reward named; the same run with a reward that varies in every group finishes."""
    flat = local([*GRPO, "trainer.total_steps=4", "trainer.max_steps_without_signal=2",
                  f"reward.fn={FIXTURES / 'constant_reward.py'}:score"], tmp_path, "flat")
    assert flat.returncode != 0
    out = flat.stdout + flat.stderr
    assert "NoSignalError" in out and "no learning signal for 2 step(s) in a row: every sample scored 0" in out, out[-3000:]
    assert "constant_reward.py:score" in out and "reward/answer_found = 0" in out
    assert [row["guard/steps_without_signal"] for row in metrics(tmp_path / "flat")] == [1.0, 2.0]
    varied = local([*GRPO, "trainer.total_steps=2", "trainer.max_steps_without_signal=1",
                    f"reward.fn={FIXTURES / 'varied_reward.py'}:score"], tmp_path, "varied")
    assert varied.returncode == 0, varied.stdout[-3000:] + varied.stderr[-3000:]
    assert [row["guard/steps_without_signal"] for row in metrics(tmp_path / "varied")] == [0.0, 0.0]
    assert "no learning signal" not in varied.stdout
    trained = [json.loads(line) for line in (tmp_path / "varied" / "trained_prompts.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == [1, 2]  # the training rows each step trained on, one per group
    assert all(len(t["prompt_index"]) == 4 == len(set(t["prompt_index"])) for t in trained), trained
    assert not set(trained[0]["prompt_index"]) & set(trained[1]["prompt_index"])  # an epoch draws each row once


def test_an_environment_that_fails_stops_the_run_named_and_a_call_the_model_got_wrong_does_not(tmp_path):
    """An agent rollout whose environment's server is gone (every step raises ConnectionError) stops
    after its first step with the agent, the error and the key named; the same run whose environment
    refuses every call as malformed (ValueError: the model's fault) trains on."""
    agents = FIXTURES / "failing_environments.py"
    agent_run = [*GRPO, "trainer.total_steps=1", "rollout.backend=vllm", "rollout.max_response_tokens=24",
                 "rollout.max_turns=2", "trainer.max_steps_without_signal=null",
                 f"reward.fn={FIXTURES / 'varied_reward.py'}:score"]
    gone = local([*agent_run, f"rollout.agent=[{agents}:Gone]"], tmp_path, "gone")
    assert gone.returncode != 0
    out = gone.stdout + gone.stderr
    assert "EnvironmentFailureError" in out and "failed on the environment's side (100.0%" in out, out[-3000:]
    assert "agent 'Gone': ConnectionError: environment server at 127.0.0.1:9 is gone" in out
    assert "rollout.max_env_failure_fraction=0.1" in out
    row, = metrics(tmp_path / "gone")
    assert row["agent/env_failure_fraction"] == 1.0 and row["agent/env_failures"] == row["agent/tool_errors"] > 0
    picky = local([*agent_run, f"rollout.agent=[{agents}:Picky]"], tmp_path, "picky")
    assert picky.returncode == 0, picky.stdout[-3000:] + picky.stderr[-3000:]
    row, = metrics(tmp_path / "picky")
    assert row["agent/tool_errors"] > 0 and row["agent/env_failures"] == 0 and row["agent/env_failure_fraction"] == 0


# The planted fault: SFT targets whose EOS is left out of the loss (a collator that masks pad = EOS)
MASK_EOS = """
import sys
sys.modules['ray'] = None
import hybridflow.data.answers as answers
encode = answers.encode_answers
def masked(answers_, tokenizer, max_response_tokens):
    batch = encode(answers_, tokenizer, max_response_tokens)
    batch.tensors['response_mask'] &= batch['response_ids'] != tokenizer.eos_token_id
    return batch
answers.encode_answers = masked
from hybridflow.cli import main
sys.exit(main())
"""


def test_sft_targets_whose_eos_is_not_trained_stop_the_run_at_its_first_step(tmp_path):
    """The fault planted into a real SFT run (EOS masked out of every target): the run stops at step 1
    naming the rows and the EOS id; the same run unplanted trains (test_sft_and_dpo_recipes)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run([sys.executable, "-c", MASK_EOS, "placement=local", "recipe=sft", "trainer.total_steps=2",
                          "trainer.val_every_steps=0", "trainer.export_hf=false", ONE_RANK,
                          f"logger.output_root={tmp_path}", "logger.run_name=eos"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert "UntrainedEOSError" in out and "SFT step 1: 64 of 64 targets (rows [0, 1, 2, 3, 4]) train no" in out, \
        out[-3000:]
    assert not (tmp_path / "eos" / "metrics.jsonl").exists() or not (tmp_path / "eos" / "metrics.jsonl").read_text()


# The planted fault: a level-2 reload that leaves one weight as the wake-up allocated it
SKIP_ONE_WEIGHT = """
import sys
sys.modules['ray'] = None
from hybridflow.resharding.receiver import ModuleReceiver
load = ModuleReceiver.load
def skipping(self, buckets, route):
    return load(self, ([(n, t) for n, t in bucket if n != 'model.norm.weight'] for bucket in buckets), route)
ModuleReceiver.load = skipping
from hybridflow.cli import main
sys.exit(main())
"""


def _level_2_run(tmp_path, name: str, script: str):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-c", script, "placement=local", *GRPO, "rollout.backend=hf",
                           "rollout.sleep_level=2", "trainer.total_steps=2", "trainer.prompts_per_step=4",
                           "rollout.samples_per_prompt=4", "rollout.max_response_tokens=4",
                           f"reward.fn={FIXTURES / 'varied_reward.py'}:score",
                           f"logger.output_root={tmp_path}", f"logger.run_name={name}"],
                          capture_output=True, text=True, timeout=600, env=env)


def test_a_weight_left_stale_by_a_level_2_reload_is_named_and_a_whole_reload_is_verified(tmp_path):
    """rollout.sleep_level=2 discards the engine's weights at every sleep; the load after it must rewrite
    every one. Planted: the load skips `model.norm.weight` — the checksums after the reload name it and
    stop the run. Unplanted, every step's reload is verified, tensor by tensor."""
    from tests.e2e.cli_in_one_process import WITHOUT_RAY

    stale = _level_2_run(tmp_path, "stale", SKIP_ONE_WEIGHT)
    assert stale.returncode != 0
    out = stale.stdout + stale.stderr
    assert "WeightSyncError" in out and "model.norm.weight" in out, out[-3000:]
    whole = _level_2_run(tmp_path, "whole", WITHOUT_RAY.read_text())
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    for row in metrics(tmp_path / "whole"):
        assert row["weight_sync/verified_tensors"] > 0 and row["weight_sync/reload_checksum_s"] > 0, row
