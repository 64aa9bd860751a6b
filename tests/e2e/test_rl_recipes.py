"""GRPO and PPO end to end on the tiny model: real vLLM on the CPU, a real FSDP2 actor; the assertions
read what the recipe itself wrote: metrics.jsonl, checkpoints and the final Hugging Face model.

The default tier's runs, whose claims are the recipes' (they learn, their metrics, the hf engine's
parity), run in one process without Ray (`placement=local`, a command of its own with Ray's import
blocked: `local` below, tests/e2e/cli_in_one_process.py `without_ray`; docs/results/ci_times.md has
what that saved). The slow tier's runs are on Ray, joining the tests' head: the reward file, dynamic
sampling and math-verify runs through the `hybridflow` command's code in this process (`hybridflow`
below; their reward functions run in a worker process, and there a one-process command of its own
saved nothing), the runs whose claims are about processes and ranks (a killed rank, a hung rollout,
the console of a run and its workers' logs) as a command of its own.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e import cli_in_one_process

# the runs on Ray join one Ray head (tests/ray_head.py); the one-process runs start none
ON_RAY = pytest.mark.usefixtures("shared_ray_head")
VENV_BIN = Path(sys.executable).parent
SMALL = ["trainer.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_response_tokens=4",
         "trainer.val_prompts=8", "data.synthetic.train_rows=200", "data.synthetic.val_rows=16",
         "actor.samples_per_micro_batch=8", "critic.samples_per_micro_batch=8"]
# One training and generating rank, for a run whose claim is not about ranks: a second rank's process
# (its torch, vLLM and engine start) is a third of a tiny run's CPU time (46 against 71 core-seconds on a
# 2-core EPYC), CI's time (tests/budget.py). Runs about sharding, TP or ranks keep the default two.
ONE_RANK = "placement.pools.global.devices_per_node=1"
STEP_KEYS = ["reward/score", "reward/accuracy", "actor/entropy", "clip_fraction", "response/length_mean",
             "perf/tokens_per_s", "timing/weight_sync_s", "weight_sync/seconds", "rollout/log_prob_diff",
             "timing/generate_s", "timing/update_s"]
MISMATCH = [f"rollout_mismatch/{k}" for k in ("abs_diff_mean", "abs_diff_max", "outside_band_fraction", "k1_kl",
                                              "k3_kl", "seq_log_ratio_mean", "seq_log_ratio_abs_max")]
REWARD_FILE = '''
def score(response, ground_truth, data_source):
    """Exact match, plus extras: the response length in characters, and a score that varies within
    every group (distinct characters), so the untrained model's update has a gradient."""
    correct = float(response.strip() == ground_truth)
    return {"score": correct + len(set(response)) / 8.0, "accuracy": correct, "chars": float(len(response))}
