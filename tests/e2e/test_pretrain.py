"""recipe=pretrain end to end on the tiny model, through the `hybridflow` command in one process
without Ray (placement=local, Ray's import blocked: tests/e2e/cli_in_one_process.py `without_ray`;
the claims are the recipe's, not its processes'): the held-out loss falls; the spike_recovery hook
stays quiet on a normal run, and on a run made to diverge (an lr burst) it fires and the actor then
holds exactly the SMA that `hybridflow-merge` makes offline from the same checkpoints.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.cli_in_one_process import without_ray

VENV_BIN = Path(sys.executable).parent
SMALL = ["recipe=pretrain", "pretrain.generated.train_documents=2000", "pretrain.generated.val_documents=100",
         "pretrain.sequences_per_step=16", "pretrain.val_sequences=32", "actor.optim.warmup_steps=0",
         "actor.optim.lr_schedule=constant", "trainer.keep_last_checkpoints=1", "trainer.keep_last_weights=5"]
HOOK = "{name: spike_recovery, params: {last: 3, window: 8, warmup: 5}}"


def hybridflow(args: list[str], output_root: Path, run_name: str) -> subprocess.CompletedProcess:
    return without_ray([*SMALL, *args], output_root, run_name)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def test_pretrain_learns_keeps_snapshots_and_the_spike_hook_stays_quiet(tmp_path):
    result = hybridflow(["trainer.total_steps=30", "trainer.val_every_steps=10", "trainer.save_every_steps=5",
                         f"trainer.training_hooks=[{HOOK}]"], tmp_path, "pretrain")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = metrics(tmp_path / "pretrain")
    held_out = [r["val/loss"] for r in rows if "val/loss" in r]
    assert len(held_out) == 3 and held_out[-1] < held_out[0] - 0.2, held_out
    assert all(r["spike_recovery/fired"] == 0.0 for r in rows)
    root = tmp_path / "pretrain" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [f"step_{s:08d}" for s in (10, 15, 20, 25, 30)]
    assert json.loads((root / "step_00000025" / "MANIFEST.json").read_text())["full_state"] is False
    assert (tmp_path / "pretrain" / "final_model" / "config.json").is_file()


@pytest.mark.slow  # ~22 s; tests/e2e/test_sft_step_hooks.py checks the same firing and offline SMA
def test_spike_recovery_fires_on_an_lr_burst_and_loads_the_offline_sma(tmp_path):
    # save every 2 steps; the update of step 12 runs at 300x the lr, so the loss logged at step 13 (of
    # the weights saved at 12) spikes; the hook merges the last 3 checkpoints before 12: steps 6, 8, 10.
    # The run ends at step 13, so its final model is the actor right after the recovery.
    burst = "{name: lr_burst, params: {at_step: 12, factor: 300}}"
    result = hybridflow(["trainer.total_steps=13", "trainer.val_every_steps=0", "trainer.save_every_steps=2",
                         f"trainer.training_hooks=[{burst},{HOOK}]"], tmp_path, "burst")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    run_dir = tmp_path / "burst"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows if r["spike_recovery/fired"]] == [13]
    assert rows[-1]["spike_recovery/merged_from_step"] == 6 and rows[-1]["spike_recovery/merged_to_step"] == 10
    assert "spike_recovery: loss" in result.stdout or "spike_recovery: grad_norm" in result.stdout

    offline = tmp_path / "offline_sma"
    inputs = [str(run_dir / "checkpoints" / f"step_{s:08d}") for s in (6, 8, 10)]
    merged = subprocess.run([str(VENV_BIN / "hybridflow-merge"), "--method", "sma", "--output", str(offline),
                             *inputs], capture_output=True, text=True, timeout=300)
    assert merged.returncode == 0, merged.stderr
    expected, actual = weights(offline), weights(run_dir / "final_model")
    assert sorted(expected) == sorted(actual)
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    provenance = json.loads((run_dir / "spike_recovery" / "step_00000013" / "merge_provenance.json").read_text())
    assert provenance["method"] == "sma" and len(provenance["inputs"]) == 3
