"""An OpenEnv environment (openenv-core 0.3.0's own classes: tests/e2e/fixtures/openenv_counting.py)
served on loopback by openenv's own app, started and stopped by the run, driving a GRPO run's multi-turn
rollouts on the tiny model (issue 85 items 2 and 5). One process (placement=local), real vLLM.

- the run trains a few steps; what it trains on is what the engine sampled (the rollout's batch and
  vLLM's own outputs recorded by a planted wrapper, compared id for id), the observations encoded once;
- its server's log is in the run directory and its process is gone when the run ends;
- the planted faults (a step that raises inside the environment; a server that dies mid-run) are
  counted by kind (`env/errors/<kind>`), and stop the run with the server's log in the message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_agent_rollout import _segments as runs  # (is model, start, end) runs of a loss mask
from tests.e2e.test_rl_recipes import ONE_RANK, SMALL, metrics

FIXTURES = Path(__file__).parent / "fixtures"
ENV_FILE = FIXTURES / "openenv_counting.py"
STOP = "[" + ",".join("abcdefghijklmnopqrstuvwxyz0123456789") + "]"  # a turn ends at almost any character
RUN = ["recipe=grpo", "trainer.export_hf=false", "trainer.val_every_steps=0", ONE_RANK, "rollout.backend=vllm",
       "rollout.max_response_tokens=24", "rollout.max_turns=2", "trainer.max_steps_without_signal=null",
       f"rollout.openenv.stop={STOP}", f"reward.fn={FIXTURES / 'agent_reward.py'}:score"]

# `hybridflow placement=local` with Ray's import blocked (tests/e2e/cli_in_one_process.py), and the rollout
# recording what vLLM sampled for every request and what the rollout handed on to be trained
RECORDING = """
import functools, json, os, sys
sys.modules['ray'] = None
from workers.rollout.vllm_rollout import VLLMRollout
start, trajectories = VLLMRollout.start, VLLMRollout._generate_trajectories
RECORD = open(os.environ['OPENENV_TEST_RECORD'], 'a')

@functools.wraps(start)  # its registration for the controller with it
def recording_start(self):
    seconds = start(self)
    generate = self.engine.generate
    def recorded(prompts, params, **kwargs):
        outputs = generate(prompts, params, **kwargs)
        for p, o in zip(prompts, outputs):
            RECORD.write(json.dumps({'sampled': [list(p['prompt_token_ids']), list(o.outputs[0].token_ids)]}) + '\\n')
        return outputs
    self.engine.generate = recorded
    return seconds

def recording_trajectories(self, prompts, seeds, greedy):
    batch = trajectories(self, prompts, seeds, greedy)
    for i in range(len(batch)):
        n = int(batch['response_mask'][i].sum())
        RECORD.write(json.dumps({'trained': [batch['prompt_ids'][i][batch['prompt_mask'][i]].tolist(),
                                             batch['response_ids'][i, :n].tolist(), batch['loss_mask'][i, :n].tolist()],
                                 'trajectory': batch.objects['trajectory'][i]}) + '\\n')
    RECORD.flush()
    return batch

VLLMRollout.start, VLLMRollout._generate_trajectories = recording_start, recording_trajectories
from hybridflow.cli import main
sys.exit(main())
"""


def run(args: list[str], output_root: Path, name: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    record = output_root / f"{name}.record.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OPENENV_TEST_RECORD"] = str(record)
    done = subprocess.run([sys.executable, "-c", RECORDING, "placement=local", *SMALL, *args,
                           f"logger.output_root={output_root}", f"logger.run_name={name}"],
                          capture_output=True, text=True, timeout=600, env=env)
    lines = record.read_text().splitlines() if record.exists() else []
    return done, [json.loads(line) for line in lines]


def server_gone(run_dir: Path) -> dict:
    """The run's record of its server, after checking its process no longer exists."""
    served = json.loads((run_dir / "openenv_server.json").read_text())
    try:
        os.kill(served["pid"], 0)
    except ProcessLookupError:
        return served
    raise AssertionError(f"the OpenEnv server (pid {served['pid']}) outlived its run")


def test_an_openenv_environment_trains_token_faithfully_and_its_server_ends_with_the_run(tmp_path):
    done, record = run([*RUN, "trainer.total_steps=2", f"rollout.agent=openenv:{ENV_FILE}:Counting"], tmp_path,
                       "counting")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "counting"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["agent/env_failures"] == 0 and r["agent/turns_mean"] > 1 for r in rows), rows
    assert any(r["reward/score"] > 0 for r in rows)  # the environment's rewards reached the reward function
    assert rows[0]["rollout/log_prob_diff"] < 1e-3  # sampler and actor agree on the model's tokens
    served = server_gone(run_dir)
    assert served["url"].startswith("http://127.0.0.1:")
    log = (run_dir / "openenv_server.log").read_text()
    assert "Uvicorn running on http://127.0.0.1" in log and "WebSocket /ws" in log and "Traceback" not in log, log
    # token in, token out: every model run of a trained trajectory is what vLLM sampled for the trajectory so far
    sampled = {json.dumps(r["sampled"]) for r in record if "sampled" in r}
    trained = [r for r in record if "trained" in r]
    assert len(trained) == 2 * 16 + 8, len(trained)  # two steps' rollouts and the final validation's
    observations = 0
    for r in trained:
        prompt, response, mask = r["trained"]
        for is_model, start, end in runs(mask):
            if is_model:
                assert json.dumps([prompt + response[:start], response[start:end]]) in sampled
            else:
                observations += 1
    assert observations >= 16  # the first observation ("go:") and the environment's answers, never trained
    assert all(r["trajectory"].startswith("go:") for r in trained)


@pytest.mark.slow  # a planted failure, ~30 s (the default tier's 16 minutes were full)
def test_an_environment_step_that_raises_is_counted_by_kind_and_stops_the_run_with_its_traceback(tmp_path):
    done, _ = run([*RUN, "trainer.total_steps=2", f"rollout.agent=openenv:{ENV_FILE}:Raising"], tmp_path, "raising")
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "EnvironmentFailureError" in out and "failed on the environment's side (100.0%" in out, out[-4000:]
    assert "agent 'openenv': OpenEnvFailure: the server answered EXECUTION_ERROR: planted" in out, out[-4000:]
    assert "its log (" in out and "RuntimeError: planted: the environment's step is broken" in out  # its traceback
    row, = metrics(tmp_path / "raising")
    assert row["env/errors/exception"] == row["agent/env_failures"] > 0 and row["agent/env_failure_fraction"] == 1.0
    server_gone(tmp_path / "raising")


@pytest.mark.slow  # a planted failure, ~30 s (the default tier's 16 minutes were full)
def test_a_server_that_dies_mid_run_is_counted_and_stops_the_run_naming_it(tmp_path):
    done, _ = run([*RUN, "trainer.total_steps=2", f"rollout.agent=openenv:{ENV_FILE}:Dying"], tmp_path, "dying")
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "EnvironmentFailureError" in out and "the server is unreachable or gone" in out, out[-4000:]
    assert "exited with status -9" in out and "planted: the server kills itself" in out, out[-4000:]
    row, = metrics(tmp_path / "dying")
    assert row["env/errors/connection"] == row["agent/env_failures"] > 0
    server_gone(tmp_path / "dying")
