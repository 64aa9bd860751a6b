"""The exact engine (rollout.backend=exact, workers/rollout/exact_rollout.py) through GRPO on the tiny model,
in one process (placement=local, Ray's import blocked): every step's rollout–training mismatch, read from the
run's own metrics.jsonl, is exactly 0.0 — the sampler's log-probs are the actor's recomputed π_old bit for bit
(issue 73, item 4) — and the weight sync moved nothing (the engine computes with the actor's parameters)."""

from __future__ import annotations

from tests.e2e.test_rl_recipes import MISMATCH, local, metrics


def test_grpo_with_the_exact_engine_has_no_rollout_training_mismatch(tmp_path):
    result = local(["recipe=grpo", "rollout.backend=exact", "trainer.total_steps=2", "trainer.val_every_steps=0",
                    "trainer.export_hf=false", "trainer.save_every_steps=0"], tmp_path, "exact")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = metrics(tmp_path / "exact")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert set(MISMATCH) <= set(row), row
        assert row["rollout_mismatch/abs_diff_max"] == 0.0 and row["rollout_mismatch/abs_diff_mean"] == 0.0, row
        assert row["rollout_mismatch/k3_kl"] == 0.0 and row["rollout_mismatch/outside_band_fraction"] == 0.0, row
        assert row["rollout/log_prob_diff"] == 0.0 and row["response/length_mean"] > 0, row
        assert row["weight_sync/bytes_received_per_rank"] == 0.0 and row["weight_sync/min_bytes_per_rank"] == 0.0
        # nothing moved, so the sync's probe has nothing to check (its equality is the mismatch above)
        assert "weight_sync/probe_log_prob_gap" not in row
