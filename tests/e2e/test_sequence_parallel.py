"""GRPO with the actor's Ulysses sequence parallelism end to end (issue 82; docs/long_sequences.md): two CPU
ranks through Ray, the tiny model, `actor.sequence_parallel_size=2` (one sequence-parallel group that splits
every packed row of the actor's and the reference's forwards over both ranks) against the same run at
SP 1 (two data-parallel ranks), same seed. The rollout and the weight sync are SP's layout-free parts: both
runs sample the same first batch, and the update equals SP 1's to float32's rounding
(tests/unit/test_ulysses.py), so their step metrics agree within that noise, and the SP 2 run trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e import cli_in_one_process

ON_RAY = pytest.mark.usefixtures("shared_ray_head")
# the hf engine (no vLLM start on each rank) and a KL loss, so the reference runs and splits its rows too
ARGS = ["recipe=grpo", "rollout.backend=hf", "trainer.total_steps=2", "trainer.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "rollout.max_response_tokens=8", "actor.samples_per_micro_batch=4",
        "actor.optim.lr=1e-3", "actor.kl_loss_coef=0.1", "actor.entropy_coef=0.01", "trainer.val_every_steps=0",
        "trainer.save_every_steps=0", "trainer.export_hf=false", "data.synthetic.train_rows=64",
        "placement.pools.global.devices_per_node=2"]
# SP 1's to float32's rounding at both steps (measured: 1e-7 relative or closer): step 1 trains on the same
# samples, step 2 samples from weights equal to the last digits (the same tokens unless one sits at a tie),
# its KL loss against the reference that splits its rows too
SAME = ["reward/score", "response/length_mean", "actor/loss", "actor/grad_norm", "actor/entropy", "kl_loss",
        "kl/token_mean"]


def _run(tmp_path: Path, name: str, sp: int) -> list[dict]:
    done = cli_in_one_process.run([*ARGS, f"actor.sequence_parallel_size={sp}", f"logger.output_root={tmp_path}",
                                   f"logger.run_name={name}"])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@ON_RAY
def test_grpo_at_actor_sp_2_on_two_cpu_ranks_trains_and_matches_the_sp_1_run(tmp_path):
    """30 s for both runs on a 2-core EPYC."""
    sp1, sp2 = _run(tmp_path, "sp1", 1), _run(tmp_path, "sp2", 2)
    assert [r["step"] for r in sp2] == [1, 2]
    for step, (one, two) in enumerate(zip(sp1, sp2), start=1):
        for key in SAME:
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), (step, key, two[key], one[key])
        assert two["rollout/log_prob_diff"] < 1e-3  # the SP 2 actor's weights reached the engine
    assert sp2[0]["actor/grad_norm"] > 0 and sp2[0]["precision/moved_fraction/actor"] > 0.9  # it trains
    assert sp2[1]["kl_loss"] > 0  # step 2: the trained actor has moved from the reference
