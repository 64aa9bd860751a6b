"""Checkpoint retention and integrity end to end: the `hybridflow` command on the tiny model in one
process without Ray (placement=local, Ray's import blocked: tests/e2e/cli_in_one_process.py
`without_ray`; a real FSDP2 actor and vLLM on the CPU), SFT with a checkpoint every step.

One run keeps the full training state of its last 2 checkpoints and the weights of its last 3;
its newest checkpoint's shard is then truncated, and the resumed run names the file, resumes
from the checkpoint before it and reproduces the lost step exactly; the merge reads the
weights-only snapshot.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.cli_in_one_process import without_ray

SMALL = ["recipe=sft", "trainer.prompts_per_step=4", "rollout.max_response_tokens=4", "trainer.val_prompts=8",
         "data.synthetic.train_rows=200", "data.synthetic.val_rows=16", "actor.samples_per_micro_batch=8",
         "trainer.val_every_steps=0", "trainer.export_hf=false", "trainer.save_every_steps=1",
         "trainer.keep_last_checkpoints=2", "trainer.keep_last_weights=3"]


def hybridflow(args: list[str], output_root: Path, run_name: str) -> subprocess.CompletedProcess:
    return without_ray([*SMALL, *args], output_root, run_name)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["actor/loss"]) for r in rows if "actor/loss" in r]


@pytest.mark.slow  # ~57 s; retention and the truncated-shard fallback have unit tests (test_checkpoint_retention, test_checkpoint_integrity)
def test_retention_truncated_shard_falls_back_and_merge_reads_snapshots(tmp_path):
    first = hybridflow(["trainer.total_steps=4"], tmp_path, "sft")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    root = tmp_path / "sft" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003", "step_00000004"]
    snapshot = root / "step_00000002"
    assert sorted(p.name for p in snapshot.iterdir()) == ["COMPLETE", "MANIFEST.json", "hf", "trainer_state.json"]
    assert json.loads((snapshot / "MANIFEST.json").read_text())["full_state"] is False
    for step in (3, 4):
        manifest = json.loads((root / f"step_{step:08d}" / "MANIFEST.json").read_text())
        assert manifest["full_state"] is True and "actor/__0_0.distcp" in manifest["files"]

    before = losses(tmp_path / "sft")
    shard = root / "step_00000004" / "actor" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a write cut short
    resumed = hybridflow(["trainer.total_steps=4", "trainer.resume=true"], tmp_path, "sft")
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert str(shard) in resumed.stdout and "trying the checkpoint before it" in resumed.stdout
    assert f"resumed from {root / 'step_00000003'}" in resumed.stdout
    by_step = losses(tmp_path / "sft")
    assert [s for s, _ in by_step] == [1, 2, 3, 4]  # step 4 lost with its checkpoint, redone, its row replaced
    assert by_step[3][1] == pytest.approx(before[3][1], rel=1e-6)  # ... exactly as the first time
    assert (root / "step_00000004" / "COMPLETE").is_file()
    assert [p.name.startswith("corrupt-step_00000004-") for p in root.iterdir()].count(True) == 1

    from transformers import AutoModelForCausalLM

    from hybridflow.merge import merge_checkpoints
    from hybridflow.merge.checkpoints import last_checkpoints

    inputs = last_checkpoints(tmp_path / "sft", 3)  # step 2 (weights only), 3, 4
    assert [p.parent.name for p in inputs] == ["step_00000002", "step_00000003", "step_00000004"]
    AutoModelForCausalLM.from_pretrained(merge_checkpoints(inputs, tmp_path / "merged", "sma"))