'''


def hybridflow(args: list[str], output_root: Path, run_name: str) -> subprocess.CompletedProcess:
    """`hybridflow` with the tiny shapes, run in this process (tests/e2e/cli_in_one_process.py: the
    command's code path without a fresh interpreter's imports, CI's time, tests/budget.py)."""
    return cli_in_one_process.run([*args, *SMALL, f"logger.output_root={output_root}", f"logger.run_name={run_name}"])


def local(args: list[str], output_root: Path, run_name: str) -> subprocess.CompletedProcess:
    """`hybridflow placement=local` with the tiny shapes: one process, Ray's import blocked."""
    return cli_in_one_process.without_ray([*args, *SMALL], output_root, run_name)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def kill_once_checkpointed(args: list[str], output_root: Path, run_name: str, step: int) -> None:
    """Start the run and SIGKILL it (the driver's whole process group: driver, Ray, workers) as soon
    as its step-`step` checkpoint is complete."""
    cmd = [str(VENV_BIN / "hybridflow"), *args, *SMALL, f"logger.output_root={output_root}", f"logger.run_name={run_name}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    marker = output_root / run_name / "checkpoints" / f"step_{step:08d}" / "COMPLETE"
    deadline = time.monotonic() + 400
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), f"the run never wrote its step-{step} checkpoint"
    time.sleep(2)  # let the killed run's Ray processes notice their driver is gone


@ON_RAY
@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_grpo_with_a_reward_function_from_a_file(tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(REWARD_FILE)
    # clipping against the sampler over four mini-batches: the engine-parity gap (rollout/log_prob_diff)
    # is the first mini-batch's, before the update moved the weights; averaged over all four it was
    # 0.17 here and stopped the run as an engine mismatch
    result = hybridflow(["recipe=grpo", "trainer.total_steps=2", f"reward.fn={reward_file}:score",
                         "weight_sync.checksum_every_steps=1", "trainer.save_every_steps=2",
                         "trainer.old_log_probs=sampler", "actor.samples_per_mini_batch=4", "actor.optim.lr=1e-3", ONE_RANK],
                        tmp_path, "grpo")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    run_dir = tmp_path / "grpo"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for key in STEP_KEYS + ["reward/chars", "weight_sync/verified_tensors"]:
        assert key in rows[0], f"{key} missing from step metrics"
    assert rows[0]["reward/chars"] > 0  # the custom function's extra, logged by the recipe
    assert rows[0]["actor/trained_sample_fraction"] > 0.5  # the varying score gives most groups a gradient
    assert rows[0]["actor/log_prob_diff_from_old"] > 0.01  # the later mini-batches saw moved weights
    assert rows[0]["rollout/log_prob_diff"] < 1e-3  # sampler and actor agree on the same weights
    assert "log_prob_diff_before_update" not in rows[0]  # read into rollout/log_prob_diff, not logged twice
    assert "val/accuracy" in rows[-1]
    assert (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_dir / "final_model")


DIGIT_FIRST = '''
def score(response, ground_truth):
    """Accuracy: whether the answer starts with a digit (the untrained model's groups sometimes all
    agree); the score is the same for every sample, so only a filter that reads the accuracy keeps a group."""
    return {"score": 1.0, "accuracy": float(response[:1].isdigit())}
