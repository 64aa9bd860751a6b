"""Asynchronous GRPO (`trainer.max_staleness`, docs/async.md) through the `hybridflow` command.

- Depth 0 is today's loop: a short seeded GRPO run gives metrics.jsonl equal (timing keys
  aside) to the numbers the loop wrote before the asynchronous schedule existed
  (tests/e2e/fixtures/grpo_sync_metrics.json, written by recipes/ppo.py at a387e58 with
  `GUARD_ARGS` and placement=colocated|disaggregated). On the machine that wrote the fixture they
  are equal bit for bit; another CPU rounds some kernels differently (an AMD EPYC gave grad
  norm 3.3080420 for 3.3080416, a policy loss of -5e-10 for 2e-8), so every number must agree
  to 1e-5 relative or 1e-6 absolute: far below what any change to the loop moves (the same
  run with one more update or another seed moves the grad norm in its first digits). A change
  meant to alter these numbers regenerates the fixture by running those commands and keeping
  the non-timing keys.
- Depth 1 (one-step-off) on a rollout pool of its own: the metrics show the trainer did not
  wait for generation, and every batch's policy version is within the bound.
- Depth 2: two batches in flight, the weights pushed after every update and received while the
  rollout generates (staged), loaded mid-batch (rollout.on_update=recompute): every batch within
  the bound, versions as the rollout stamped them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.e2e.test_rl_recipes import hybridflow, kill_once_checkpointed, metrics

pytestmark = pytest.mark.usefixtures("shared_ray_head")  # its runs join one Ray head (tests/ray_head.py)

FIXTURES = Path(__file__).parent / "fixtures"
# the fixture's samples were drawn with a sampler generator per request, as every run did before one stream
# per batch became the default (rollout.seed_per_request, workers/rollout/vllm_rollout.py)
GUARD_ARGS = ["recipe=grpo", "trainer.total_steps=3", "trainer.export_hf=false", "actor.optim.lr=1e-3",
              f"reward.fn={FIXTURES / 'varied_reward.py'}:score", "rollout.seed_per_request=true"]
TIMING_PREFIXES = ("timing/", "time/", "perf/", "memory/")  # measurements, not numbers of the loop
# Measured on the batch since the fixture was written (hybridflow/algos/mismatch.py; the share of the
# weights an update moved, hybridflow/training/resolution.py): new readings of the same step, not numbers
# the loop computes with (the fixture's other keys must equal)
NEW_READINGS = ("rollout_mismatch/", "precision/", "guard/", "reward/score_std")  # the last two: issue 87
TIMING_KEYS = {"weight_sync/seconds", "weight_sync/copy_floor_ratio", "weight_sync/load_s", "weight_sync/exchange_s"}
# The sync's probe scores its own prompts, not the step's data; they changed on purpose after a387e58
# (a left-padded batch of four lengths, docs/resharding.md), so its gap is no number of the loop's.
PROBE_KEYS = {"weight_sync/probe_log_prob_gap", "weight_sync/probe_log_prob_gap_mean", "weight_sync/probe_log_prob_gap_q90"}
# Over the rows each actor rank trains: trainer.balance_batch (after the fixture) moves rows between the
# ranks, which changes which zero-advantage rows a rank leaves out (PolicyObjective.rows_with_gradient); the loss,
# the gradient norm and every other number of the loop stay the fixture's.
RANK_ROWS_KEYS = {"actor/entropy", "actor/trained_sample_fraction"}


def without_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES + NEW_READINGS)
            and k not in TIMING_KEYS | PROBE_KEYS | RANK_ROWS_KEYS}


@pytest.mark.parametrize("placement", [
    "disaggregated", pytest.param("colocated", marks=pytest.mark.slow)])
def test_max_staleness_0_gives_the_metrics_of_the_loop_before_async(tmp_path, placement):
    expected = json.loads((FIXTURES / "grpo_sync_metrics.json").read_text())[placement]
    result = hybridflow([*GUARD_ARGS, f"placement={placement}", "trainer.max_staleness=0"], tmp_path, "run")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = [without_timing(r) for r in metrics(tmp_path / "run")]
    assert len(rows) == len(expected) == 3
    assert expected[0]["actor/grad_norm"] > 0 and expected[0]["advantages/zero_std_fraction"] < 1  # numbers that move
    expected = [without_timing(r) for r in expected]
    for got, want in zip(rows, expected):
        assert set(got) == set(want), set(got) ^ set(want)
        assert all(same_number(got[k], want[k]) for k in got), \
            {k: (got[k], want[k]) for k in got if not same_number(got[k], want[k])}


def same_number(got: float, want: float) -> bool:
    """Equal up to how differently two CPUs round the same kernels (the module's docstring)."""
    return math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6)


