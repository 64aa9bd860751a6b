"""GRPO through the `hybridflow` command in the placements the resharding engine serves: two
generation engines of TP 2 on the actor's pool, and on a pool of their own. Each run checks
its sync every step (the probe) and with per-tensor checksums, and its metrics say how many
bytes moved against the layout minimum."""

from __future__ import annotations

import pytest

from tests.e2e.test_rl_recipes import hybridflow, metrics

pytestmark = pytest.mark.usefixtures("shared_ray_head")  # its runs join one Ray head (tests/ray_head.py)

SYNC_KEYS = ["weight_sync/bytes_received_per_rank", "weight_sync/min_bytes_per_rank", "weight_sync/seconds",
             "weight_sync/copy_floor_ratio", "weight_sync/probe_log_prob_gap", "weight_sync/verified_tensors"]


# slow (~45 s each alone, ~80 s beside another test): two engines of TP 2 in a pool of 4, vLLM's data
# parallel under the external launcher; colocated, the all-to-all exchange between four training ranks,
# each engine's slices; on a pool of its own, two layouts of two ranks, each layout's boxes broadcast
# once. A single colocated TP 2 engine runs in test_lora.py and test_architectures.py, the rollout on a
# one-rank pool of its own in test_async.py, test_weight_sync.py and tests/controller/test_cluster.py.
TWO_ENGINES = ["rollout.tensor_parallel_size=2"]


@pytest.mark.slow
@pytest.mark.parametrize("placement", [
    ["placement.pools.global.devices_per_node=4", *TWO_ENGINES],
    ["placement=disaggregated", "placement.pools.gen.devices_per_node=4", *TWO_ENGINES]],
    ids=["colocated-2-engines-of-tp2", "disaggregated-2-engines-of-tp2"])
def test_grpo_runs_with_a_checked_sync_in_each_placement(tmp_path, placement):
    result = hybridflow(["recipe=grpo", "trainer.total_steps=2", "trainer.export_hf=false",
                         "weight_sync.checksum_every_steps=1", *placement], tmp_path, "run")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in SYNC_KEYS:
            assert key in row, f"{key} missing"
        assert row["weight_sync/bytes_received_per_rank"] == row["weight_sync/min_bytes_per_rank"]
        assert row["weight_sync/probe_log_prob_gap"] < 1e-3
        assert row["rollout/log_prob_diff"] < 1e-3  # sampler and actor agree after every sync
    assert "val/accuracy" in rows[-1]
    logs = sorted((tmp_path / "run" / "logs").rglob("*-rank*.log"))
    engines = [int(line.rsplit("data_parallel_rank to ", 1)[1].split()[0]) for log in logs
               for line in log.read_text().splitlines() if "Set data_parallel_rank to" in line]
    assert sorted(engines) == [0, 0, 1, 1], engines  # four ranks, two engines of two
