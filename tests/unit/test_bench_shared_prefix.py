"""bench/shared_prefix.py's dry run: its real code path at the smallest shape, so it cannot rot."""

from __future__ import annotations

from tests.unit.test_bench_dry_runs import _dry_run


def test_the_shared_prefix_bench_times_both_sides_and_compares_their_log_probs(tmp_path):
    report = _dry_run("shared_prefix.py", tmp_path / "shared_prefix.json")
    assert report["unshared_update_s"] > 0 and report["shared_update_s"] > 0
    assert report["speedup_update_s"] == report["unshared_update_s"] / report["shared_update_s"]
    # 2 prompts x 4 samples of 16 + up to 8 tokens: each prompt computed once instead of 4 times
    assert report["shared_sharing_saved_tokens"] == 2 * 3 * 16
    assert report["unshared_computed_tokens"] - report["shared_computed_tokens"] == 2 * 3 * 16
    assert report["max_log_prob_gap"] < 1e-4  # float32: the same log-probs