ONE_STEP_OFF = [*GUARD_ARGS[:1], "trainer.total_steps=4", *GUARD_ARGS[2:], "placement=disaggregated",
                "trainer.max_staleness=1", "trainer.old_log_probs=actor", "trainer.val_every_steps=2",
                "trainer.save_every_steps=2"]


@pytest.fixture(scope="module")
def one_step_off(tmp_path_factory) -> Path:
    """A 4-step one-step-off run, checkpointed at steps 2 and 4 (a batch in flight at each)."""
    root = tmp_path_factory.mktemp("async")
    result = hybridflow(ONE_STEP_OFF, root, "run")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return root / "run"


def test_one_step_off_overlaps_generation_with_training_within_the_staleness_bound(one_step_off):
    steps = 4
    rows = metrics(one_step_off)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        step = row["step"]
        # batch s was generated by version s-2 (the first two by the start-up weights) and trains on s-1
        assert row["async/behavior_version_min"] == max(step - 2, 0)
        assert row["async/trained_version"] == step - 1
        assert row["async/staleness_max"] == row["async/staleness_mean"] == min(step - 1, 1)
        # the importance weights pi_old / pi_sampler: exactly 1 on the step-1 batch (same weights), near 1
        # but not 1 one version off (0.989-1.0005 measured, behaviour KL 0.012-0.027)
        if step == 1:
            assert row["rollout_correction/weight_mean"] == pytest.approx(1.0, abs=1e-5)
            assert row["rollout_mismatch/k3_kl"] < 1e-6
        else:
            assert abs(row["rollout_correction/weight_mean"] - 1) < 0.1 and row["rollout_mismatch/k3_kl"] > 1e-3, row
        assert 0 <= row["rollout_correction/clipped_fraction"] <= 1
        assert math.isfinite(row["actor/loss"]) and row["actor/grad_norm"] > 0
    for row in rows[1:]:  # the batch was generated while the previous step scored and trained
        assert row["timing/overlap_fraction"] > 0.2, row
    for row in (rows[1], rows[3]):  # validation drained and pushed the newest weights (step 2 and 4)
        assert row["weight_sync/probe_log_prob_gap"] < 1e-3
    assert "rollout/log_prob_diff" in rows[0] and "rollout/log_prob_diff" not in rows[1]  # same-version only
    assert "val/accuracy" in rows[1] and "val/accuracy" in rows[3]


DYNAMIC = [*(a for a in ONE_STEP_OFF if not a.startswith("reward.fn=")), f"reward.fn={FIXTURES / 'half_agreeing_reward.py'}:score",
           "algorithm.dynamic_sampling_rounds=3", "algorithm.dynamic_sampling_metric=reward",
           "algorithm.dynamic_sampling_on_limit=top_up"]