'''


@ON_RAY
@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_grpo_with_dynamic_sampling_trains_full_batches_of_groups_with_a_signal(tmp_path):
    """DAPO's dynamic sampling end to end, filtering on accuracy (verl's DAPO recipe): each step trains
    prompts_per_step groups; the reward's score never varies, so every group kept was kept for its
    accuracy; the refill ran; the overlong shaping lowers the reward as DAPO's eq. 13 bounds it."""
    reward_file = tmp_path / "digit_first.py"
    reward_file.write_text(DIGIT_FIRST)
    result = hybridflow(["recipe=grpo", "trainer.total_steps=4", f"reward.fn={reward_file}:score",
                         "algorithm.dynamic_sampling_rounds=3", "algorithm.dynamic_sampling_on_limit=top_up",
                         "algorithm.overlong_buffer_tokens=2", "trainer.val_every_steps=0", "trainer.export_hf=false",
                         ONE_RANK], tmp_path, "dapo")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = metrics(tmp_path / "dapo")
    assert len(rows) == 4
    for r in rows:
        assert r["dynamic_sampling/informative_groups"] + r["dynamic_sampling/short_groups"] == 4  # full batches
        assert r["dynamic_sampling/generated_groups"] == 4 * (1 + r["dynamic_sampling/rounds"])
        # limit 4, buffer 2: a response of L tokens loses max(0, L - 2) / 2, so by Jensen the mean penalty
        # lies between -length_mean / 4 and -max(0, length_mean - 2) / 2
        length, penalty = r["response/length_mean"], r["reward/overlong_penalty"]
        assert -length / 4 - 1e-6 <= penalty <= -max(0.0, length - 2) / 2 + 1e-6, r
    assert sum(r["dynamic_sampling/informative_groups"] for r in rows) > 0  # kept for accuracy: the score is flat
    assert sum(r["dynamic_sampling/rounds"] for r in rows) > 0 and sum(r["dynamic_sampling/dropped_groups"] for r in rows) > 0


@ON_RAY
@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_grpo_with_reward_fn_math_verify_scores_every_batch_in_the_reward_roles_threads(tmp_path):
    """math-verify's own timeout (signal.alarm) raised in the role's threads on every sample, so a run with
    reward.fn=math_verify stopped at its first batch (reward.on_error=raise, the default); now it scores."""
    result = hybridflow(["recipe=grpo", "trainer.total_steps=2", "reward.fn=math_verify", "trainer.val_every_steps=0",
                         "trainer.export_hf=false", ONE_RANK], tmp_path, "math")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = metrics(tmp_path / "math")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the function's own extras, from every sample: no fallback
        assert 0 <= r["reward/answer_found"] <= 1 and r["reward/fallback_count"] == 0, r
        assert 0 <= r["reward/truncated"] <= 1 and r["reward/accuracy"] <= r["reward/answer_found"], r


def test_grpo_with_the_hf_engine_samples_what_the_actor_computes(tmp_path):
    """The `hf` engine (its own KV-cached decode loop, workers/rollout/hf_rollout.py) through GRPO steps
    in one process (placement=local): its sampler log-probs are the actor's on the same weights, and the
    weight probe passes. It sleeps at level 2 (rollout.sleep_level=null: every sync rewrites every weight),
    discarding its weights while the actor trains, so the sync's probe waits for the next generation
    (the KV cache sleeps until then), and a step that follows a validation's generation has its weights
    sent again (`weight_sync/reload_s`) with its rotary buffers found as at start: the samples of those
    steps are still the actor's."""
    result = local(["recipe=grpo", "rollout.backend=hf", "trainer.total_steps=3", "trainer.val_every_steps=1",
                    "trainer.export_hf=false"], tmp_path, "hf")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = metrics(tmp_path / "hf")
    assert [r["step"] for r in rows] == [1, 2, 3] and all("val/accuracy" in r for r in rows)
    for r in rows:
        assert r["rollout/log_prob_diff"] < 1e-3 and r["response/length_mean"] > 0, r
    assert "weight_sync/reload_s" not in rows[0] and all(r["weight_sync/reload_s"] > 0 for r in rows[1:])
    assert all(r["weight_sync/probe_log_prob_gap"] < 1e-3 for r in rows[1:])  # step 1's sync, probed at step 2


def test_grpo_learns_what_its_reward_asks_for(tmp_path):
    """Learning, read from the recipe's own metrics: the default GRPO on the tiny model, rewarded for
    the distinct characters of its answer (tests/e2e/fixtures/varied_reward.py), raises its mean
    reward within 10 steps (0.78 -> 1.41 under Ray, 30 s). Held-out accuracy on the arithmetic task
    takes minutes (docs/results/learning.md). The run is the one-process mode a user without Ray runs
    (placement=local, Ray's import blocked): 34.6 s against 45.4 on Ray (docs/results/ci_times.md)."""
    reward = Path(__file__).parent / "fixtures" / "varied_reward.py"
    args = ["recipe=grpo", "trainer.total_steps=10", "actor.optim.lr=1e-3", f"reward.fn={reward}:score",
            "trainer.export_hf=false", "trainer.val_every_steps=0", "trainer.save_every_steps=0"]
    done = cli_in_one_process.without_ray(args, tmp_path, "learn")  # the default shapes, not SMALL
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = metrics(tmp_path / "learn")
    scores = [r["reward/score"] for r in rows]
    assert len(scores) == 10
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert last > first + 0.25, scores  # +0.45 measured; at lr 1e-9 the same run drifts +0.03
    for row in rows:  # the sampler's log-probs are the actor's on the same weights
        assert row["rollout/log_prob_diff"] < 1e-3, row
    # each step's memory (hybridflow/controller/memory.py, the one process read): the peak since the last read
    # holds at least the engine's KV cache (1 GiB, rollout.kv_cache_space_gib), and the resident set is below it
    for row in rows:  # 1.86 and 1.79 GiB under Ray
        assert row["memory/global_peak_gib"] >= 1.0 and 0 < row["memory/global_rss_gib"] <= row["memory/global_peak_gib"]
    # the rollout-training mismatch of every step's batch (issue 73), clipping against the sampler: the
    # update's first mini-batch before its optimizer step against the engine's log-probs, fp32 both
    for row in rows:
        assert set(MISMATCH) <= set(row), row
        assert row["rollout_mismatch/abs_diff_max"] < 1e-3 and row["rollout_mismatch/k3_kl"] < 1e-6, row
        assert row["rollout_mismatch/outside_band_fraction"] == 0.0 and "rollout_correction/weight_mean" not in row
    # float32 master and copies: every step's update moves (nearly) every sampled weight, and no stall line
    for row in rows:
        assert row["precision/moved_fraction/actor"] > 0.9 and row["precision/moved_fraction/engine"] > 0.9, row
    assert "below" not in done.stdout and "changed only" not in done.stdout


def test_ppo_learns_what_its_reward_asks_for(tmp_path):
    """PPO's learning twin (docs/results/learning.md's PPO rows are bench-length): PPO with its critic
    (GAE) on the tiny model at the default shapes, rewarded as the GRPO run above, raises its mean
    reward within 10 steps, read from the recipe's metrics: 0.93 -> 1.39 over the first and last three
    steps measured (18 s in one process); with the actor's lr at 1e-9 the same run drifts +0.03."""
    reward = Path(__file__).parent / "fixtures" / "varied_reward.py"
    args = ["recipe=ppo", "trainer.total_steps=10", "actor.optim.lr=1e-3", "critic.optim.lr=1e-3",
            "critic.optim.warmup_steps=0", f"reward.fn={reward}:score", "trainer.export_hf=false",
            "trainer.val_every_steps=0", "trainer.save_every_steps=0"]
    done = cli_in_one_process.without_ray(args, tmp_path, "ppo_learn")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = metrics(tmp_path / "ppo_learn")
    scores = [r["reward/score"] for r in rows]
    assert len(scores) == 10 and all("critic/value_loss" in r for r in rows)
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert last > first + 0.25, scores
    values = [r["critic/value_loss"] for r in rows]
    assert sum(values[-3:]) < sum(values[:3]), values  # the critic learns the returns as the policy moves


def test_a_bfloat16_run_whose_updates_round_away_is_named_at_its_first_step(tmp_path):
    """The planted stall (issue 80): GRPO in bfloat16 (actor compute and engine) at lr 1e-9, an Adam step
    far below half a bfloat16 ulp of any weight: the float32 master moves, the copies the policy samples
    from and trains do not. The run's own metric shows it (`precision/moved_fraction/*` ~0 from step 1)
    and the console names it with the fix once; the same run at lr 1e-3 moves most weights and says
    nothing (test_grpo_learns_what_its_reward_asks_for: float32, every weight)."""
    reward = Path(__file__).parent / "fixtures" / "varied_reward.py"  # every group has a gradient
    common = ["recipe=grpo", "trainer.total_steps=2", "model.dtype=bfloat16", "rollout.dtype=bfloat16",
              f"reward.fn={reward}:score", "trainer.export_hf=false", "trainer.val_every_steps=0", ONE_RANK]
    stalled = local([*common, "actor.optim.lr=1e-9"], tmp_path, "stalled")
    assert stalled.returncode == 0, stalled.stdout[-4000:] + stalled.stderr[-4000:]
    for row in metrics(tmp_path / "stalled"):  # the master moves; its bfloat16 copies do not
        assert row["precision/moved_fraction/master"] > 0.5, row
        assert row["precision/moved_fraction/engine"] < 0.01 and row["precision/moved_fraction/actor"] < 0.01, row
    assert stalled.stdout.count("this step's update changed only") == 1, stalled.stdout[-3000:]
    line = next(ln for ln in stalled.stdout.splitlines() if "changed only" in ln)
    assert "of the engine's bfloat16 weights" in line and "model.dtype=float16" in line, line
    moving = local([*common, "actor.optim.lr=1e-3"], tmp_path, "moving")
    assert moving.returncode == 0, moving.stdout[-4000:] + moving.stderr[-4000:]
    for row in metrics(tmp_path / "moving"):
        assert row["precision/moved_fraction/engine"] > 0.5, row
    assert "changed only" not in moving.stdout


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_grpo_in_float16_trains_loss_scaled_and_samples_what_the_actor_computes(tmp_path, engine):
    """float16 end to end (issue 80; `auto` on GPUs): the actor computes in float16 over float32 masters
    with its loss scaled (`precision/loss_scale`), the engine generates in float16, and the sampler's
    log-probs are the actor's within float16's rounding; the update moves most of the float16 copy."""
    reward = Path(__file__).parent / "fixtures" / "varied_reward.py"  # every group has a gradient
    result = local(["recipe=grpo", f"rollout.backend={engine}", "trainer.total_steps=2", "model.dtype=float16",
                    "rollout.dtype=float16", "actor.optim.lr=1e-3", "trainer.export_hf=false", f"reward.fn={reward}:score",
                    "trainer.val_every_steps=0", ONE_RANK], tmp_path, engine)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "precision: model float16, engine float16" in result.stdout
    for row in metrics(tmp_path / engine):
        assert row["precision/loss_scale"] >= 1.0 and row["precision/overflow_retries"] >= 0, row
        assert row["precision/moved_fraction/engine"] > 0.5 and math.isfinite(row["actor/grad_norm"]), row
        assert row["rollout_mismatch/abs_diff_mean"] < 2e-2, row


def test_ppo_with_critic_warmup_kl_penalty_and_a_reference_reset_hook(tmp_path):
    # algorithm.rollout_correction=icepop: the actor recomputes π_old (trainer.old_log_probs=auto chooses it)
    # and ICEPOP weighs every fresh batch's tokens (issue 73)
    # in one process (placement=local): the actor, critic, reference and rollout roles share it
    result = local(["recipe=ppo", "trainer.total_steps=4", "trainer.critic_warmup_steps=1",
                    "algorithm.rollout_correction=icepop",
                    "algorithm.kl_penalty_coef=0.05", "trainer.export_hf=false", "actor.optim.lr=1e-3",
                    "trainer.training_hooks=[{name:reference_reset,params:{every_steps:3}}]"], tmp_path, "ppo")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = metrics(tmp_path / "ppo")
    assert len(rows) == 4
    assert "critic/value_loss" in rows[0] and "actor/loss" not in rows[0]  # step 1: only the critic learns
    for key in STEP_KEYS + ["critic/value_loss", "kl/penalty_mean", "kl/coef", "hooks/applied"]:
        assert key in rows[-1], f"{key} missing"
    kl = [r["kl/penalty_mean"] for r in rows]
    assert kl[0] == pytest.approx(0.0, abs=1e-5) and kl[1] == pytest.approx(0.0, abs=1e-5)  # actor == reference
    assert abs(kl[2]) > 1e-6  # step 3: the actor moved away from the reference at step 2
    assert [r["hooks/applied"] for r in rows[1:]] == [0.0, 1.0, 0.0]
    assert kl[3] == pytest.approx(0.0, abs=1e-5)  # step 4: the reference was reset to the actor after step 3
    for row in rows:  # the mismatch of each batch trained, π_old recomputed: the critic's warm-up step too
        assert set(MISMATCH) <= set(row), row
        assert 0 <= row["rollout_mismatch/abs_diff_mean"] <= row["rollout_mismatch/abs_diff_max"] < 1e-3, row
        assert abs(row["rollout_mismatch/seq_log_ratio_mean"]) <= row["rollout_mismatch/seq_log_ratio_abs_max"] < 1e-2
        # fp32 sampler and actor agree: IcePop's band [0.5, 5] masks nothing and every weight is ρ_t = exp(Δ_t),
        # within |Δ_t| < 1e-3 of 1
        assert row["rollout_correction/masked_fraction"] == 0.0
        assert row["rollout_correction/weight_mean"] == pytest.approx(1.0, abs=2e-3), row


RESUMABLE = ["recipe=grpo", "trainer.total_steps=3", "trainer.save_every_steps=1", "trainer.val_every_steps=2",
             "trainer.export_hf=false"]
COMPARED = ["reward/score", "actor/loss", "actor/grad_norm", "actor/entropy", "response/length_mean",
            "advantages/advantage_std"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, shared_ray_head) -> dict[int, dict]:
    """The uninterrupted 3-step run the fault tests compare with, by step; its console output as
    written (bytes decoded without universal newlines, so a progress line's carriage returns stay)
    and its run directory are `straight[0]`."""
    root = tmp_path_factory.mktemp("straight")
    cmd = [str(VENV_BIN / "hybridflow"), *RESUMABLE, *SMALL, f"logger.output_root={root}", "logger.run_name=straight"]
    result = subprocess.run(cmd, capture_output=True, timeout=600)
    stdout, stderr = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, stdout[-4000:] + stderr[-4000:]
    return {0: {"stdout": stdout, "stderr": stderr, "run_dir": root / "straight"},
            **{r["step"]: r for r in metrics(root / "straight")}}


@ON_RAY
@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
@pytest.mark.budget(140)  # its setup runs the uninterrupted run it is compared with (the `straight` fixture); 350 s in all beside the real model's pipeline on a slow afternoon (b296299)
def test_a_killed_actor_rank_and_a_hung_rollout_each_restart_the_run_which_matches_the_uninterrupted_one(tmp_path,
                                                                                                         straight):
    """Two faults in one run (each start of the stack is a minute of CI's time on a 2-core CPU,
    tests/budget.py): actor rank 1 is killed at the start of step 2, and rollout rank 0 hangs in
    step 3's generate; each is named, the run restarts from its last checkpoint each time, and steps
    2 and 3 give the uninterrupted run's numbers."""
    result = hybridflow([*RESUMABLE, "trainer.max_restarts=2", "+trainer.stage_timeout_s.generate=15",
                         "trainer.fault_injection=[{kind:kill,role:actor,rank:1,step:2},"
                         "{kind:hang,role:rollout,method:generate,step:3}]"], tmp_path, "restarted")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "restart 1 of 2" in result.stdout and "restart 2 of 2" in result.stdout
    killed, hung = [json.loads(line) for line in (tmp_path / "restarted" / "restarts.jsonl").read_text().splitlines()]
    # the first call that reaches the dead process names it: the group (actor+rollout+reward), rank, method, step
    assert killed["step"] == 2 and "failed on rank 1 of 2" in killed["message"]
    assert "the worker process died" in killed["message"]  # named with the last lines it wrote:
    assert f"its last output ({tmp_path / 'restarted' / 'logs' / 'grpo' / 'global-rank1.log'})" in killed["message"]
    # the hang: a stage timeout at the generate stage's deadline, naming the rank that did not answer (rank 1's
    # engine is independent at TP 1 and answered)
    assert hung["step"] == 3 and hung["error"] == "StageTimeoutError"
    assert "stage 'generate' did not finish within 15 s" in hung["message"]
    assert "VLLMRollout.generate rank 0" in hung["message"] and "rank 1" not in hung["message"]
    steps = [r["step"] for r in metrics(tmp_path / "restarted")]
    assert steps == sorted(set(steps)), steps  # each step once, though steps after the checkpoint ran again
    rows = {r["step"]: r for r in metrics(tmp_path / "restarted")}
    assert rows[3]["trainer/restarts"] == 2 and "trainer/restarts" not in rows[1]
    for step in (2, 3):
        for key in COMPARED:
            assert rows[step][key] == pytest.approx(straight[step][key], rel=1e-5, abs=1e-6), (step, key)


@ON_RAY
@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_a_short_run_prints_a_few_lines_and_keeps_the_library_output_in_its_logs(straight):
    """What a run prints (hybridflow/output/console.py): a few lines and one progress line per stage on the
    console; everything vLLM, Ray, transformers and torch print under <run_dir>/logs/ (read on the
    uninterrupted run above: one whole-stack start less, CI's time, tests/budget.py)."""
    stdout, stderr, run_dir = straight[0]["stdout"], straight[0]["stderr"], straight[0]["run_dir"]
    # run directory (start, end), validation at steps 2 and 3, the progress line, the summary, and the
    # no-signal guard's line (the untrained tiny model scores 0 on every sample: hybridflow/training/signal.py)
    assert stdout.count("\n") <= 9, stdout
    assert stderr == "", stderr
    last_draw = stdout.split("\n")[-4].split("\r")[-1]  # the progress line as it was left
    assert last_draw.startswith("grpo 3/3 [") and "reward=" in last_draw and "tok/s=" in last_draw, last_draw
    assert "grpo step 2/3: held-out accuracy" in stdout
    assert "grpo: 3 steps in" in stdout
    logs = run_dir / "logs"
    # Ray's own lines (its start, or its joining the tests' head: tests/ray_head.py) are in the driver's log
    assert "INFO ray._private.worker:" in (logs / "driver.log").read_text()
    for rank in (0, 1):
        worker = (logs / "grpo" / f"global-rank{rank}.log").read_text()
        assert "Initializing a V1 LLM engine" in worker  # vLLM's start-up, from inside the worker process
        # the weight syncs' reloads: the rotary cache and the tied lm_head receive nothing by design
        assert "Failed to load weights" not in worker