@pytest.mark.slow  # CI's slow tier: two one-step-off runs on Ray (README "Two commands")
def test_a_one_step_off_run_with_dynamic_sampling_killed_after_a_checkpoint_resumes_prompt_for_prompt(tmp_path):
    """Dynamic sampling draws extra prompts in rounds, one step ahead of the step that trains on them.
    The driver is killed (SIGKILL, its whole process group) once the step-2 checkpoint is complete, with
    step 3's batch in flight; resumed, steps 3 and 4 train on the drained batch: the uninterrupted run's
    prompts (trained_prompts.jsonl, line for line, each step once) and its metrics (issue 87: NeMo-RL #3599)."""
    whole = hybridflow(DYNAMIC, tmp_path, "whole")
    assert whole.returncode == 0, whole.stdout[-4000:] + whole.stderr[-4000:]
    rows = metrics(tmp_path / "whole")
    assert any(r["dynamic_sampling/rounds"] > 0 for r in rows), rows  # extra rounds drew extra prompts
    kill_once_checkpointed(DYNAMIC, tmp_path, "run", step=2)
    run_dir = tmp_path / "run"
    state = json.loads((run_dir / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert [b["step"] for b in state["rollouts"]["in_flight"]] == [3]  # the drained batch is in the checkpoint
    result = hybridflow([*DYNAMIC, "trainer.resume=true"], tmp_path, "run")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "resumed from" in result.stdout
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    trained = (run_dir / "trained_prompts.jsonl").read_text()
    assert trained == (tmp_path / "whole" / "trained_prompts.jsonl").read_text()
    assert [json.loads(line)["step"] for line in trained.splitlines()] == [1, 2, 3, 4]
    for got, want in zip(metrics(run_dir)[2:], rows[2:]):
        got, want = without_timing(got), without_timing(want)
        assert got == want, {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}


COLLAPSE_AT_STEP_5 = '''
import itertools

CALLS = itertools.count()  # one call per sample, 16 samples a step, no validation before the end


def score(response, ground_truth, data_source):
    """The distinct characters of the response, except on step 5's samples: a reward collapse."""
    step = next(CALLS) // 16 + 1
    return {"score": -10.0 if step == 5 else len(set(response)) / 8.0}
'''


@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_spike_recovery_one_step_off_generates_the_batch_in_flight_again_with_the_recovered_weights(tmp_path):
    """max_staleness=1: step 5's reward collapses (the reward function says so) while batch 6
    generates. spike_recovery fires at step 5, loads the SMA of the checkpoints of steps 2 and 3,
    and puts the prompts of steps 4 and 5 back; batch 6 keeps its prompts (drawn ahead, not put
    back) and is generated again by the recovered weights, so step 6 trains on a batch of the
    version it trains on; the run finishes."""
    reward = tmp_path / "collapse.py"
    reward.write_text(COLLAPSE_AT_STEP_5)
    hook = "{name: spike_recovery, params: {last: 2, window: 3, warmup: 2, data: reshuffle}}"
    result = hybridflow(["recipe=grpo", "trainer.total_steps=7", "trainer.export_hf=false", "actor.optim.lr=1e-3",
                         f"reward.fn={reward}:score", "placement=disaggregated", "trainer.max_staleness=1",
                         "trainer.old_log_probs=actor", "trainer.save_every_steps=1", "trainer.val_every_steps=0",
                         f"trainer.training_hooks=[{hook}]"], tmp_path, "spike")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = {r["step"]: r for r in metrics(tmp_path / "spike")}
    assert [s for s, r in rows.items() if r["spike_recovery/fired"]] == [5]
    assert rows[5]["spike_recovery/merged_from_step"] == 2 and rows[5]["spike_recovery/merged_to_step"] == 3
    assert rows[5]["spike_recovery/requeued_rows"] == 8  # steps 4 and 5, 4 prompts each
    # version 5 = the update of step 5, version 6 = the recovered weights that replaced it
    assert rows[5]["async/trained_version"] == 4 and rows[6]["async/trained_version"] == 6
    assert rows[6]["async/behavior_version_min"] == 6 and rows[6]["async/staleness_max"] == 0
    assert rows[7]["async/behavior_version_min"] == 6 and rows[7]["async/staleness_max"] == 1
    assert "steps 4-5 requeued (8 rows)" in result.stdout
    checkpoints = tmp_path / "spike" / "checkpoints"
    before = json.loads((checkpoints / "step_00000004" / "trainer_state.json").read_text())["loader"]
    after = json.loads((checkpoints / "step_00000005" / "trainer_state.json").read_text())["loader"]
    drawn = {d["step"]: d["rows"] for d in before["recent"] + after["recent"]}
    assert [d["step"] for d in after["recent"]] == [6]  # in flight: drawn, not put back
    assert set(drawn[4] + drawn[5]) <= set(after["queue"]) and not set(drawn[6]) & set(after["queue"])
    assert len(after["queue"]) == 200 - 6 * 4 + 8  # the epoch's undrawn rows and the 8 put back, once each


@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_two_batches_in_flight_on_a_tp2_rollout_stay_within_the_bound_and_a_rollout_killed_meanwhile_is_named(
        tmp_path):
    """Depth 2 with partial rollouts (rollout.on_update=recompute: weights that arrive mid-batch are
    loaded between two engine steps) on a TP-2 engine, checksums on every push: the engine's two ranks
    agree, at every load (before a batch and between engine steps), on the newest version both hold
    (also tested in-process: tests/e2e/test_weight_sync.py, a rank that lags on purpose), each rank
    receives the layout minimum, and the validation drains' probes find the engine computing the
    actor's model. The rollout's rank 0 is killed at the start of step 4, with batches in flight and
    a push beside them: the first wait that reaches the dead process names it (step 4's, or step 5's
    finishing of the push step 4 started, when the tiny model had already generated the batches in
    flight), the run restarts from its last checkpoint (the drained batches in it) and finishes within
    the bound. One run for the TP-2 and the fault claims (each start of the stack is a minute of CI's
    time on a 2-core CPU, tests/budget.py)."""
    steps = 5
    result = hybridflow([*GUARD_ARGS[:1], f"trainer.total_steps={steps}", *GUARD_ARGS[2:], "placement=disaggregated",
                         "placement.pools.gen.devices_per_node=2", "rollout.tensor_parallel_size=2",
                         "trainer.max_staleness=2", "trainer.old_log_probs=actor", "trainer.val_every_steps=3",
                         "rollout.on_update=recompute", "weight_sync.checksum_every_steps=1",
                         "trainer.save_every_steps=2", "trainer.max_restarts=1",
                         "trainer.fault_injection=[{kind:kill,role:rollout,rank:0,step:4}]"], tmp_path, "d2")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = {r["step"]: r for r in metrics(tmp_path / "d2")}  # a step run again after the restart: its last row
    assert sorted(rows) == list(range(1, steps + 1)) and rows[steps]["trainer/restarts"] == 1
    for row in rows.values():
        trained = row["async/trained_version"]
        assert trained == row["step"] - 1
        assert trained - 2 <= row["async/behavior_version_min"] <= trained and row["async/staleness_max"] <= 2
        assert row["async/rollout_weights_wait_s"] >= 0 and math.isfinite(row["actor/loss"])
        assert 0 <= row["async/version_span_max"] <= 2  # a sample's tokens: versions within the bound
        if "weight_sync/bytes_received_per_rank" in row:  # the push this step finished: the layout minimum
            assert row["weight_sync/bytes_received_per_rank"] == row["weight_sync/min_bytes_per_rank"]
    assert max(r["async/staleness_max"] for r in rows.values()) >= 1
    for step in (3, steps):  # drained, loaded, probed
        assert rows[step]["weight_sync/probe_log_prob_gap"] < 1e-3 and "val/accuracy" in rows[step]
    assert sum("weight_sync/seconds" in r for r in rows.values()) >= 2  # pushes finished beside generation
    restart = json.loads((tmp_path / "d2" / "restarts.jsonl").read_text().splitlines()[0])
    head = "\n".join(restart["message"].splitlines()[:2])
    assert restart["step"] in (4, 5) and "the worker process died" in head and "'gen:rollout'" in head, restart


@pytest.mark.slow  # ~90 s; the deadline a call keeps across stages is tested in the default run by
# tests/controller/test_worker_group.py, a role killed during the overlap also by the depth-2 test above
def test_a_rollout_hung_while_the_trainer_trains_and_an_actor_killed_one_step_off_are_named_and_restarted(tmp_path):
    """Two faults of a one-step-off run, one run for both (each start of the stack is a minute of CI's
    time on a 2-core CPU, tests/budget.py). The batch for step 3 is launched in step 2's generate
    stage, on a rollout hung at the start of step 2; step 2's validation drains it, outside any
    stage: the wait ends at the deadline the launch was issued under (15 s, not the 3600 s default),
    names the rank, and the run restarts from its step-1 checkpoint. Then the actor is killed at the
    start of step 3, while batch 4 generates: the first call that reaches its process (which also
    hosts the reward) names the group; the run restarts again and finishes."""
    result = hybridflow([*ONE_STEP_OFF, "trainer.max_restarts=2", "trainer.save_every_steps=1",
                         "+trainer.stage_timeout_s.generate=15",
                         "trainer.fault_injection=[{kind:hang,role:rollout,method:generate,step:2},"
                         "{kind:kill,role:actor,rank:0,step:3}]"], tmp_path, "faults")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    hung, killed = [json.loads(line) for line in (tmp_path / "faults" / "restarts.jsonl").read_text().splitlines()]
    assert hung["error"] == "StageTimeoutError" and hung["step"] == 2
    assert "stage 'generate' did not finish within 15 s" in hung["message"]
    assert "VLLMRollout.generate rank 0" in hung["message"]
    head = "\n".join(killed["message"].splitlines()[:2])
    assert killed["step"] == 3 and "the worker process died" in head and "'train:actor+reward'" in head, killed
    rows = {r["step"]: r for r in metrics(tmp_path / "faults")}
    assert sorted(rows) == [1, 2, 3, 4] and rows[4]["trainer/restarts"] == 2
    assert all(r["async/staleness_max"] <= 1 for r in rows.values())
